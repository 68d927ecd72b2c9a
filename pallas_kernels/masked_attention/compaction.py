"""Compacted lists of the out-of-window keys that stay visible (LTE's kept keys and the sinks).

The Pallas kernels visit, for each query tile, only the key tiles that intersect its window; the
keys that stay visible outside the window are gathered here (in XLA) into a per-(batch, KV head)
list sorted by position, so that a query tile reads only the entries old enough to be outside its
window. Capacity is the padded key length: exact for any mask, while the kernels' dynamic trip
counts make the cost follow the real number of kept keys.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Position given to padding entries: far in the future of every query, so "query - key >= window"
# is never true for them, and small enough that adding a window cannot overflow int32.
PAD_POSITION = 1 << 30


class KeptList(NamedTuple):
  """Out-of-window visible keys of each (batch, KV head), ascending by position.

  positions_BKC: int32 [B, Hkv, C]; real entries first, then PAD_POSITION.
  k_BCKD, v_BCKD: [B, C, Hkv, D] the keys/values at those positions (padding entries hold zeros;
    the kernels mask them by position), or None where the kernels read k/v by position.
  slots_BSK: int32 [B, S, Hkv], the inverse map: each key's entry in the list, or C (past the
    end) for keys not on it (`list_slots`); the entries' gradients reach the keys by gathering
    with it (`entries_to_keys`). None where nothing is differentiated.
  """
  positions_BKC: jax.Array
  k_BCKD: jax.Array | None = None
  v_BCKD: jax.Array | None = None
  slots_BSK: jax.Array | None = None


def listed_keys(*, batch, key_len, num_kv_heads, num_sinks, kept_BSK, key_valid_BS) -> jax.Array:
  """bool [B, Hkv, S]: the keys that go on the list (sinks and kept keys, valid ones only)."""
  key_pos_S = jnp.arange(key_len, dtype=jnp.int32)
  listed_BKS = jnp.broadcast_to((key_pos_S < num_sinks)[None, None], (batch, num_kv_heads, key_len))
  if kept_BSK is not None:
    listed_BKS = listed_BKS | jnp.transpose(kept_BSK, (0, 2, 1))
  if key_valid_BS is not None:
    listed_BKS = listed_BKS & key_valid_BS[:, None, :key_len]
  return listed_BKS


def kept_list_and_counts(listed_BKS, *, capacity, block_qs, padded_query_len, query_offset,
                         window_size, with_slots=False):
  """(KeptList with the positions `[B, Hkv, capacity]` and, with_slots, `list_slots` over
  `capacity` keys; one `entries_per_query_tile` count array per query tile size in block_qs):
  what the kernels need besides q, k, v, from one prefix count."""
  listed_before_BKS = listed_before(listed_BKS)
  positions_BKC = kept_positions(listed_BKS, listed_before_BKS, capacity=capacity)
  slots_BSK = (list_slots(listed_BKS, listed_before_BKS, capacity=capacity) if with_slots
               else None)
  counts = tuple(
      entries_per_query_tile(listed_before_BKS, block_q=block_q,
                             num_q_tiles=padded_query_len // block_q, query_offset=query_offset,
                             window_size=window_size)
      for block_q in block_qs)
  return KeptList(positions_BKC, slots_BSK=slots_BSK), counts


def list_slots(listed_BKS, listed_before_BKS, *, capacity):
  """int32 [B, capacity, Hkv]: each key's entry in the list, `capacity` for keys not on it and
  for the positions past the keys (up to capacity)."""
  slots_BKS = jnp.where(listed_BKS, listed_before_BKS - 1, capacity)
  slots_BKS = jnp.pad(slots_BKS, ((0, 0), (0, 0), (0, capacity - slots_BKS.shape[-1])),
                      constant_values=capacity)
  return jnp.transpose(slots_BKS, (0, 2, 1))


def entries_to_keys(d_BCKD, slots_BSK):
  """[B, S, Hkv, D]: each key's row of the list entries' d (zeros for keys not on the list), the
  transpose of `gather_kept`. A gather by the inverse map: the entries are distinct keys, so no
  two land on one key, and XLA fuses it with the add into the keys' gradient (the scatter-add
  of the gather's automatic transpose took 0.73 ms of a lalte-0.4b B4 T4096 training step on an
  H200)."""
  return jnp.take_along_axis(d_BCKD, slots_BSK[..., None], axis=1, mode="fill", fill_value=0)


def kept_positions(listed_BKS, listed_before_BKS, *, capacity):
  """int32 [B, Hkv, capacity]: listed positions ascending, then PAD_POSITION (see KeptList).

  listed_before_BKS: `listed_before(listed_BKS)`.
  """
  batch, num_kv_heads, key_len = listed_BKS.shape
  if capacity < key_len:
    raise ValueError(f"kept_positions: capacity {capacity} < key length {key_len}")
  key_pos_S = jnp.arange(key_len, dtype=jnp.int32)
  # Stream compaction: a listed key's slot is the number of listed keys before it, so the list comes
  # out ascending; unlisted keys scatter out of bounds and are dropped. O(S) per row, where a sort
  # of the rows (the first version) is O(S log^2 S) on the GPU in ~100 launches at S = 16384 and
  # was the part of the LTE prefill that grew with S (H100, 2026-11-22). Unlisted keys
  # get distinct out-of-bounds slots, so the indices really are unique.
  slot_BKS = jnp.where(listed_BKS, listed_before_BKS - 1, capacity + key_pos_S)
  batch_B11 = jnp.arange(batch, dtype=jnp.int32)[:, None, None]
  head_1K1 = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
  positions_BKC = jnp.full((batch, num_kv_heads, capacity), PAD_POSITION, jnp.int32)
  return positions_BKC.at[batch_B11, head_1K1, slot_BKS].set(
      jnp.broadcast_to(key_pos_S, slot_BKS.shape), mode="drop", unique_indices=True)


def listed_before(listed_BKS):
  """int32 [B, Hkv, S]: how many keys at positions <= s are listed (inclusive prefix count)."""
  return jnp.cumsum(listed_BKS, axis=-1, dtype=jnp.int32)


def gather_kept(k_BSKD, v_BSKD, positions_BKC):
  """(k_BCKD, v_BCKD): the listed keys/values; padding entries get zeros."""
  # Padding entries gather out of bounds ("fill"), so the gradient's scatter-add drops them.
  # Clipping them to the last key instead would make thousands of padding rows collide on one row
  # in the backward scatter-add (atomic contention).
  gather_BCK = jnp.transpose(positions_BKC, (0, 2, 1))[..., None]
  k_BCKD = jnp.take_along_axis(k_BSKD, gather_BCK, axis=1, mode="fill", fill_value=0)
  v_BCKD = jnp.take_along_axis(v_BSKD, gather_BCK, axis=1, mode="fill", fill_value=0)
  return k_BCKD, v_BCKD


def entries_per_query_tile(listed_before_BKS, *, block_q, num_q_tiles, query_offset,
                           window_size):
  """int32 [B, Hkv, num_q_tiles]: how many list entries any query of each tile can see.

  Query tile t holds positions up to query_offset + (t + 1) * block_q - 1; an entry is outside that
  query's window iff its position is <= that - window_size. The list holds the listed keys in
  position order, so these entries are a prefix whose length is the prefix count of listed keys
  at that position (one lookup per tile; a binary search of the list per tile, the first
  version, took ~0.2 ms of a B8 T4096 prefill as a loop of small XLA ops).
  listed_before_BKS: `listed_before` of the listed keys.
  """
  key_len = listed_before_BKS.shape[-1]
  last_pos_T = query_offset + (jnp.arange(num_q_tiles, dtype=jnp.int32) + 1) * block_q - 1
  threshold_T = last_pos_T - window_size
  counts_BKT = jnp.take(listed_before_BKS, jnp.clip(threshold_T, 0, key_len - 1), axis=-1)
  return jnp.where(threshold_T >= 0, counts_BKT, 0)
