"""Query-tile-major Pallas kernels of masked attention: the forward pass and dq.

One program per (query tile, batch, query head). It visits the key tiles that intersect the
tile's window (three loops: masked edge, unmasked interior, masked edge) and then the first
entries of its KV head's kept list (sinks + LTE's kept keys, sorted by position) that are outside
the window of some query of the tile; an entry counts for a query only when it is outside that
query's window, so nothing is counted twice. Scores live in the log2 domain (exp2 is what the GPU
computes natively); the saved logsumexp is log2-based too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.masked_attention.tiling import (
    BlockSizes, Problem, cdiv, kept_mask, key_tiles_of_query_tile, window_mask)

LOG2_E = math.log2(math.e)


def compiler_params(num_warps: int, num_stages: int):
  """Triton launch parameters; the class was renamed across JAX versions."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel
  params_class = getattr(pltriton, "CompilerParams", None) or getattr(
      pltriton, "TritonCompilerParams")
  return params_class(num_warps=num_warps, num_stages=num_stages)


def dot_nt(a, b):
  """a @ b.T with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
  """a.T @ b with float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _unpack(refs, problem: Problem, num_extra_inputs: int):
  """Splits kernel refs: (main inputs, key_valid, (counts, kept k, kept v, positions), outputs)."""
  refs = list(refs)
  main = refs[:3 + num_extra_inputs]
  rest = refs[3 + num_extra_inputs:]
  key_valid_ref = rest.pop(0) if problem.has_key_valid else None
  kept_refs = tuple(rest[:4]) if problem.has_kept_list else None
  if problem.has_kept_list:
    rest = rest[4:]
  return main, key_valid_ref, kept_refs, rest


def _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs, visit,
                 carry):
  """Runs visit(carry, k, v, mask_or_None, key_pos) over the window tiles, then the kept list."""
  query_pos = problem.query_offset + q_start + jnp.arange(block_q, dtype=jnp.int32)
  first, interior_start, interior_end, end = key_tiles_of_query_tile(
      problem, q_start, block_q, block_k)

  def window_tile(masked, kt, carry):
    k_slice = pl.ds(kt * block_k, block_k)
    k, v = k_ref[k_slice, :], v_ref[k_slice, :]
    if not masked:
      return visit(carry, k, v, None)
    key_pos = kt * block_k + jnp.arange(block_k, dtype=jnp.int32)
    key_valid = None if key_valid_ref is None else key_valid_ref[k_slice]
    return visit(carry, k, v, window_mask(problem, query_pos, key_pos, key_valid))

  carry = lax.fori_loop(first, interior_start, functools.partial(window_tile, True), carry)
  carry = lax.fori_loop(interior_start, interior_end, functools.partial(window_tile, False), carry)
  carry = lax.fori_loop(interior_end, end, functools.partial(window_tile, True), carry)
  if kept_refs is not None:
    counts_ref, kept_k_ref, kept_v_ref, kept_pos_ref = kept_refs

    def kept_tile(ct, carry):
      c_slice = pl.ds(ct * block_k, block_k)
      mask = kept_mask(problem, query_pos, kept_pos_ref[c_slice])
      return visit(carry, kept_k_ref[c_slice, :], kept_v_ref[c_slice, :], mask)

    carry = lax.fori_loop(0, cdiv(counts_ref[0], block_k), kept_tile, carry)
  return carry


