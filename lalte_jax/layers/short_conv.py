"""GDN's short convolution as a module: the weight, and the op `pallas_kernels.short_conv`.

Weight [C, K] in PyTorch cross-correlation order (tap K-1 multiplies the current token). Training
and whole prompts start from zeros; a decode step or a prompt chunk passes the K-1 inputs before
its first token (GDN keeps them in a ring, `lalte_jax.inference.caches.GDNCache`).
"""

from __future__ import annotations

import jax
from flax import nnx

from lalte_jax.layers import initializers
from lalte_jax.sharding import per_batch_shard
from pallas_kernels.short_conv import short_conv_silu


class ShortConv(nnx.Module):
  """`SiLU(causal depthwise conv(x))`, no bias.

  implementation: the model's choice. "xla" runs XLA; "pallas" the fused kernels where they apply
  (no state) and XLA otherwise; anything else (None, or "cudnn", which names the attention ops'
  versions) the op's default.
  """

  def __init__(self, channels: int, kernel_size: int, *, init_std: float, rngs: nnx.Rngs,
               implementation: str | None = None):
    self.weight = nnx.Param(initializers.normal(init_std)(rngs.params(), (channels, kernel_size)))
    self.implementation = implementation

  def __call__(self, x_BTC: jax.Array, state_BKC: jax.Array | None = None) -> jax.Array:
    implementation = None
    if self.implementation == "xla" or (self.implementation == "pallas" and state_BKC is None):
      implementation = self.implementation

    def conv(x_BTC, *state_and_weight, row_offset):
      del row_offset  # each row's convolution is its own
      *state, weight_CK = state_and_weight
      return short_conv_silu(x_BTC, weight_CK, *state, implementation=implementation)

    # Under a mesh the kernels run per batch shard: XLA cannot split a Pallas call.
    batched = (x_BTC,) if state_BKC is None else (x_BTC, state_BKC)
    return per_batch_shard(conv, batched, (self.weight[...],), batch_axis=0)
