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


def channel_widths(head_dim: int, num_layers: int) -> tuple[int, ...]:
  """(2D, D, D/2, ...) : input width then the output width of each conv layer."""
  return tuple((2 * head_dim) >> i for i in range(num_layers + 1))


def same_padded_taps(x_BTHC: jax.Array, kernel_size: int, dilation: int) -> jax.Array:
  """[B, T, K, H, C]: for each tap i the input shifted by (i - K//2) * dilation, zero outside."""
  half = (kernel_size // 2) * dilation
  length = x_BTHC.shape[1]
  padded = jnp.pad(x_BTHC, ((0, 0), (half, half), (0, 0), (0, 0)))
  return jnp.stack([padded[:, i * dilation:i * dilation + length] for i in range(kernel_size)],
                   axis=2)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
  """Inverted dropout; identity when `key` is None (evaluation) or rate is 0."""
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


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
    h_BTKC = jnp.concatenate([k_BTKD, v_BTKD], axis=-1)  # channels: key dims, then value dims
    mask_BT11 = None if mask_BT is None else mask_BT[:, :, None, None].astype(dtype)
    if mask_BT11 is not None:
      h_BTKC = h_BTKC * mask_BT11
    layer_keys = ([None] * len(self.conv_weights) if dropout_key is None else
                  list(jax.random.split(dropout_key, len(self.conv_weights))))
    for weight, bias, kernel_size, dilation, key in zip(
        self.conv_weights, self.conv_biases, lte.router_kernel_sizes, lte.router_dilations,
        layer_keys):
      h_BTKC = dropout(h_BTKC, lte.router_dropout, key)
      taps_BTIKC = same_padded_taps(h_BTKC, kernel_size, dilation)
      h_BTKC = jnp.einsum("btikc,kico->btko", taps_BTIKC, weight[...].astype(dtype)) + \
          bias[...].astype(dtype)
      if mask_BT11 is not None:
        h_BTKC = h_BTKC * mask_BT11
      h_BTKC = jax.nn.silu(h_BTKC)
    logit_BTK = jnp.einsum("btkc,kc->btk", h_BTKC, self.proj_weight[...].astype(dtype)) + \
        self.proj_bias[...].astype(dtype)
    return jax.nn.sigmoid(logit_BTK.astype(jnp.float32)) - 0.5
