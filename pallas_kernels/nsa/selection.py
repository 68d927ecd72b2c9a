"""Block selection from the compressed branch's importance, and its inverse for the selected
branch's key/value gradient (XLA; no gradient flows through either).

`select_top_blocks`: the `block_count` most important valid blocks per (query, KV head), as
`reference.select_blocks` chooses them (its top_k, so equal importances go to the lower block
index), as a list of block indices, valid ones first.

`queries_by_block`: every (block, query) pair of the selection sorted by batch row, KV head, block
and query, and per (batch, KV head) a list of work items (block, first pair, end) of at most
`queries_per_program` pairs each, so that one program of the key/value gradient kernel handles one
item: the first block, which every query selects, spreads over many programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.pallas_common import cdiv

NO_BLOCK = -1  # an unused slot of a selection list


def select_top_blocks(importance_BTKN: jax.Array, block_count: int):
  """(indices int32 [B, T, Hkv, block_count], counts int32 [B, T, Hkv]).

  importance_BTKN: float32 [B, T, Hkv, N], -inf for blocks a query may not select. indices lists
  each (query, KV head)'s selected blocks, most important first, then NO_BLOCK in the
  block_count - counts unused slots (fewer valid blocks than block_count).
  """
  importance_BTKN = jax.lax.stop_gradient(importance_BTKN)
  num_blocks = importance_BTKN.shape[-1]
  top_importance_BTKS, top_block_BTKS = jax.lax.top_k(importance_BTKN,
                                                       min(block_count, num_blocks))
  valid_BTKS = jnp.isfinite(top_importance_BTKS)
  indices_BTKS = jnp.where(valid_BTKS, top_block_BTKS, NO_BLOCK).astype(jnp.int32)
  if block_count > num_blocks:
    unused = ((0, 0),) * 3 + ((0, block_count - num_blocks),)
    indices_BTKS = jnp.pad(indices_BTKS, unused, constant_values=NO_BLOCK)
  return indices_BTKS, jnp.sum(valid_BTKS, axis=-1, dtype=jnp.int32)


def num_work_items(num_queries: int, block_count: int, num_blocks: int,
                   queries_per_program: int) -> int:
  """A bound on the work items of one (batch, KV head): one per block, plus one per
  queries_per_program selected pairs."""
  return num_blocks + cdiv(num_queries * block_count, queries_per_program)


def queries_by_block(indices_BTKS: jax.Array, *, num_blocks: int, queries_per_program: int,
                     pad: int):
  """(queries int32 [B * Hkv * T * S + pad], items int32 [B, Hkv, num_work_items(...), 4]).

  queries: the query rows of the selection's (block, query) pairs, sorted by batch row, KV head,
  block, then query (then `pad` zeros, so that loads of a fixed width past the end stay in
  bounds). items: per (batch, KV head), (block, first pair, end pair, 0) into `queries`; items
  past the last one are (0, 0, 0, 0), no work.
  """
  batch, num_queries, num_kv_heads, count = indices_BTKS.shape
  num_segments = batch * num_kv_heads * num_blocks  # one per (batch row, KV head, block)
  if (num_segments + 1) * num_queries >= 2**31:
    raise NotImplementedError(
        f"nsa_attention[pallas]: {num_segments} (row, KV head, block) lists of {num_queries}"
        " queries overflow the int32 sort keys of the selection's inverse")
  # One key per pair, (row, head, block)-major and query-minor; unused slots sort to the end. A
  # single 1-D sort of all pairs (a radix sort on the GPU).
  segment_BTKS = ((jnp.arange(batch, dtype=jnp.int32)[:, None, None, None] * num_kv_heads
                   + jnp.arange(num_kv_heads, dtype=jnp.int32)[None, None, :, None]) * num_blocks
                  + indices_BTKS)
  query_BTKS = jnp.arange(num_queries, dtype=jnp.int32)[None, :, None, None]
  keys_E = jnp.sort(jnp.where(indices_BTKS >= 0, segment_BTKS * num_queries + query_BTKS,
                              num_segments * num_queries).reshape(-1))
  queries_E = jnp.pad(keys_E % num_queries, (0, pad))
  bounds_G = jnp.arange(num_segments + 1, dtype=jnp.int32) * num_queries
  starts_G = jnp.searchsorted(keys_E, bounds_G, side="left").astype(jnp.int32)
  starts_BKC = starts_G[:-1].reshape(batch, num_kv_heads, num_blocks)
  counts_BKC = (starts_G[1:] - starts_G[:-1]).reshape(batch, num_kv_heads, num_blocks)
  items_BKC = cdiv(counts_BKC, queries_per_program)
  items_end_BKC = jnp.cumsum(items_BKC, axis=-1, dtype=jnp.int32)
  item_N = jnp.arange(num_work_items(num_queries, count, num_blocks, queries_per_program),
                      dtype=jnp.int32)
  block_BKN = jax.vmap(jax.vmap(
      lambda ends_C: jnp.searchsorted(ends_C, item_N, side="right").astype(jnp.int32)))(
          items_end_BKC)
  real_BKN = block_BKN < num_blocks
  block_BKN = jnp.where(real_BKN, block_BKN, 0)
  take = lambda x_BKC: jnp.take_along_axis(x_BKC, block_BKN, axis=-1)
  chunk_BKN = item_N - (take(items_end_BKC) - take(items_BKC))
  start_BKN = take(starts_BKC) + chunk_BKN * queries_per_program
  end_BKN = jnp.minimum(start_BKN + queries_per_program, take(starts_BKC) + take(counts_BKC))
  items_BKN4 = jnp.stack([block_BKN, jnp.where(real_BKN, start_BKN, 0),
                          jnp.where(real_BKN, end_BKN, 0), jnp.zeros_like(block_BKN)], axis=-1)
  return queries_E, items_BKN4
