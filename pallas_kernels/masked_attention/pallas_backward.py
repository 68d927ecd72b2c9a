"""Key-tile-major Pallas kernels of masked attention: dk and dv.

Window kernel: one program per (key tile, batch, KV head); for each of the KV head's G query heads
(a loop) it loops over the query tiles that see the tile through their window (masked edge,
unmasked interior, masked edge), so the G heads' contributions add up in registers.
Kept-list kernel: one program per (list tile, batch, KV head); it loops over every query tile late
enough for the tile's oldest entry to be outside its window, counting a (query, entry) pair only
when the entry is outside that query's window (the complement of the window kernel's pairs): a
mask on the query tiles until the newest entry is outside every window, none after.
The list's dk/dv reach k/v through the gradient of the XLA gather that built the list.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.masked_attention.tiling import (
    BlockSizes, Problem, kept_mask, query_tiles_of_key_tile, window_mask)
from pallas_kernels.pallas_common import (
    LOG2_E, cdiv, dkdv_step, dot_nt, probabilities, triton_compiler_params)


def _accumulate(problem, block_q, k, v, q_ref, do_ref, lse_ref, delta_ref, head, carry, q_tile,
                mask_fn):
  """Adds one query tile's contribution to (dk, dv) of the resident keys."""
  dk, dv = carry
  q_slice = pl.ds(q_tile * block_q, block_q)
  q, do = q_ref[q_slice, head, :], do_ref[q_slice, head, :]
  lse, delta = lse_ref[head, q_slice], delta_ref[head, q_slice]
  mask = None
  if mask_fn is not None:
    query_pos = problem.query_offset + q_tile * block_q + jnp.arange(block_q, dtype=jnp.int32)
    mask = mask_fn(query_pos)
  p = probabilities(dot_nt(q, k), problem.scale * LOG2_E, lse, mask, problem.interpret)
  return dkdv_step(dk, dv, p, q, do, v, delta)


def _over_heads(problem: Problem, one_head, k_shape, v_shape):
  """float32 (dk, dv) summed over the G query heads of the program's KV head by
  one_head(head, (dk, dv)). A loop, not a Python unroll: with G = 16 (NSA's window branch)
  unrolled loops made this kernel's Triton IR ~10x larger than any other and its compile take
  minutes."""
  zeros = (jnp.zeros(k_shape, jnp.float32), jnp.zeros(v_shape, jnp.float32))
  return lax.fori_loop(0, problem.group, one_head, zeros)