def _forward_kernel(*refs, problem: Problem, block_q: int, block_k: int):
  (q_ref, k_ref, v_ref), key_valid_ref, kept_refs, (o_ref, lse_ref) = _unpack(refs, problem, 0)
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  q = q_ref[...]
  score_scale = problem.scale * LOG2_E

  def visit(carry, k, v, mask):
    acc, row_max, row_sum = carry
    s = dot_nt(q, k) * score_scale
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(s, axis=1))
    # A row that has seen no visible key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max) if mask is not None else new_max
    correction = jnp.exp2(row_max - shift)
    p = jnp.exp2(s - shift[:, None])
    row_sum = row_sum * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + dot_nn(p.astype(v.dtype), v)
    return acc, new_max, row_sum

  carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
  acc, row_max, row_sum = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref,
                                       key_valid_ref, kept_refs, visit, carry)
  empty = row_sum == 0.0  # no visible key: output 0 (the reference's convention)
  o_ref[...] = (acc / jnp.where(empty, 1.0, row_sum)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(empty, 0.0, row_max + jnp.log2(jnp.where(empty, 1.0, row_sum)))


def _dq_kernel(*refs, problem: Problem, block_q: int, block_k: int):
  (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), key_valid_ref, kept_refs, (dq_ref,) = _unpack(
      refs, problem, 3)
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  score_scale = problem.scale * LOG2_E

  def visit(dq, k, v, mask):
    s = dot_nt(q, k) * score_scale
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp2(s - lse[:, None])
    ds = p * (dot_nt(do, v) - delta[:, None])
    return dq + dot_nn(ds.astype(k.dtype), k)

  dq = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs,
                    visit, jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
  dq_ref[...] = (dq * problem.scale).astype(dq_ref.dtype)


def _query_major_specs(problem: Problem, block_q: int, with_backward_inputs: bool,
                       key_valid, kept):
  """in_specs and inputs-order tail for the grid (query tile, batch, query head)."""
  num_q_tiles = problem.padded_query_len // block_q
  group = problem.group
  head_dim = problem.head_dim
  q_tile = lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0)
  rows_spec = pl.BlockSpec((None, block_q, None, head_dim), q_tile)
  whole_kv = pl.BlockSpec((None, problem.padded_key_len, None, head_dim),
                          lambda i, b, h: (b, 0, h // group, 0))
  specs = [rows_spec, whole_kv, whole_kv]
  if with_backward_inputs:
    stat_spec = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, num_q_tiles - 1 - i))
    specs += [rows_spec, stat_spec, stat_spec]
  if key_valid is not None:
    specs.append(pl.BlockSpec((None, problem.padded_key_len), lambda i, b, h: (b, 0)))
  if kept is not None:
    capacity = kept.positions_BKC.shape[-1]
    num_kv_heads = problem.num_kv_heads
    specs += [
        pl.BlockSpec((1,), lambda i, b, h: (
            (b * num_kv_heads + h // group) * num_q_tiles + num_q_tiles - 1 - i,)),
        pl.BlockSpec((None, capacity, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, capacity, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, None, capacity), lambda i, b, h: (b, h // group, 0)),
    ]
  return specs


def _tail_inputs(key_valid, kept, counts):
  inputs = []
  if key_valid is not None:
    inputs.append(key_valid)
  if kept is not None:
    inputs += [counts.reshape(-1), kept.k_BCKD, kept.v_BCKD, kept.positions_BKC]
  return inputs


def forward(problem: Problem, blocks: BlockSizes, q, k, v, key_valid, kept, counts):
  """Padded inputs -> (o [B, Tp, Hq, D] in q's dtype, lse2 [B, Hq, Tp] float32)."""
  batch = q.shape[0]
  block_q, block_k = blocks.block_q, blocks.block_k
  num_q_tiles = problem.padded_query_len // block_q
  rows_spec = pl.BlockSpec((None, block_q, None, problem.head_dim),
                           lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))
  return pl.pallas_call(
      functools.partial(_forward_kernel, problem=problem, block_q=block_q, block_k=block_k),
      grid=(num_q_tiles, batch, problem.num_q_heads),
      in_specs=_query_major_specs(problem, block_q, False, key_valid, kept),
      out_specs=[rows_spec, pl.BlockSpec((None, None, block_q),
                                         lambda i, b, h: (b, h, num_q_tiles - 1 - i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, problem.num_q_heads, problem.padded_query_len),
                                      jnp.float32)],
      compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
      interpret=problem.interpret,
      name="masked_attention_fwd",
  )(q, k, v, *_tail_inputs(key_valid, kept, counts))


def backward_dq(problem: Problem, blocks: BlockSizes, q, k, v, do, lse, delta, key_valid, kept,
                counts):
  """dq [B, Tp, Hq, D] in q's dtype."""
  batch = q.shape[0]
  block_q, block_k = blocks.block_q_dq, blocks.block_k_dq
  num_q_tiles = problem.padded_query_len // block_q
  rows_spec = pl.BlockSpec((None, block_q, None, problem.head_dim),
                           lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))
  return pl.pallas_call(
      functools.partial(_dq_kernel, problem=problem, block_q=block_q, block_k=block_k),
      grid=(num_q_tiles, batch, problem.num_q_heads),
      in_specs=_query_major_specs(problem, block_q, True, key_valid, kept),
      out_specs=rows_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=problem.interpret,
      name="masked_attention_dq",
  )(q, k, v, do, lse, delta, *_tail_inputs(key_valid, kept, counts))
