"""The LTE router's CNN in jnp: per KV head, layers silu(conv(dropout(x)) + bias), then a linear
projection to one logit.

The convolution is the per-head dilated 1-D convolution with 'same' zero padding as one batched
matmul (heads leading, so no transpose) that gives every tap's output y_i = x W_i at once; each y_i
is shifted by its tap's offset and the shifted outputs summed. That equals shifting the input (the
conv is linear per position and zeros stay zeros) without stacking shifted copies of the input.
The taps' outputs are in the input's dtype (each accumulated in float32 by the matmul) and summed
in float32. Forms that XLA ran slower (one H200, lalte-0.4b router at B4 T4096, forward and
backward): a grouped `lax.conv_general_dilated` over token-major channels, the reference model's
form, 7.5x; the taps' shifted inputs in one matmul, 2.3x; the taps in float32, 1.7x.

Each pre-activation (conv + bias) is named ROUTER_ACTIVATION, which the remat policies
"attention" and "dots_attention" save: the backward then recomputes no convolution, only the
SiLU and the dropout masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from pallas_kernels.lte_router import counter_hash

# The activations the router keeps for its backward, by name for remat policies.
ROUTER_ACTIVATION = "lte_router_activation"


def dropped(x_KBTC: jax.Array, seed: jax.Array | None, rate: float, row_offset=0) -> jax.Array:
  """Inverted dropout of heads-first activations with the counter hash's mask of `seed` (rows
  numbered from `row_offset`); the identity without a seed or at rate 0."""
  if seed is None or rate == 0.0:
    return x_KBTC
  keep_KBTC = counter_hash.keep_mask(seed, x_KBTC.shape, rate, layout="KBTC",
                                     row_offset=row_offset)
  return jnp.where(keep_KBTC, x_KBTC / (1.0 - rate), jnp.zeros_like(x_KBTC))


def head_conv(x_KBTC: jax.Array, weight_KICO: jax.Array, bias_KO: jax.Array, *,
              dilation: int, valid: bool = False) -> jax.Array:
  """conv(x) + bias in x's dtype, [K, B, T, O]: the float32 sum of the taps rounded to x's dtype,
  then the bias added in that dtype. `valid`: only the T - 2 half outputs whose taps all lie in
  x (no padding), [K, B, T - 2 half, O]."""
  dtype = x_KBTC.dtype
  heads, batch, length, _ = x_KBTC.shape
  kernel_size, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  y_KBTIO = jnp.einsum("kbtc,kico->kbtio", x_KBTC, weight_KICO.astype(dtype))
  half = (kernel_size // 2) * dilation
  if valid:
    length -= 2 * half
  else:
    y_KBTIO = jnp.pad(y_KBTIO, ((0, 0), (0, 0), (half, half), (0, 0), (0, 0)))
  out_KBTO = jnp.zeros((heads, batch, length, c_out), jnp.float32)
  for i in range(kernel_size):  # out[t] = sum_i y_i[t + i * dilation - half]
    out_KBTO = out_KBTO + y_KBTIO[:, :, i * dilation:i * dilation + length, i].astype(
        jnp.float32)
  return out_KBTO.astype(dtype) + bias_KO.astype(dtype)[:, None, None, :]


def router_logits(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, *,
                  dilations, rate, mask_BT=None, row_offset=0):
  """logit [B, T, K] float32 (see lte_router.router_logits)."""
  dtype = k_BTKD.dtype
  # Heads lead ([K, B, T, C]) for the whole CNN: each conv is one batched matmul.
  x_KBTC = jnp.transpose(jnp.concatenate([k_BTKD, v_BTKD], axis=-1), (2, 0, 1, 3))
  if mask_BT is not None:
    x_KBTC = x_KBTC * mask_BT[None, :, :, None].astype(dtype)
  for layer, (weight, bias, dilation) in enumerate(zip(weights, biases, dilations)):
    x_KBTC = dropped(x_KBTC, None if seeds is None else seeds[layer], rate, row_offset)
    pre_KBTO = head_conv(x_KBTC, weight, bias, dilation=dilation)
    if mask_BT is not None:
      pre_KBTO = pre_KBTO * mask_BT[None, :, :, None].astype(dtype)
    x_KBTC = jax.nn.silu(checkpoint_name(pre_KBTO, ROUTER_ACTIVATION))
  logit_KBT = (jnp.einsum("kbtc,kc->kbt", x_KBTC, proj_weight_KC.astype(dtype),
                          preferred_element_type=jnp.float32)
               + proj_bias_K.astype(jnp.float32)[:, None, None])
  return jnp.transpose(checkpoint_name(logit_KBT, ROUTER_ACTIVATION), (1, 2, 0))
