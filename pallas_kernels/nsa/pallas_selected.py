"""Selected-block branch of NSA in Pallas (Triton backend): attention of each query over every
token of its KV head's selected blocks, causally (§6; `reference.selected_attention`).

Forward and dq: one program per (query, batch, KV head) whose rows are the G query heads of the
KV head; it reads the position's block list (scalar loads) and loads each selected block's keys
and values once for all G heads (FLA's `parallel_nsa` layout). Only the current block needs the
causal mask; it is applied to every block (one compare per score).

dk/dv: one program per work item of `selection.queries_by_block`: a key block and up to
`slc_queries_per_program` of the queries that selected it, gathered `slc_queries_per_step` at a
time with their G heads as rows (row = query x head); programs that share a block add their
float32 results with atomics, so the sums' order varies between runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nsa import selection
from pallas_kernels.nsa.tiling import NSABlockSizes, Problem
from pallas_kernels.pallas_common import (
    cdiv, dkdv_step, dot_nt, dq_step, probabilities, save_kernel_outputs, softmax_finish,
    softmax_start, softmax_step, triton_compiler_params)


def _selected_blocks(problem: Problem, idx_ref, count_ref, k_ref, v_ref, visit, carry):
  """Runs visit(carry, k, v, causal_mask) over the program's selected blocks."""
  position = problem.query_offset + pl.program_id(0)
  size = problem.block_size

  def step(j, carry):
    start = idx_ref[j] * size
    key_pos = start + jnp.arange(size, dtype=jnp.int32)
    block = pl.ds(start, size)
    return visit(carry, k_ref[block, :], v_ref[block, :], (key_pos <= position)[None, :])

  return lax.fori_loop(0, count_ref[0], step, carry)


def _forward_kernel(idx_ref, count_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    problem: Problem):
  q = q_ref[...]
  visit = lambda carry, k, v, mask: softmax_step(carry, dot_nt(q, k), v, mask,
                                                 problem.score_scale, problem.interpret)
  carry = _selected_blocks(problem, idx_ref, count_ref, k_ref, v_ref, visit,
                           softmax_start(problem.group, v_ref.shape[-1]))
  o, lse = softmax_finish(carry)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(idx_ref, count_ref, q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref, dq_ref,
               delta_ref, *, problem: Problem):
  q, do, lse = q_ref[...], do_ref[...], lse_ref[...]
  delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  delta_ref[...] = delta

  def visit(dq, k, v, mask):
    p = probabilities(dot_nt(q, k), problem.score_scale, lse, mask, problem.interpret)
    return dq_step(dq, p, do, k, v, delta)

  dq = _selected_blocks(problem, idx_ref, count_ref, k_ref, v_ref, visit,
                        jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * problem.scale).astype(dq_ref.dtype)


def _dkdv_kernel(item_ref, queries_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref,
                 dk_zero_ref, dv_zero_ref, dk_ref, dv_ref, *, problem: Problem, per_step: int):
  del dk_zero_ref, dv_zero_ref  # the outputs' initial zeros (aliased)
  group, size = problem.group, problem.block_size
  block, first, end = item_ref[0], item_ref[1], item_ref[2]
  key_start = block * size
  keys = pl.ds(key_start, size)
  k, v = k_ref[keys, :], v_ref[keys, :]
  key_pos_C = key_start + jnp.arange(size, dtype=jnp.int32)
  rows = per_step * group

  def step(j, carry):
    slot = first + j * per_step
    real_Q = slot + jnp.arange(per_step, dtype=jnp.int32) < end
    query_Q = jnp.where(real_Q, queries_ref[pl.ds(slot, per_step)], 0)
    q = q_ref[query_Q].reshape(rows, -1)
    do = do_ref[query_Q].reshape(rows, -1)
    lse, delta = lse_ref[query_Q].reshape(rows), delta_ref[query_Q].reshape(rows)
    position_R = jnp.broadcast_to((problem.query_offset + query_Q)[:, None],
                                  (per_step, group)).reshape(rows)
    real_R = jnp.broadcast_to(real_Q[:, None], (per_step, group)).reshape(rows)
    mask = (key_pos_C[None, :] <= position_R[:, None]) & real_R[:, None]
    p = probabilities(dot_nt(q, k), problem.score_scale, lse, mask, problem.interpret)
    return dkdv_step(*carry, p, q, do, v, delta)

  dk, dv = lax.fori_loop(0, cdiv(end - first, per_step), step,
                         (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))

  @pl.when(end > first)
  def _():
    pltriton.atomic_add(dk_ref, (keys, slice(None)), dk * problem.scale)
    pltriton.atomic_add(dv_ref, (keys, slice(None)), dv)


