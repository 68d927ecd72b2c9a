"""Compressed-attention branch of NSA in Pallas (Triton backend), with the block importance that
the selection reads (§6; `reference.compressed_attention` and `reference.block_importance`).

Query position t attends the complete compressed blocks c < floor((t + 1) / block_size). The
forward program (grid: query tile, batch, KV head) holds `cmp_positions` positions x G heads as
rows, so each tile of compressed keys is loaded once for the group. After its online softmax it
runs a second pass over the blocks up to the current one and writes each position's block
importance: the sum over the G heads of the probabilities exp(s - lse) of the earlier complete
blocks c < floor(t / block_size), G for the forced blocks (first, previous, current: 1 per head as
in the reference) and -inf for later blocks. The top-n of it (XLA, `selection.py`) is the
selection; it carries no gradient.

Backward: dq per query tile (as the forward; it also writes delta = sum(o * do) per row) and
dk/dv of the compressed keys per tile of them and split of the queries, looping over the split's
query tiles that see the tile; the splits' partial sums are added in XLA.
The compressed keys' gradients reach k and v through the mean pooling (XLA autodiff).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.nsa.tiling import NSABlockSizes, Problem
from pallas_kernels.pallas_common import (
    cdiv, dkdv_step, dot_nt, dq_step, probabilities, save_kernel_outputs, softmax_finish,
    softmax_start, softmax_step, triton_compiler_params)


def _row_positions(problem: Problem, first_pos, positions: int):
  """Position of each of the positions x G rows whose first position is first_pos."""
  row_R = lax.div(jnp.arange(positions * problem.group, dtype=jnp.int32),
                  jnp.int32(problem.group))
  return first_pos + row_R


def _complete_blocks(problem: Problem, position):
  """How many compressed blocks position t sees: floor((t + 1) / block_size)."""
  return (position + 1) // problem.block_size


def _load_rows(ref, start, positions: int):
  """[positions * G, D] rows (position-major) from a [T, G, D] ref, positions from start."""
  block = ref[pl.ds(start, positions)]
  return block.reshape(positions * block.shape[1], block.shape[2])


def _forward_kernel(q_ref, kc_ref, vc_ref, o_ref, lse_ref, imp_ref, *, problem: Problem,
                    positions: int, block_c: int):
  first_pos = problem.query_offset + pl.program_id(0) * positions
  group = problem.group
  rows = positions * group
  q = q_ref[...].reshape(rows, problem.head_dim)
  pos_R = _row_positions(problem, first_pos, positions)
  complete_R = _complete_blocks(problem, pos_R)
  last_pos = first_pos + positions - 1
  # Padding rows past the last query may lie past the last compressed block: tiles stop there.
  num_key_tiles = problem.num_blocks_padded // block_c

  def attend(j, carry):
    c_slice = pl.ds(j * block_c, block_c)
    c_C = j * block_c + jnp.arange(block_c, dtype=jnp.int32)
    return softmax_step(carry, dot_nt(q, kc_ref[c_slice, :]), vc_ref[c_slice, :],
                        c_C[None, :] < complete_R[:, None], problem.score_scale,
                        problem.interpret)

  carry = lax.fori_loop(
      0, jnp.minimum(cdiv(_complete_blocks(problem, last_pos), block_c), num_key_tiles), attend,
      softmax_start(rows, vc_ref.shape[-1]))
  o, lse = softmax_finish(carry)
  o_ref[...] = o.reshape(o_ref.shape).astype(o_ref.dtype)
  lse_ref[...] = lse.reshape(lse_ref.shape)

  # Importance of the blocks up to each position's current block IC = floor(t / block_size).
  current_R = pos_R // problem.block_size
  current_P = (first_pos + jnp.arange(positions, dtype=jnp.int32)) // problem.block_size
  num_tiles = jnp.minimum(cdiv(last_pos // problem.block_size + 1, block_c), num_key_tiles)

  def importance(j, carry):
    c_slice = pl.ds(j * block_c, block_c)
    c_C = j * block_c + jnp.arange(block_c, dtype=jnp.int32)
    p = probabilities(dot_nt(q, kc_ref[c_slice, :]), problem.score_scale, lse,
                      c_C[None, :] < current_R[:, None], problem.interpret)
    summed_PC = p.reshape(positions, group, block_c).sum(axis=1)
    c_PC, current_PC = c_C[None, :], current_P[:, None]
    forced = (c_PC == 0) | (c_PC == current_PC - 1) | (c_PC == current_PC)
    summed_PC = jnp.where(forced, float(group), summed_PC)
    imp_ref[:, c_slice] = jnp.where(c_PC > current_PC, -jnp.inf, summed_PC)
    return carry

  def invalid(j, carry):  # blocks after every position's current block
    imp_ref[:, pl.ds(j * block_c, block_c)] = jnp.full((positions, block_c), -jnp.inf,
                                                        jnp.float32)
    return carry

  lax.fori_loop(0, num_tiles, importance, 0)
  lax.fori_loop(num_tiles, num_key_tiles, invalid, 0)


def _dq_kernel(q_ref, kc_ref, vc_ref, do_ref, o_ref, lse_ref, dq_ref, delta_ref, *,
               problem: Problem, positions: int, block_c: int):
  rows = positions * problem.group
  first_row = pl.program_id(0) * positions
  q = q_ref[...].reshape(rows, problem.head_dim)
  do = do_ref[...].reshape(rows, do_ref.shape[-1])
  lse = lse_ref[...].reshape(rows)
  delta = jnp.sum(o_ref[...].reshape(do.shape).astype(jnp.float32) * do.astype(jnp.float32),
                  axis=1)
  delta_ref[...] = delta.reshape(delta_ref.shape)
  first_pos = problem.query_offset + first_row
  complete_R = _complete_blocks(problem, _row_positions(problem, first_pos, positions))
  last_pos = first_pos + positions - 1

  def step(j, dq):
    c_slice = pl.ds(j * block_c, block_c)
    c_C = j * block_c + jnp.arange(block_c, dtype=jnp.int32)
    k, v = kc_ref[c_slice, :], vc_ref[c_slice, :]
    p = probabilities(dot_nt(q, k), problem.score_scale, lse, c_C[None, :] < complete_R[:, None],
                      problem.interpret)
    return dq_step(dq, p, do, k, v, delta)

  num_tiles = jnp.minimum(cdiv(_complete_blocks(problem, last_pos), block_c),
                          problem.num_blocks_padded // block_c)
  dq = lax.fori_loop(0, num_tiles, step, jnp.zeros((rows, problem.head_dim), jnp.float32))
  dq_ref[...] = (dq * problem.scale).reshape(dq_ref.shape).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, do_ref, lse_ref, delta_ref, kc_ref, vc_ref, dk_ref, dv_ref, *,
                 problem: Problem, positions: int, block_c: int, split: int):
  num_splits = cdiv(problem.padded_query_len, split)
  first_block = lax.div(pl.program_id(0), num_splits) * block_c
  split_start = lax.rem(pl.program_id(0), num_splits) * split
  c_C = first_block + jnp.arange(block_c, dtype=jnp.int32)
  k, v = kc_ref[...], vc_ref[...]
  # The first query that sees the tile's first block is the last token of that block.
  first_row = jnp.maximum((first_block + 1) * problem.block_size - 1 - problem.query_offset, 0)

  def step(s, carry):
    start = s * positions
    q, do = _load_rows(q_ref, start, positions), _load_rows(do_ref, start, positions)
    lse = lse_ref[pl.ds(start, positions), :].reshape(-1)
    delta = delta_ref[pl.ds(start, positions), :].reshape(-1)
    complete_R = _complete_blocks(
        problem, _row_positions(problem, problem.query_offset + start, positions))
    p = probabilities(dot_nt(q, k), problem.score_scale, lse, c_C[None, :] < complete_R[:, None],
                      problem.interpret)
    return dkdv_step(*carry, p, q, do, v, delta)

  split_end = jnp.minimum(split_start + split, problem.padded_query_len)
  dk, dv = lax.fori_loop(
      jnp.clip(first_row, split_start, split_end) // positions, split_end // positions, step,
      (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
  dk_ref[...] = dk * problem.scale
  dv_ref[...] = dv


def _call(problem: Problem, kernel, *, grid, in_specs, out_specs, out_shape, num_warps,
          num_stages, name):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(num_warps, num_stages),
      interpret=problem.interpret, name=name)


def _query_tile_specs(problem: Problem, positions: int):
  """Grid (query tile, batch, KV head): [positions, G, D] rows, [positions, G] statistics and the
  KV head's whole compressed keys."""
  group = problem.group
  rows = pl.BlockSpec((None, positions, group, problem.head_dim), lambda i, b, h: (b, i, h, 0))
  stats = pl.BlockSpec((None, positions, group), lambda i, b, h: (b, i, h))
  keys = pl.BlockSpec((None, problem.num_blocks_padded, None, problem.head_dim),
                      lambda i, b, h: (b, 0, h, 0))
  return rows, stats, keys


