"""The LTE router (§4.1): a small per-KV-head CNN over concat(k_pre_rope, v).

Per KV head the channel widths halve at each conv layer, 2D -> D -> D/2 -> D/4 for the paper's
three layers (kernel 3, dilation 2, 'same' zero padding at every layer, with bias), then a 1x1
projection to one logit (bias initialised to +0.5). Each layer is `Dropout -> Conv -> [padding
mask] -> SiLU`; dropout hits the raw KV input of the first layer and the activations feeding the
later ones, never the projection (G8). Heads have independent weights (the reference's grouped
convolution, groups = Hkv).

With kernel size 1 everywhere the router sees no context: the LTE-MLP ablation (§7.3).

score = sigmoid(logit) - 0.5, so a token is kept iff score > 0 (G2). The module owns the
parameters; the computation is the op `pallas_kernels.lte_router.router_logits` (its default
version: fused Pallas kernels on a GPU in training, XLA for a prompt's padding mask and on other
platforms), run per batch shard under a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import LTEConfig
from lalte_jax.layers import initializers
from lalte_jax.sharding import per_batch_shard
from pallas_kernels.dispatch import Implementation
from pallas_kernels.lte_router import counter_hash, router_logits, settled_logit


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
               dropout_key: jax.Array | None = None,
               implementation: Implementation = None) -> jax.Array:
    """Scores [B, T, Hkv] float32 in (-0.5, 0.5) from pre-RoPE keys and values.

    mask_BT (bool, True = real token) zeroes padded tokens' features and every conv output at
    padded positions, the same as zero padding there. `dropout_key` turns dropout on (training).
    `implementation` picks the router op's version (None: its default; tools/bench_router.py
    times them), apart from the model-wide `implementation` of the attention ops.
    """
    with jax.named_scope("lte_router"):  # names the router's kernels in profiles
      return self._scores(k_BTKD, v_BTKD, mask_BT, dropout_key, implementation)

  def settled_scores(self, k_BSKD: jax.Array, v_BSKD: jax.Array, real_BS: jax.Array, *,
                     implementation: Implementation = None) -> jax.Array:
    """Scores [B, Hkv] float32 of the centre of a span of 2 margin + 1 pre-RoPE keys and values
    (real_BS: True at real tokens): what `__call__` gives that token, computed from the positions
    that reach it only (a decoding step's settled token, §5.4)."""
    with jax.named_scope("lte_router"):
      logit_BK = settled_logit(
          k_BSKD, v_BSKD, real_BS, tuple(w[...].astype(k_BSKD.dtype) for w in self.conv_weights),
          tuple(b[...] for b in self.conv_biases), self.proj_weight[...], self.proj_bias[...],
          dilations=self.config.router_dilations, implementation=implementation)
      return jax.nn.sigmoid(logit_BK) - 0.5

  def _scores(self, k_BTKD, v_BTKD, mask_BT, dropout_key, implementation):
    lte = self.config
    dtype = k_BTKD.dtype
    if mask_BT is not None:
      mask_BT1 = mask_BT[:, :, None, None].astype(dtype)
      k_BTKD, v_BTKD = k_BTKD * mask_BT1, v_BTKD * mask_BT1
    seeds = None
    if dropout_key is not None and lte.router_dropout > 0:
      seeds = jnp.stack([counter_hash.seed_words(key) for key in
                         jax.random.split(dropout_key, len(self.conv_weights))])
    params = (tuple(w[...].astype(dtype) for w in self.conv_weights),
              tuple(b[...] for b in self.conv_biases), self.proj_weight[...], self.proj_bias[...],
              seeds)

    def logits(k_BTKD, v_BTKD, weights, biases, proj_weight, proj_bias, seeds, *, row_offset):
      return router_logits(
          k_BTKD, v_BTKD, weights, biases, proj_weight, proj_bias, seeds,
          dilations=lte.router_dilations, rate=lte.router_dropout, mask_BT=mask_BT,
          row_offset=row_offset, implementation=implementation)

    if mask_BT is None:  # training: the router runs per batch shard under a mesh
      logit_BTK = per_batch_shard(logits, (k_BTKD, v_BTKD), params, batch_axis=0)
    else:  # a prompt's padding mask (prefill, one device)
      logit_BTK = logits(k_BTKD, v_BTKD, *params, row_offset=0)
    return jax.nn.sigmoid(logit_BTK) - 0.5
