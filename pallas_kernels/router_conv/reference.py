"""One layer of the LTE router's CNN in jnp: silu(conv(dropout(x)) + bias), heads leading.

`grouped_conv_same` is the per-head 1-D convolution with 'same' zero padding: one batched matmul
(heads leading, so no transpose) gives every tap's output y_i = x W_i at once; shifting y_i by the
tap's offset and summing equals shifting the input (the conv is linear per position and zeros
stay zeros), without stacking shifted copies of the input. (A grouped `lax.conv_general_dilated`
over token-major channels, the reference model's form, took 7.5x as long forward and backward on
an H200: tools/bench_router.py.) The taps' outputs are in the input's dtype (each accumulated in
float32 by the matmul) and summed in float32: in bf16 that halves the bytes of the largest
tensors of the router, forward and backward (the three conv layers of lalte-0.4b at B4 T4096,
forward and backward: 1.28 -> 0.77 ms on an H200).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import counter_hash


def grouped_conv_same(h_KBTC: jax.Array, weight_KICO: jax.Array, dilation: int) -> jax.Array:
  """Per-head 1-D convolution with 'same' zero padding, float32 [K, B, T, O]."""
  heads, batch, length, _ = h_KBTC.shape
  kernel_size, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  y_KBTIO = jnp.einsum("kbtc,kico->kbtio", h_KBTC, weight_KICO)
  half = (kernel_size // 2) * dilation
  padded_KBTIO = jnp.pad(y_KBTIO, ((0, 0), (0, 0), (half, half), (0, 0), (0, 0)))
  out_KBTO = jnp.zeros((heads, batch, length, c_out), jnp.float32)
  for i in range(kernel_size):  # out[t] = sum_i y_i[t + i * dilation - half]
    out_KBTO = out_KBTO + padded_KBTIO[:, :, i * dilation:i * dilation + length, i].astype(
        jnp.float32)
  return out_KBTO


def dropped(x_KBTC: jax.Array, seed: jax.Array | None, rate: float) -> jax.Array:
  """Inverted dropout of heads-first activations with the counter hash's mask of `seed`; the
  identity without a seed or at rate 0."""
  if seed is None or rate == 0.0:
    return x_KBTC
  keep_KBTC = counter_hash.keep_mask(seed, x_KBTC.shape, rate, layout="KBTC")
  return jnp.where(keep_KBTC, x_KBTC / (1.0 - rate), jnp.zeros_like(x_KBTC))


def conv_silu(x_KBTC: jax.Array, weight_KICO: jax.Array, bias_KO: jax.Array,
              seed: jax.Array | None, mask_BT: jax.Array | None, rate: float, dilation: int
              ) -> jax.Array:
  """silu(conv(dropout(x)) + bias) [K, B, T, O] in x's dtype; the conv output is zeroed at the
  masked-out positions before the SiLU (they then read as zero padding to the next layer)."""
  dtype = x_KBTC.dtype
  x_KBTC = dropped(x_KBTC, seed, rate)
  h_KBTO = (grouped_conv_same(x_KBTC, weight_KICO.astype(dtype), dilation).astype(dtype)
            + bias_KO.astype(dtype)[:, None, None, :])
  if mask_BT is not None:
    h_KBTO = h_KBTO * mask_BT[None, :, :, None].astype(dtype)
  return jax.nn.silu(h_KBTO)
