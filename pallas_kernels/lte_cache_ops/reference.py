"""Pure-JAX reference for the LTE cache's data movement (§5.2 step 5, §5.3 step 3).

Cache layout (§5.1): slots [0, W) are the ring, slots [W, W + b) the compacted out-of-window (OOW)
set whose first `past_len[b, h]` entries are valid. Scores are float32, sinks +inf, blanks -inf.
The decode step works on caches stacked over the model's layer groups (`pallas_kernels.stacked`).

- `compact_top_scores` (prefill): per (row, KV head), the top-min(b, n) of the first n tokens by
  score, kept if score > 0, copied to the OOW segment in position order.
- `evict_and_insert` (one decode step): the token in ring slot `ptr` leaves the window; with score
  > 0 it is appended to the OOW set while there is room, else it replaces the set's minimum when
  that is smaller (else it is dropped). Then the new token is written into ring slot `ptr`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compact_top_scores(k_BTKD: jax.Array, v_BTKD: jax.Array, score_BTK: jax.Array,
                       num_candidates: int, cap: int):
  """Top-min(cap, n) of the first n = `num_candidates` tokens by score, kept if score > 0.

  Ties are broken towards the earlier token (`lax.top_k`'s order). Returns the OOW segment
  (k, v [B, cap, K, D], score [B, cap, K] float32, in position order; invalid entries zero /
  -inf), past_len [B, K] int32 and kept_BTK (bool [B, T, K], the kept tokens).
  """
  batch, length, num_kv_heads, _ = k_BTKD.shape
  take = min(cap, num_candidates)
  candidate_score_BKN = jnp.transpose(score_BTK[:, :num_candidates], (0, 2, 1))
  top_score_BKN, top_index_BKN = jax.lax.top_k(candidate_score_BKN, take)
  keep_BKN = top_score_BKN > 0
  past_len_BK = jnp.sum(keep_BKN, axis=-1, dtype=jnp.int32)

  # Position order with the dropped entries sorted to the end (index n is past every token).
  order_BKN = jnp.sort(jnp.where(keep_BKN, top_index_BKN, num_candidates), axis=-1)
  valid_BKN = order_BKN < num_candidates
  gather_BKN = jnp.minimum(order_BKN, num_candidates - 1)

  def gather(x_BTK_):  # [B, T, K, ...] -> [B, take, K, ...] at gather_BKN
    x_BKT_ = jnp.moveaxis(x_BTK_, 1, 2)
    index = gather_BKN.reshape(gather_BKN.shape + (1,) * (x_BKT_.ndim - 3))
    return jnp.moveaxis(jnp.take_along_axis(x_BKT_, index, axis=2), 2, 1)

  valid_BNK = jnp.transpose(valid_BKN, (0, 2, 1))
  pad = ((0, 0), (0, cap - take), (0, 0))
  oow_score = jnp.pad(jnp.where(valid_BNK, gather(score_BTK), -jnp.inf), pad,
                      constant_values=-jnp.inf).astype(jnp.float32)
  oow_k = jnp.pad(jnp.where(valid_BNK[..., None], gather(k_BTKD), 0), pad + ((0, 0),))
  oow_v = jnp.pad(jnp.where(valid_BNK[..., None], gather(v_BTKD), 0), pad + ((0, 0),))

  batch_index = jnp.arange(batch)[:, None, None]
  head_index = jnp.arange(num_kv_heads)[None, :, None]
  kept_BKT = jnp.zeros((batch, num_kv_heads, length), bool).at[
      batch_index, head_index, top_index_BKN].set(keep_BKN)
  return oow_k, oow_v, oow_score, past_len_BK, jnp.transpose(kept_BKT, (0, 2, 1))


def evict_and_insert(k_GBSKD: jax.Array, v_GBSKD: jax.Array, score_GBSK: jax.Array,
                     past_len_GBK: jax.Array, ptr: jax.Array, new_k_BKD: jax.Array,
                     new_v_BKD: jax.Array, new_score_BK: jax.Array, group: jax.Array, *,
                     window_keys: int):
  """One decode step's cache movement (module docstring) on layer group `group` of caches stacked
  over the groups; returns the stacked (k, v, score, past_len).

  k, v [G, B, W + b, K, D]; score [G, B, W + b, K] float32; past_len [G, B, K] int32; ptr [] int32
  the ring slot of the leaving token (and of the new one); new_k, new_v [B, K, D]; new_score
  [B, K]. Only the moved rows are read and written (scatters that XLA performs in place on a
  donated cache).
  """
  batch, slots, num_kv_heads = k_GBSKD.shape[1:4]
  cap = slots - window_keys
  leaving_k_BKD, leaving_v_BKD = k_GBSKD[group, :, ptr], v_GBSKD[group, :, ptr]
  leaving_score_BK = score_GBSK[group, :, ptr]
  past_len_BK = past_len_GBK[group]

  entry_C = jnp.arange(cap, dtype=jnp.int32)
  valid_BCK = entry_C[None, :, None] < past_len_BK[:, None, :]
  # The minimum is looked up only when the set is full, i.e. when every entry is valid.
  masked_BCK = jnp.where(valid_BCK, score_GBSK[group, :, window_keys:], jnp.inf)
  min_index_BK = jnp.argmin(masked_BCK, axis=1).astype(jnp.int32)
  min_score_BK = jnp.min(masked_BCK, axis=1)

  has_room_BK = past_len_BK < cap
  write_BK = (leaving_score_BK > 0) & (has_room_BK | (min_score_BK < leaving_score_BK))
  # past_len is written first and the append slot read back from it, so that the scatters below
  # follow every read of the old scores (XLA fuses the leaving score's read into the past_len
  # update too; a read that the score scatter did not depend on would make it copy the scores).
  past_len_GBK = past_len_GBK.at[group].set(past_len_BK + (write_BK & has_room_BK))
  appended_BK = past_len_GBK[group] - 1
  # Slot `slots` is past the end: the scatters drop the (row, head) pairs that write nothing.
  target_BK = jnp.where(write_BK, window_keys + jnp.where(has_room_BK, appended_BK, min_index_BK),
                        slots)
  row_BK = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, num_kv_heads))
  head_BK = jnp.broadcast_to(jnp.arange(num_kv_heads)[None, :], (batch, num_kv_heads))

  def move(x, leaving, new):  # the leaving row into the OOW set, then the new row into slot ptr
    x = x.at[group, row_BK, target_BK, head_BK].set(leaving, mode="drop")
    return x.at[group, :, ptr].set(new.astype(x.dtype))

  return (move(k_GBSKD, leaving_k_BKD, new_k_BKD), move(v_GBSKD, leaving_v_BKD, new_v_BKD),
          move(score_GBSK, leaving_score_BK, new_score_BK), past_len_GBK)
