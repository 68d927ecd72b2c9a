"""The short convolution of GDN's q/k/v in jnp: SiLU of a causal depthwise convolution, no bias.

Weight [C, K] in PyTorch cross-correlation order: tap K-1 multiplies the current token, tap 0 the
token K-1 steps back. The output at t reads only inputs <= t: the K-1 inputs before the first one
are the given state (oldest first), zeros at the start of a sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_depthwise_conv(x_BTC: jax.Array, weight_CK: jax.Array,
                          state_BKC: jax.Array | None = None) -> jax.Array:
  """The convolution of x continuing after `state_BKC` [B, K-1, C] (None: zeros), in x's dtype
  (the weight rounded to it first)."""
  kernel_size = weight_CK.shape[1]
  length = x_BTC.shape[1]
  if state_BKC is None:
    full_BSC = jnp.pad(x_BTC, ((0, 0), (kernel_size - 1, 0), (0, 0)))
  else:
    full_BSC = jnp.concatenate([state_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
  weight = weight_CK.astype(x_BTC.dtype)
  # K shifted views (K = 4): cheaper to read than a general conv and exactly the reference order.
  return sum(full_BSC[:, i:i + length, :] * weight[:, i] for i in range(kernel_size))


def short_conv_silu(x_BTC: jax.Array, weight_CK: jax.Array,
                    state_BKC: jax.Array | None = None) -> jax.Array:
  return jax.nn.silu(causal_depthwise_conv(x_BTC, weight_CK, state_BKC))
