"""The LTE router (§4.1): a small per-KV-head CNN over concat(k_pre_rope, v).

Per KV head the channel widths halve at each conv layer, 2D -> D -> D/2 -> D/4 for the paper's
three layers (kernel 3, dilation 2, 'same' zero padding at every layer, with bias), then a 1x1
projection to one logit (bias initialised to +0.5). Each layer is `Dropout -> Conv -> [padding
mask] -> SiLU`; dropout hits the raw KV input of the first layer and the activations feeding the
later ones, never the projection (G8). Heads have independent weights (the reference's grouped
convolution, groups = Hkv).

With kernel size 1 everywhere the router sees no context: the LTE-MLP ablation (§7.3).

score = sigmoid(logit) - 0.5, so a token is kept iff score > 0 (G2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import LTEConfig
from lalte_jax.layers import initializers
from lalte_jax.layers.dropout import dropout


def channel_widths(head_dim: int, num_layers: int) -> tuple[int, ...]:
  """(2D, D, D/2, ...) : input width then the output width of each conv layer."""
  return tuple((2 * head_dim) >> i for i in range(num_layers + 1))


def grouped_conv_same(h_KBTC: jax.Array, weight_KICO: jax.Array, dilation: int) -> jax.Array:
  """Per-head 1-D convolution with 'same' zero padding, float32 [K, B, T, O].

  One batched matmul (heads leading, so no transpose) gives every tap's output y_i = h W_i at
  once; shifting y_i by the tap's offset and summing equals shifting the input (the conv is linear
  per position and zeros stay zeros), without stacking shifted copies of the input. (A grouped
  `lax.conv_general_dilated` over token-major channels, the reference's form, took 7.5x as long
  forward and backward on an H200: tools/bench_router.py.) The taps' outputs are in the input's
  dtype (each accumulated in float32 by the matmul) and summed in float32: in bf16 that halves
  the bytes of the largest tensors of the router, forward and backward (the three conv layers of
  lalte-0.4b at B4 T4096, forward and backward: 1.28 -> 0.77 ms on an H200).
  """
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


class LTERouter(nnx.Module):

  def __init__(self, lte: LTEConfig, *, rngs: nnx.Rngs):
    self.config = lte
    widths = channel_widths(lte.head_dim, len(lte.router_kernel_sizes))
    heads = lte.num_kv_heads
    self.conv_weights = nnx.List()
    self.conv_biases = nnx.List()
    for kernel_size, c_in, c_out in zip(lte.router_kernel_sizes, widths[:-1], widths[1:]):
      fan_in = c_in * kernel_size
      self.conv_weights.append(nnx.Param(initializers.kaiming_normal_relu(fan_in)(
          rngs.params(), (heads, kernel_size, c_in, c_out))))
      bound = initializers.kaiming_uniform_bound(fan_in)
      self.conv_biases.append(nnx.Param(initializers.symmetric_uniform(bound)(
          rngs.params(), (heads, c_out))))
    self.proj_weight = nnx.Param(initializers.kaiming_normal_relu(widths[-1])(
        rngs.params(), (heads, widths[-1])))
    self.proj_bias = nnx.Param(jnp.full((heads,), 0.5, jnp.float32))

  def __call__(self, k_BTKD: jax.Array, v_BTKD: jax.Array, *, mask_BT: jax.Array | None = None,
               dropout_key: jax.Array | None = None) -> jax.Array:
    """Scores [B, T, Hkv] float32 in (-0.5, 0.5) from pre-RoPE keys and values.

    mask_BT (bool, True = real token) zeroes padded tokens' features and every conv output at
    padded positions, the same as zero padding there. `dropout_key` turns dropout on (training).
    """
    lte = self.config
    dtype = k_BTKD.dtype
    # Heads lead ([K, B, T, C]) for the whole CNN: each conv is then one batched matmul.
    h_KBTC = jnp.transpose(jnp.concatenate([k_BTKD, v_BTKD], axis=-1),  # key dims, then value dims
                           (2, 0, 1, 3))
    mask_1BT1 = None if mask_BT is None else mask_BT[None, :, :, None].astype(dtype)
    if mask_1BT1 is not None:
      h_KBTC = h_KBTC * mask_1BT1
    layer_keys = ([None] * len(self.conv_weights) if dropout_key is None else
                  list(jax.random.split(dropout_key, len(self.conv_weights))))
    for weight, bias, dilation, key in zip(self.conv_weights, self.conv_biases,
                                           lte.router_dilations, layer_keys):
      h_KBTC = dropout(h_KBTC, lte.router_dropout, key, layout="KBTC")
      h_KBTC = (grouped_conv_same(h_KBTC, weight[...].astype(dtype), dilation).astype(dtype)
                + bias[...].astype(dtype)[:, None, None, :])
      if mask_1BT1 is not None:
        h_KBTC = h_KBTC * mask_1BT1
      h_KBTC = jax.nn.silu(h_KBTC)
    logit_KBT = jnp.einsum("kbtc,kc->kbt", h_KBTC, self.proj_weight[...].astype(dtype),
                           preferred_element_type=jnp.float32) + self.proj_bias[...][:, None, None]
    return jax.nn.sigmoid(jnp.transpose(logit_KBT, (1, 2, 0))) - 0.5
