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
    the kernels mask them by position). Gathered from k/v, so their gradients flow back to k/v by
    the gather's transpose, a scatter-add that drops the padding entries.
  """
  positions_BKC: jax.Array
  k_BCKD: jax.Array
  v_BCKD: jax.Array


def build_kept_list(k_BSKD, v_BSKD, *, num_sinks, kept_BSK, key_valid_BS, capacity) -> KeptList:
  """Gathers the sinks and kept keys (valid ones only) into sorted lists of `capacity` entries.

  k_BSKD/v_BSKD may be padded past the real key length S = kept_BSK.shape[1] (when given); keys at
  or beyond S are never listed. capacity must be >= the number of real keys.
  """
  key_len = k_BSKD.shape[1] if kept_BSK is None else kept_BSK.shape[1]
  positions_BKC = kept_positions(
      batch=k_BSKD.shape[0], key_len=key_len, num_kv_heads=k_BSKD.shape[2], num_sinks=num_sinks,
      kept_BSK=kept_BSK, key_valid_BS=key_valid_BS, capacity=capacity)
  return KeptList(positions_BKC, *gather_kept(k_BSKD, v_BSKD, positions_BKC))


def kept_positions(*, batch, key_len, num_kv_heads, num_sinks, kept_BSK, key_valid_BS, capacity):
  """int32 [B, Hkv, capacity]: listed positions ascending, then PAD_POSITION (see KeptList)."""
  if capacity < key_len:
    raise ValueError(f"build_kept_list: capacity {capacity} < key length {key_len}")
  key_pos_S = jnp.arange(key_len, dtype=jnp.int32)
  listed_BKS = jnp.broadcast_to((key_pos_S < num_sinks)[None, None], (batch, num_kv_heads, key_len))
  if kept_BSK is not None:
    listed_BKS = listed_BKS | jnp.transpose(kept_BSK, (0, 2, 1))
  if key_valid_BS is not None:
    listed_BKS = listed_BKS & key_valid_BS[:, None, :key_len]
  # Sorting the positions (unlisted ones pushed to the end as PAD_POSITION) compacts and orders them
  # in one step.
  positions_BKS = jnp.sort(jnp.where(listed_BKS, key_pos_S, PAD_POSITION), axis=-1)
  return jnp.pad(positions_BKS, ((0, 0), (0, 0), (0, capacity - key_len)),
                 constant_values=PAD_POSITION)


def gather_kept(k_BSKD, v_BSKD, positions_BKC):
  """(k_BCKD, v_BCKD): the listed keys/values; padding entries get zeros."""
  # Padding entries gather out of bounds ("fill"), so the gradient's scatter-add drops them.
  # Clipping them to the last key instead would make thousands of padding rows collide on one row
  # in the backward scatter-add (atomic contention).
  gather_BCK = jnp.transpose(positions_BKC, (0, 2, 1))[..., None]
  k_BCKD = jnp.take_along_axis(k_BSKD, gather_BCK, axis=1, mode="fill", fill_value=0)
  v_BCKD = jnp.take_along_axis(v_BSKD, gather_BCK, axis=1, mode="fill", fill_value=0)
  return k_BCKD, v_BCKD


def entries_per_query_tile(positions_BKC, *, block_q, num_q_tiles, query_offset, window_size):
  """int32 [B, Hkv, num_q_tiles]: how many list entries any query of each tile can see.

  Query tile t holds positions up to query_offset + (t + 1) * block_q - 1; an entry is outside that
  query's window iff its position is <= that - window_size. The list is sorted, so these entries
  are a prefix whose length searchsorted gives.
  """
  last_pos_T = query_offset + (jnp.arange(num_q_tiles, dtype=jnp.int32) + 1) * block_q - 1
  threshold_T = last_pos_T - window_size

  def count_row(positions_C):
    return jnp.searchsorted(positions_C, threshold_T, side="right").astype(jnp.int32)

  return jax.vmap(jax.vmap(count_row))(positions_BKC)