def _dkdv_window_kernel(*refs, problem: Problem, block_q: int, block_k: int):
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  key_valid_ref = refs[6] if problem.has_key_valid else None
  dk_ref, dv_ref = refs[-2:]
  k_start = pl.program_id(0) * block_k
  k, v = k_ref[...], v_ref[...]
  key_pos = k_start + jnp.arange(block_k, dtype=jnp.int32)
  key_valid = None if key_valid_ref is None else key_valid_ref[...]
  first, interior_start, interior_end, end = query_tiles_of_key_tile(
      problem, k_start, block_q, block_k)
  mask_fn = lambda query_pos: window_mask(problem, query_pos, key_pos, key_valid)

  def one_head(head, carry):
    step = functools.partial(_accumulate, problem, block_q, k, v, q_ref, do_ref, lse_ref,
                             delta_ref, head)
    carry = lax.fori_loop(first, interior_start, lambda t, c: step(c, t, mask_fn), carry)
    carry = lax.fori_loop(interior_start, interior_end, lambda t, c: step(c, t, None), carry)
    return lax.fori_loop(interior_end, end, lambda t, c: step(c, t, mask_fn), carry)

  dk, dv = _over_heads(problem, one_head, k.shape, v.shape)
  dk_ref[...] = (dk * problem.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _kept_tile_dkdv(problem, block_q, refs, entry_slice, first, end):
  """(dk, dv) of the list entries in entry_slice from query tiles [first, end), all G heads;
  query tiles earlier than the oldest entry's leaving its window are skipped, and those whose
  first row is past every entry's window run without a mask."""
  q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, pos_ref = refs
  k, v, entry_pos = k_ref[entry_slice, :], v_ref[entry_slice, :], pos_ref[entry_slice]
  # Sorted list: the first entry is the oldest, so it is the first to leave the windows. Padding
  # entries have a huge position, which gives an empty loop.
  first_row = jnp.maximum(jnp.min(entry_pos) + problem.window_size - problem.query_offset, 0)
  first = jnp.maximum(first, jnp.minimum(first_row // block_q, end))
  # The row from which every entry of the tile is outside the window: a tile with padding entries
  # (PAD_POSITION + window stays below int32's limit) never gets there and stays masked.
  all_row = jnp.maximum(jnp.max(entry_pos) + problem.window_size - problem.query_offset, 0)
  interior = jnp.clip(cdiv(all_row, block_q), first, end)
  mask_fn = lambda query_pos: kept_mask(problem, query_pos, entry_pos)
  def one_head(head, carry):
    step = functools.partial(_accumulate, problem, block_q, k, v, q_ref, do_ref, lse_ref,
                             delta_ref, head)
    carry = lax.fori_loop(first, interior, lambda t, c: step(c, t, mask_fn), carry)
    return lax.fori_loop(interior, end, lambda t, c: step(c, t, None), carry)

  dk, dv = _over_heads(problem, one_head, k.shape, v.shape)
  return dk * problem.scale, dv


def _dkdv_kept_tile_kernel(*refs, problem: Problem, block_q: int):
  """Grid (list tile, batch, KV head): one list tile (selected by the BlockSpecs) against every
  later query tile."""
  dk_ref, dv_ref = refs[-2:]
  num_q_tiles = problem.padded_query_len // block_q
  dk_ref[...], dv_ref[...] = _kept_tile_dkdv(problem, block_q, refs[:7], slice(None), 0,
                                             num_q_tiles)


def _dkdv_kept_split_kernel(*refs, problem: Problem, block_q: int, block_k: int,
                            query_tiles_per_program: int):
  """Grid (query chunk, batch, KV head): every list tile that the chunk's queries see, against
  the chunk's query tiles, added into zero-initialised outputs with float32 atomics."""
  count_ref = refs[7]  # list entries the chunk's last query tile sees (a prefix of the list)
  dk_ref, dv_ref = refs[-2:]
  num_q_tiles = problem.padded_query_len // block_q
  first = pl.program_id(0) * query_tiles_per_program
  end = jnp.minimum(first + query_tiles_per_program, num_q_tiles)

  def list_tile(j, carry):
    entry_slice = pl.ds(j * block_k, block_k)
    dk, dv = _kept_tile_dkdv(problem, block_q, refs[:7], entry_slice, first, end)
    pltriton.atomic_add(dk_ref, (entry_slice, slice(None)), dk)
    pltriton.atomic_add(dv_ref, (entry_slice, slice(None)), dv)
    return carry

  lax.fori_loop(0, cdiv(count_ref[0], block_k), list_tile, 0)


def _per_kv_head_specs(problem: Problem):
  """Specs of q, do (all G heads of the KV head, all rows) and lse, delta; grid (tile, b, hkv)."""
  group, head_dim = problem.group, problem.head_dim
  rows = pl.BlockSpec((None, problem.padded_query_len, group, head_dim),
                      lambda j, b, h: (b, 0, h, 0))
  stats = pl.BlockSpec((None, group, problem.padded_query_len), lambda j, b, h: (b, h, 0))
  return rows, stats


def _dkdv_call(problem: Problem, blocks: BlockSizes, kernel, *, tiles: int, in_specs, out_spec,
               out_shape, name: str, out_dtype=jnp.float32, **kwargs):
  """The pallas_call of a dk/dv kernel: grid (tiles, batch, KV head), outputs (dk, dv) of
  out_shape and out_dtype, both with out_spec; kwargs go to pl.pallas_call."""
  shape = jax.ShapeDtypeStruct(out_shape, out_dtype)
  return pl.pallas_call(
      kernel,
      grid=(tiles, out_shape[0], problem.num_kv_heads),
      in_specs=in_specs,
      out_specs=[out_spec, out_spec],
      out_shape=[shape, shape],
      compiler_params=triton_compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=problem.interpret,
      name=name,
      **kwargs)


def _key_tile_spec(problem: Problem, block_k: int):
  """[block_k, D] of one (batch, KV head) at key (or list) tile j of the grid (j, b, h)."""
  return pl.BlockSpec((None, block_k, None, problem.head_dim), lambda j, b, h: (b, j, h, 0))


def backward_dkdv_window(problem: Problem, blocks: BlockSizes, q, k, v, do, lse, delta,
                         key_valid, out_dtype=jnp.float32):
  """(dk, dv) [B, Sp, Hkv, D] in out_dtype from the window (and causal) pairs (accumulated in
  float32)."""
  block_q, block_k = blocks.block_q_dkv, blocks.block_k_dkv
  rows, stats = _per_kv_head_specs(problem)
  key_tile = _key_tile_spec(problem, block_k)
  in_specs = [rows, key_tile, key_tile, rows, stats, stats]
  inputs = [q, k, v, do, lse, delta]
  if key_valid is not None:
    in_specs.append(pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)))
    inputs.append(key_valid)
  return _dkdv_call(
      problem, blocks,
      functools.partial(_dkdv_window_kernel, problem=problem, block_q=block_q, block_k=block_k),
      tiles=problem.padded_key_len // block_k, in_specs=in_specs, out_spec=key_tile,
      out_shape=k.shape, out_dtype=out_dtype, name="masked_attention_dkdv_window")(*inputs)


def backward_dkdv_kept(problem: Problem, blocks: BlockSizes, q, do, lse, delta, kept,
                       counts):
  """float32 (dk, dv) [B, C, Hkv, D] of the kept-list entries, from out-of-window pairs only.

  counts: `compaction.entries_per_query_tile` for block_q_dkv query tiles, [B, Hkv, tiles].
  With n = blocks.kept_split(...) == 0, one program per list tile walks every later query tile
  (deterministic; most programs hold padding entries and exit at once). With n > 0, one program
  per chunk of n query tiles loops over the list tiles those queries see (float32 atomics add
  the chunks up): more parallelism for few, long-lived entries, and no programs for the padding.
  """
  block_q, block_k = blocks.block_q_dkv, blocks.block_k_dkv
  capacity = kept.positions_BKC.shape[-1]
  num_q_tiles = problem.padded_query_len // block_q
  per_program = blocks.kept_split(problem.padded_query_len)
  rows, stats = _per_kv_head_specs(problem)
  out_shape = kept.k_BCKD.shape
  inputs = [q, do, lse, delta, kept.k_BCKD, kept.v_BCKD, kept.positions_BKC]
  if not per_program:
    entry_tile = _key_tile_spec(problem, block_k)
    return _dkdv_call(
        problem, blocks,
        functools.partial(_dkdv_kept_tile_kernel, problem=problem, block_q=block_q),
        tiles=capacity // block_k,
        in_specs=[rows, rows, stats, stats, entry_tile, entry_tile,
                  pl.BlockSpec((None, None, block_k), lambda j, b, h: (b, h, j))],
        out_spec=entry_tile, out_shape=out_shape, name="masked_attention_dkdv_kept")(*inputs)
  num_kv_heads = problem.num_kv_heads
  whole = pl.BlockSpec((None, capacity, None, problem.head_dim), lambda c, b, h: (b, 0, h, 0))
  # The chunk's last query tile's count, from the flattened [B, Hkv, tiles] counts.
  count_spec = pl.BlockSpec((1,), lambda c, b, h: (
      (b * num_kv_heads + h) * num_q_tiles
      + jnp.minimum((c + 1) * per_program, num_q_tiles) - 1,))
  zeros = jnp.zeros(out_shape, jnp.float32)
  return _dkdv_call(
      problem, blocks,
      functools.partial(_dkdv_kept_split_kernel, problem=problem, block_q=block_q,
                        block_k=block_k, query_tiles_per_program=per_program),
      tiles=pl.cdiv(num_q_tiles, per_program),
      in_specs=[rows, rows, stats, stats, whole, whole,
                pl.BlockSpec((None, None, capacity), lambda c, b, h: (b, h, 0)),
                count_spec, whole, whole],
      out_spec=whole, out_shape=out_shape, name="masked_attention_dkdv_kept_split",
      input_output_aliases={8: 0, 9: 1})(*inputs, counts.reshape(-1), zeros, zeros)