def _query_specs(problem: Problem):
  """Grid (query, batch, KV head): the block list and its length, the G heads' rows and
  statistics, and the KV head's whole keys and values."""
  group, head_dim = problem.group, problem.head_dim
  num_kv_heads, num_queries = problem.num_kv_heads, problem.query_len
  idx = pl.BlockSpec((None, None, None, problem.block_count), lambda t, b, h: (b, t, h, 0))
  count = pl.BlockSpec((1,), lambda t, b, h: ((b * num_queries + t) * num_kv_heads + h,))
  rows = pl.BlockSpec((None, None, group, head_dim), lambda t, b, h: (b, t, h, 0))
  stats = pl.BlockSpec((None, None, group), lambda t, b, h: (b, t, h))
  keys = pl.BlockSpec((None, problem.padded_key_len, None, head_dim),
                      lambda t, b, h: (b, 0, h, 0))
  return idx, count, rows, stats, keys


def forward(problem: Problem, blocks: NSABlockSizes, q, k, v, indices, counts):
  """(o [B, T, Hq, Dv] in q's dtype, lse2 [B, T, Hq] float32); q unpadded, k/v padded to
  padded_key_len, indices/counts from `selection.select_top_blocks`."""
  batch = q.shape[0]
  idx, count, rows, stats, keys = _query_specs(problem)
  return pl.pallas_call(
      functools.partial(_forward_kernel, problem=problem),
      grid=(problem.query_len, batch, problem.num_kv_heads),
      in_specs=[idx, count, rows, keys, keys],
      out_specs=[rows, stats],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)],
      compiler_params=triton_compiler_params(blocks.slc_num_warps, blocks.num_stages),
      interpret=problem.interpret, name="nsa_selected_fwd",
  )(indices, counts.reshape(-1), q, k, v)


def backward(problem: Problem, blocks: NSABlockSizes, q, k, v, indices, counts, o, lse, do):
  """(dq in q's dtype, dk, dv float32 [B, padded_key_len, Hkv, D]) of the selected branch."""
  batch = q.shape[0]
  idx, count, rows, stats, keys = _query_specs(problem)
  dq, delta = pl.pallas_call(
      functools.partial(_dq_kernel, problem=problem),
      grid=(problem.query_len, batch, problem.num_kv_heads),
      in_specs=[idx, count, rows, keys, keys, rows, rows, stats],
      out_specs=[rows, stats],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)],
      compiler_params=triton_compiler_params(blocks.slc_dq_num_warps, blocks.num_stages_bwd),
      interpret=problem.interpret, name="nsa_selected_dq",
  )(indices, counts.reshape(-1), q, k, v, do, o, lse)

  per_step = blocks.slc_queries_per_step
  queries, items = selection.queries_by_block(
      indices, num_blocks=problem.padded_key_len // problem.block_size,
      queries_per_program=blocks.slc_queries_per_program, pad=per_step)
  group, head_dim = problem.group, problem.head_dim
  all_rows = pl.BlockSpec((None, problem.query_len, group, head_dim),
                          lambda n, b, h: (b, 0, h, 0))
  all_stats = pl.BlockSpec((None, problem.query_len, group), lambda n, b, h: (b, 0, h))
  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, problem=problem, per_step=per_step),
      grid=(items.shape[2], batch, problem.num_kv_heads),
      in_specs=[pl.BlockSpec((None, None, None, 4), lambda n, b, h: (b, h, n, 0)),
                pl.BlockSpec(queries.shape, lambda n, b, h: (0,)),
                all_rows, all_rows, all_stats, all_stats, keys, keys, keys, keys],
      out_specs=[keys, keys],
      out_shape=[jax.ShapeDtypeStruct(k.shape, jnp.float32)] * 2,
      input_output_aliases={8: 0, 9: 1},
      compiler_params=triton_compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=problem.interpret, name="nsa_selected_dkdv",
  )(items, queries, q, do, lse, delta, k, v, zeros, zeros)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def selected_attention(problem: Problem, blocks: NSABlockSizes, q, k, v, indices, counts):
  """o_slc [B, T, Hq, Dv] in q's dtype (see `forward`); differentiable wrt q, k and v."""
  return forward(problem, blocks, q, k, v, indices, counts)[0]


def _selected_fwd(problem, blocks, q, k, v, indices, counts):
  o, lse = save_kernel_outputs(*forward(problem, blocks, q, k, v, indices, counts))
  return o, (q, k, v, indices, counts, o, lse)


def _selected_bwd(problem, blocks, residuals, do):
  q, k, v, indices, counts, o, lse = residuals
  dq, dk, dv = backward(problem, blocks, q, k, v, indices, counts, o, lse, do.astype(q.dtype))
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


selected_attention.defvjp(_selected_fwd, _selected_bwd)
