"""Native sparse attention as the authors used it (§6, G22).

Projections as attention plus g_proj: hidden -> Hq*3 sigmoid gates in the order [cmp, slc, swa];
RoPE on q and k; the three branches (mean-pooled compressed blocks, top-n selected blocks with the
first, previous and current blocks forced, a sliding window) live in `pallas_kernels.nsa`.

Decoding keeps every key and value at slot = the row's real position (pads removed, so blocks
start at the row's first real token as in the reference's unpadding to varlen, §6) and the mean of
every complete block (`lalte_jax.inference.caches.NSACache`); a decode step writes the new key,
value and completed block mean into the layer group's part of the stacked cache in place and reads
the block means, the selected blocks and the window, never the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.inference.caches import NSACache, StepContext, write_prompt
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.attention import AttentionProjections
from lalte_jax.mixers.projections import input_projection
from lalte_jax.sharding import per_shard
from pallas_kernels import nsa as nsa_ops


def _shift_rows(x_BT_: jax.Array, shift_B: jax.Array) -> jax.Array:
  """out[b, i] = x[b, (i + shift[b]) mod T]: moves each row left by its shift, cyclically."""
  length = x_BT_.shape[1]
  index_BT = (jnp.arange(length)[None] + shift_B[:, None]) % length
  index = index_BT.reshape(*index_BT.shape, *([1] * (x_BT_.ndim - 2)))
  return jnp.take_along_axis(x_BT_, index, axis=1)


class NativeSparseAttention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    nsa = config.nsa
    self.config = nsa
    self.proj = AttentionProjections(config, nsa.num_heads, nsa.num_kv_heads, nsa.head_dim,
                                     rngs=rngs)
    self.g_proj = input_projection(config, config.hidden_size, nsa.num_heads * 3, rngs)

  def _qkv_gates(self, x_BTD: jax.Array, positions_BT: jax.Array):
    """q, k after RoPE, v and the gates [B, T, Hq, 3]."""
    q_BTHD, k_BTKD, v_BTKD = self.proj.roped_qkv(x_BTD, positions_BT, self.config.rope_theta)
    return q_BTHD, k_BTKD, v_BTKD, self._gates(x_BTD)

  def _queries_gates(self, x_BCD: jax.Array, positions_BC: jax.Array, k_BSKD: jax.Array,
                     v_BSKD: jax.Array):
    """`_qkv_gates` of C queries with the given keys (after RoPE) and values."""
    q_BCHD = apply_rope(self.proj.queries(x_BCD), positions_BC, self.config.rope_theta)
    return q_BCHD, k_BSKD, v_BSKD, self._gates(x_BCD)

  def _gates(self, x_BTD: jax.Array) -> jax.Array:
    """The branch gates [B, T, Hq, 3], sigmoided."""
    batch, length = x_BTD.shape[:2]
    return jax.nn.sigmoid(self.g_proj(x_BTD)).reshape(batch, length, self.config.num_heads, 3)

  def _attention(self, q_BTHD, k_BTKD, v_BTKD, gates_BTH3) -> jax.Array:
    nsa = self.config
    return per_shard(
        lambda q, k, v, gates: nsa_ops.nsa_attention(q, k, v, gates, block_size=nsa.block_size,
                                                     block_count=nsa.block_count,
                                                     window_size=nsa.window_size,
                                                     implementation=nsa.implementation),
        q_BTHD, k_BTKD, v_BTKD, gates_BTH3)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    o_BTHD = self._attention(*self._qkv_gates(x_BTD, default_positions(*x_BTD.shape[:2])))
    return self.proj.output(o_BTHD)

  def prefill(self, h_BTD: jax.Array, norm, cache: NSACache, ctx: StepContext
              ) -> tuple[jax.Array, NSACache]:
    """h + NSA(norm(h)) over the prompt (h the block's residual stream, `norm` its pre-mixer
    RMSNorm) with each row's real tokens moved to the front: block boundaries then count from
    the first real token, and the pads, now at the end, are invisible to the real tokens by
    causality. With `ctx.chunk_tokens` the queries go a chunk at a time (the same outputs)."""
    nsa = self.config
    h_front_BTD = _shift_rows(h_BTD, ctx.pad_count_B)
    positions_BT = default_positions(*h_BTD.shape[:2])
    x_front_BTD = norm(h_front_BTD)
    k_BTKD, v_BTKD = self.proj.keys_values(x_front_BTD)
    k_BTKD = apply_rope(k_BTKD, positions_BT, nsa.rope_theta)

    def attend(x_BCD, positions_BC, k_BSKD, v_BSKD):
      return self._attention(*self._queries_gates(x_BCD, positions_BC, k_BSKD, v_BSKD))

    # In chunks, blocks are pooled from position 0, so each chunk takes the keys up to its end as
    # they are: the compressed branch's block importance [T, blocks] grows with the chunk.
    h_front_BTD = self.proj.prompt_output(h_front_BTD, x_front_BTD, norm, positions_BT,
                                          (k_BTKD, v_BTKD), ctx.chunk_tokens, attend,
                                          unrolled=True)
    h_BTD = _shift_rows(h_front_BTD, -ctx.pad_count_B)  # back to the left-padded layout
    # Slots past a row's length hold pad keys; each is overwritten before any query can see it.
    k_BSKD, v_BSKD = write_prompt(cache.k_BSKD, k_BTKD), write_prompt(cache.v_BSKD, v_BTKD)
    real_length_B = h_BTD.shape[1] - ctx.pad_count_B
    k_cmp_BNKD, v_cmp_BNKD = nsa_ops.compress_prompt(
        k_BSKD, v_BSKD, real_length_B, block_size=nsa.block_size,
        num_blocks=cache.k_cmp_BNKD.shape[1])
    return h_BTD, NSACache(k_BSKD=k_BSKD, v_BSKD=v_BSKD, k_cmp_BNKD=k_cmp_BNKD,
                             v_cmp_BNKD=v_cmp_BNKD)

  def decode(self, x_B1D: jax.Array, cache: NSACache, ctx: StepContext
             ) -> tuple[jax.Array, NSACache]:
    """One new token per row, at its real position; `cache` holds `GroupSlot` leaves."""
    nsa = self.config
    real_pos_B = ctx.real_positions_BT[:, 0]
    q_B1HD, k_B1KD, v_B1KD, gates_B1H3 = self._qkv_gates(x_B1D, real_pos_B[:, None])
    slots = (cache.k_BSKD, cache.v_BSKD, cache.k_cmp_BNKD, cache.v_cmp_BNKD)
    group = cache.k_BSKD.group
    stacked = nsa_ops.append_token(*(slot.stacked for slot in slots), k_B1KD[:, 0], v_B1KD[:, 0],
                                   real_pos_B, block_size=nsa.block_size, group=group)
    o_BHD = nsa_ops.nsa_decode_attention(
        q_B1HD[:, 0], gates_B1H3[:, 0], *stacked, real_pos_B, block_size=nsa.block_size,
        block_count=nsa.block_count, window_size=nsa.window_size, group=group,
        implementation=nsa.implementation)
    return self.proj.output(o_BHD[:, None]), NSACache(
        *(slot.replace(stacked=x) for slot, x in zip(slots, stacked)))
