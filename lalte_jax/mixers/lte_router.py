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
from lalte_jax.layers import counter_hash, initializers, router_conv


def channel_widths(head_dim: int, num_layers: int) -> tuple[int, ...]:
  """(2D, D, D/2, ...) : input width then the output width of each conv layer."""
  return tuple((2 * head_dim) >> i for i in range(num_layers + 1))


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
    with jax.named_scope("lte_router"):  # names the router's kernels in profiles
      return self._scores(k_BTKD, v_BTKD, mask_BT, dropout_key)

  def _scores(self, k_BTKD, v_BTKD, mask_BT, dropout_key):
    lte = self.config
    dtype = k_BTKD.dtype
    # Heads lead ([K, B, T, C]) for the whole CNN: each conv is then one batched matmul.
    h_KBTC = jnp.transpose(jnp.concatenate([k_BTKD, v_BTKD], axis=-1),  # key dims, then value dims
                           (2, 0, 1, 3))
    if mask_BT is not None:
      h_KBTC = h_KBTC * mask_BT[None, :, :, None].astype(dtype)
    layer_keys = ([None] * len(self.conv_weights) if dropout_key is None else
                  list(jax.random.split(dropout_key, len(self.conv_weights))))
    for weight, bias, dilation, key in zip(self.conv_weights, self.conv_biases,
                                           lte.router_dilations, layer_keys):
      h_KBTC = router_conv.conv_silu(
          h_KBTC, weight[...], bias[...], None if key is None else counter_hash.seed_words(key),
          mask_BT, rate=lte.router_dropout, dilation=dilation)
    logit_KBT = jnp.einsum("kbtc,kc->kbt", h_KBTC, self.proj_weight[...].astype(dtype),
                           preferred_element_type=jnp.float32) + self.proj_bias[...][:, None, None]
    return jax.nn.sigmoid(jnp.transpose(logit_KBT, (1, 2, 0))) - 0.5