def forward(problem: Problem, blocks: NSABlockSizes, q, k_cmp, v_cmp):
  """(o [B, Tqp, Hq, Dv] in q's dtype, lse2 [B, Tqp, Hq] float32, importance [B, Tqp, Hkv, NBp]
  float32) from padded q and compressed keys/values [B, NBp, Hkv, D]."""
  batch, padded_len = q.shape[:2]
  positions = blocks.cmp_positions
  rows, stats, keys = _query_tile_specs(problem, positions)
  return _call(
      problem,
      functools.partial(_forward_kernel, problem=problem, positions=positions,
                        block_c=blocks.cmp_keys),
      grid=(padded_len // positions, batch, problem.num_kv_heads),
      in_specs=[rows, keys, keys],
      out_specs=[rows, stats, pl.BlockSpec((None, positions, None, problem.num_blocks_padded),
                                           lambda i, b, h: (b, i, h, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32),
                 jax.ShapeDtypeStruct((batch, padded_len, problem.num_kv_heads,
                                       problem.num_blocks_padded), jnp.float32)],
      num_warps=blocks.num_warps, num_stages=blocks.num_stages,
      name="nsa_compressed_fwd")(q, k_cmp, v_cmp)


def backward(problem: Problem, blocks: NSABlockSizes, q, k_cmp, v_cmp, o, lse, do):
  """(dq in q's dtype, dk_cmp, dv_cmp float32) of the compressed branch."""
  batch, padded_len = q.shape[:2]
  positions = blocks.cmp_positions
  rows, stats, keys = _query_tile_specs(problem, positions)
  dq, delta = _call(
      problem,
      functools.partial(_dq_kernel, problem=problem, positions=positions,
                        block_c=blocks.cmp_keys),
      grid=(padded_len // positions, batch, problem.num_kv_heads),
      in_specs=[rows, keys, keys, rows, rows, stats], out_specs=[rows, stats],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)],
      num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd,
      name="nsa_compressed_dq")(q, k_cmp, v_cmp, do, o, lse)
  # dk/dv: grid (key tile x query split, batch, KV head); each program writes its split's partial
  # sums, added up here (deterministic). Without splits the first key tiles' programs, which every
  # later query sees, would each walk the whole sequence on a few of the GPU's cores.
  block_c, split = blocks.cmp_bwd_keys, blocks.cmp_bwd_queries_per_program
  num_splits = -(-padded_len // split)
  group, head_dim = problem.group, problem.head_dim
  all_rows = pl.BlockSpec((None, padded_len, group, head_dim), lambda j, b, h: (b, 0, h, 0))
  all_stats = pl.BlockSpec((None, padded_len, group), lambda j, b, h: (b, 0, h))
  key_tile = pl.BlockSpec((None, block_c, None, head_dim),
                          lambda j, b, h: (b, j // num_splits, h, 0))
  partial_tile = pl.BlockSpec((None, None, block_c, None, head_dim),
                              lambda j, b, h: (j % num_splits, b, j // num_splits, h, 0))
  partial = jax.ShapeDtypeStruct((num_splits,) + k_cmp.shape, jnp.float32)
  dk_cmp, dv_cmp = _call(
      problem,
      functools.partial(_dkdv_kernel, problem=problem, positions=blocks.cmp_bwd_positions,
                        block_c=block_c, split=split),
      grid=(problem.num_blocks_padded // block_c * num_splits, batch, problem.num_kv_heads),
      in_specs=[all_rows, all_rows, all_stats, all_stats, key_tile, key_tile],
      out_specs=[partial_tile, partial_tile], out_shape=[partial, partial],
      num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd,
      name="nsa_compressed_dkdv")(q, do, lse, delta, k_cmp, v_cmp)
  return dq, jnp.sum(dk_cmp, axis=0), jnp.sum(dv_cmp, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def compressed_attention(problem: Problem, blocks: NSABlockSizes, q, k_cmp, v_cmp):
  """(o_cmp [B, Tqp, Hq, Dv] in q's dtype, importance [B, Tqp, Hkv, NBp] float32); gradients
  flow to q, k_cmp and v_cmp through o_cmp only (the importance only feeds the selection)."""
  o, _, importance = forward(problem, blocks, q, k_cmp, v_cmp)
  return o, importance


def _compressed_fwd(problem, blocks, q, k_cmp, v_cmp):
  o, lse, importance = save_kernel_outputs(*forward(problem, blocks, q, k_cmp, v_cmp))
  return (o, importance), (q, k_cmp, v_cmp, o, lse)


def _compressed_bwd(problem, blocks, residuals, cotangents):
  q, k_cmp, v_cmp, o, lse = residuals
  do, _ = cotangents  # the importance's cotangent: the selection has no gradient
  dq, dk_cmp, dv_cmp = backward(problem, blocks, q, k_cmp, v_cmp, o, lse, do.astype(q.dtype))
  return dq, dk_cmp.astype(k_cmp.dtype), dv_cmp.astype(v_cmp.dtype)


compressed_attention.defvjp(_compressed_fwd, _compressed_bwd)
