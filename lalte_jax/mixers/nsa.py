"""Native sparse attention as the authors used it (§6, G22).

Projections as attention plus g_proj: hidden -> Hq*3 sigmoid gates in the order [cmp, slc, swa];
RoPE on q and k; the three branches (mean-pooled compressed blocks, top-n selected blocks with the
first, previous and current blocks forced, a sliding window) live in `pallas_kernels.nsa`.
"""

from __future__ import annotations

import jax
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.attention import AttentionProjections
from lalte_jax.mixers.projections import input_projection
from lalte_jax.sharding import per_shard
from pallas_kernels.nsa import nsa_attention


class NativeSparseAttention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    nsa = config.nsa
    self.config = nsa
    self.proj = AttentionProjections(config, nsa.num_heads, nsa.num_kv_heads, nsa.head_dim,
                                     rngs=rngs)
    self.g_proj = input_projection(config, config.hidden_size, nsa.num_heads * 3, rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    nsa = self.config
    batch, length = x_BTD.shape[:2]
    q_BTHD, k_BTKD, v_BTKD = self.proj.qkv(x_BTD)
    positions_BT = default_positions(batch, length)
    q_BTHD = apply_rope(q_BTHD, positions_BT, nsa.rope_theta)
    k_BTKD = apply_rope(k_BTKD, positions_BT, nsa.rope_theta)
    gates_BTH3 = jax.nn.sigmoid(self.g_proj(x_BTD)).reshape(batch, length, nsa.num_heads, 3)
    o_BTHD = per_shard(
        lambda q, k, v, gates: nsa_attention(q, k, v, gates, block_size=nsa.block_size,
                                             block_count=nsa.block_count,
                                             window_size=nsa.window_size,
                                             implementation=nsa.implementation),
        q_BTHD, k_BTKD, v_BTKD, gates_BTH3)
    return self.proj.output(o_BTHD)
