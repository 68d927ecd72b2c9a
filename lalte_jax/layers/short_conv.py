"""Causal depthwise short convolution (GDN's q/k/v convs, §2 step 1), no bias.

Weight [C, K] in PyTorch cross-correlation order: tap K-1 multiplies the current token, tap 0 the
token K-1 steps back. The output at t reads only inputs <= t: the K-1 inputs before the first one
are the given state (oldest first), zeros at the start of a sequence. Training and prefill start
from zeros; a decode step passes the K-1 inputs before its token (GDN keeps them in a ring,
`lalte_jax.inference.caches.GDNCache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.layers import initializers


def causal_depthwise_conv(x_BTC: jax.Array, weight_CK: jax.Array,
                          state_BKC: jax.Array | None = None) -> jax.Array:
  """The convolution of x continuing after `state_BKC` [B, K-1, C] (None: zeros)."""
  kernel_size = weight_CK.shape[1]
  length = x_BTC.shape[1]
  if state_BKC is None:
    full_BSC = jnp.pad(x_BTC, ((0, 0), (kernel_size - 1, 0), (0, 0)))
  else:
    full_BSC = jnp.concatenate([state_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
  weight = weight_CK.astype(x_BTC.dtype)
  # K shifted views (K = 4): cheaper to read than a general conv and exactly the reference order.
  return sum(full_BSC[:, i:i + length, :] * weight[:, i] for i in range(kernel_size))


class ShortConv(nnx.Module):
  """`SiLU(causal_depthwise_conv(x))`."""

  def __init__(self, channels: int, kernel_size: int, *, init_std: float, rngs: nnx.Rngs):
    self.weight = nnx.Param(initializers.normal(init_std)(rngs.params(), (channels, kernel_size)))

  def __call__(self, x_BTC: jax.Array, state_BKC: jax.Array | None = None) -> jax.Array:
    return jax.nn.silu(causal_depthwise_conv(x_BTC, self.weight[...], state_BKC))
