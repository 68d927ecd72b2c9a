"""One layer of the LTE router's CNN, silu(conv(dropout(x)) + bias), with the heads leading.

`grouped_conv_same` is the per-head 1-D convolution with 'same' zero padding: one batched matmul
(heads leading, so no transpose) gives every tap's output y_i = x W_i at once; shifting y_i by the
tap's offset and summing equals shifting the input (the conv is linear per position and zeros
stay zeros), without stacking shifted copies of the input. (A grouped `lax.conv_general_dilated`
over token-major channels, the reference model's form, took 7.5x as long forward and backward on
an H200: tools/bench_router.py.) The taps' outputs are in the input's dtype (each accumulated in
float32 by the matmul) and summed in float32: in bf16 that halves the bytes of the largest
tensors of the router, forward and backward (the three conv layers of lalte-0.4b at B4 T4096,
forward and backward: 1.28 -> 0.77 ms on an H200).

The pre-activation (conv + bias, before the SiLU) carries the checkpoint name PRE_ACTIVATION,
which the remat policy "attention" saves (lalte_jax/model.py): its backward then needs no
recomputed convolution, only the elementwise SiLU and the dropout mask from the counter hash.
(lalte-0.4b at B4 T4096 on one H200, 2026-11-29: 107,337 -> 108,211 tokens/s, peak 10.8 -> 10.0
GiB.) A fused Pallas forward and backward of the layer measured 2.7x slower than this form
(tools/bench_router.py, the same day) and was removed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lalte_jax.layers import counter_hash

# The pre-activation's name for remat policies (ModelConfig.remat "attention" saves it).
PRE_ACTIVATION = "lte_router_pre_activation"


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
              seed: jax.Array | None = None, mask_BT: jax.Array | None = None, *, rate: float,
              dilation: int) -> jax.Array:
  """silu(conv(dropout(x)) + bias): one router layer, [K, B, T, C] -> [K, B, T, O] in x's dtype.

  Args:
    x_KBTC: the layer's input, heads leading.
    weight_KICO: [K, taps, C, O] per-head taps (odd count; 'same' zero padding at `dilation`).
    bias_KO: [K, O].
    seed: uint32 [2], the dropout's seed words (`counter_hash.seed_words` of the layer's key);
      None: no dropout.
    mask_BT: bool [B, T], True at real tokens: the conv output is zeroed elsewhere before the
      SiLU (they then read as zero padding to the next layer); None: every token is real.
    rate: the dropout rate in [0, 1).
  """
  heads, _, _, channels = x_KBTC.shape
  if weight_KICO.shape[0] != heads or weight_KICO.shape[2] != channels:
    raise ValueError(f"router_conv.conv_silu: weight_KICO {weight_KICO.shape} does not fit"
                     f" x_KBTC {x_KBTC.shape}")
  if weight_KICO.shape[1] % 2 != 1:
    raise ValueError(f"router_conv.conv_silu: 'same' padding needs an odd tap count, got"
                     f" {weight_KICO.shape[1]}")
  dtype = x_KBTC.dtype
  x_KBTC = dropped(x_KBTC, seed, rate)
  h_KBTO = (grouped_conv_same(x_KBTC, weight_KICO.astype(dtype), dilation).astype(dtype)
            + bias_KO.astype(dtype)[:, None, None, :])
  if mask_BT is not None:
    h_KBTO = h_KBTO * mask_BT[None, :, :, None].astype(dtype)
  return jax.nn.silu(checkpoint_name(h_KBTO, PRE_ACTIVATION))
