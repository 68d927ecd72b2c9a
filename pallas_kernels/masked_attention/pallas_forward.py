"""Query-tile-major Pallas kernels of masked attention: the forward pass and dq.

One program per (query tile, batch, query head). It visits the key tiles that intersect the
tile's window (three loops: masked edge, unmasked interior, masked edge) and then the first
entries of its KV head's kept list (sinks + LTE's kept keys, sorted by position) that are outside
the window of some query of the tile; an entry counts for a query only when it is outside that
query's window, so nothing is counted twice. Scores live in the log2 domain (exp2 is what the GPU
computes natively); the saved logsumexp is log2-based too.

Forward options (BlockSizes): `pack_gqa` runs the query heads of one KV head in one program (rows
= positions x heads, read straight from the [T, Hq, D] layout where they are contiguous), so each
K/V tile is loaded once per group; `gather_kept_in_kernel` reads the kept-list keys from k/v by
position. Without gradients the forward writes no logsumexp.
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


def exp2(x, interpret: bool):
  """2**x of float32 values as one PTX `ex2.approx.ftz.f32` (a single MUFU.EX2) on the GPU.

  jnp.exp2 lowers, in Pallas-Triton, to libdevice's `__nv_exp2f`, several instructions per
  element (ncu, 2026-11-23: replacing it made the SWA-1024 forward ~6% faster). Relative error
  ~2**-22; results under 2**-126 flush to 0, which a softmax cannot tell apart from 0;
  exp2(-inf) = 0. Interpret mode keeps jnp.exp2.
  """
  if interpret or x.dtype != jnp.float32:
    return jnp.exp2(x)
  [result] = _inline_asm("ex2.approx.ftz.f32 $0, $1;", x)
  return result


def exp2_affine(x_RC, scale: float, offset_R, interpret: bool):
  """2 ** (x * scale + offset[:, None]) of float32 scores: softmax numerators from raw scores.

  On the GPU one fused multiply-add and one MUFU.EX2 per element, in PTX. Written as
  `x * scale + offset` in jnp, Pallas-Triton emits a separate multiply and add that are not
  contracted (ncu, 2026-11-23: FMUL and FADD 2.2 each per score, no FFMA).
  """
  if interpret or x_RC.dtype != jnp.float32:
    return jnp.exp2(x_RC * scale + offset_R[:, None])
  [result] = _inline_asm(
      "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }", x_RC,
      jnp.full(x_RC.shape, scale, jnp.float32), jnp.broadcast_to(offset_R[:, None], x_RC.shape))
  return result


def _inline_asm(asm: str, *args):
  """Elementwise PTX over float32 arrays of one shape: one result per element."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=import-outside-toplevel
  constraints = "=f," + ",".join("f" for _ in args)
  return pltriton.elementwise_inline_asm(
      asm, args=list(args), constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])


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
  kept_refs = None
  if problem.has_kept_list and problem.gather_kept_in_kernel:  # (counts, None, None, positions)
    kept_refs, rest = (rest[0], None, None, rest[1]), rest[2:]
  elif problem.has_kept_list:
    kept_refs, rest = tuple(rest[:4]), rest[4:]
  return main, key_valid_ref, kept_refs, rest


def _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs, visit,
                 carry, heads_per_position=1):
  """Runs visit(carry, k, v, mask_or_None) over the window tiles, then the kept list.

  The tile's rows are block_q query positions, each repeated heads_per_position times in a row
  (GQA packing: row r is position q_start + r // heads_per_position).
  """
  row_R = jnp.arange(block_q * heads_per_position, dtype=jnp.int32)
  if heads_per_position > 1:  # non-negative: truncating division is the floor
    row_R = lax.div(row_R, jnp.int32(heads_per_position))
  query_pos = problem.query_offset + q_start + row_R
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
      entry_pos = kept_pos_ref[c_slice]
      mask = kept_mask(problem, query_pos, entry_pos)
      if kept_k_ref is None:
        # Gather load from the whole K/V block. Padding entries (PAD_POSITION) read the last row
        # instead, a finite value that their mask hides.
        rows = jnp.minimum(entry_pos, problem.padded_key_len - 1)
        return visit(carry, k_ref[rows, :], v_ref[rows, :], mask)
      return visit(carry, kept_k_ref[c_slice, :], kept_v_ref[c_slice, :], mask)

    carry = lax.fori_loop(0, cdiv(counts_ref[0], block_k), kept_tile, carry)
  return carry


def _forward_kernel(*refs, problem: Problem, block_q: int, block_k: int, group_rows: int,
                    with_lse: bool):
  """group_rows > 1: GQA packing, q/o blocks are [block_q, group_rows, D] (one KV head's heads)."""
  (q_ref, k_ref, v_ref), key_valid_ref, kept_refs, out_refs = _unpack(refs, problem, 0)
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  num_rows = block_q * group_rows
  head_dim, value_dim = q_ref.shape[-1], v_ref.shape[-1]
  q = q_ref[...]
  if group_rows > 1:
    q = q.reshape(num_rows, head_dim)  # rows (position, head): contiguous in [T, Hq, D] already
  score_scale = problem.scale * LOG2_E

  def visit(carry, k, v, mask):
    acc, row_max, row_sum = carry
    qk = dot_nt(q, k)
    if mask is not None:
      qk = jnp.where(mask, qk, -jnp.inf)
    # The scale is applied to the row maxima and inside exp2's argument (scale > 0, so
    # max(qk) * scale = max(qk * scale)), where exp2_affine makes qk * scale - shift one fused
    # multiply-add per score: written in jnp it stayed a multiply and a subtract (ncu, 2026-11-23).
    new_max = jnp.maximum(row_max, jnp.max(qk, axis=1) * score_scale)
    # A row that has seen no visible key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max) if mask is not None else new_max
    correction = exp2(row_max - shift, problem.interpret)
    p = exp2_affine(qk, score_scale, -shift, problem.interpret)
    row_sum = row_sum * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + dot_nn(p.astype(v.dtype), v)
    return acc, new_max, row_sum

  carry = (jnp.zeros((num_rows, value_dim), jnp.float32),
           jnp.full((num_rows,), -jnp.inf, jnp.float32), jnp.zeros((num_rows,), jnp.float32))
  acc, row_max, row_sum = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref,
                                       key_valid_ref, kept_refs, visit, carry, group_rows)
  empty = row_sum == 0.0  # no visible key: output 0 (the reference's convention)
  # One reciprocal per row and a multiply per element, not a division per element.
  o = (acc * (1.0 / jnp.where(empty, 1.0, row_sum))[:, None]).astype(out_refs[0].dtype)
  if group_rows > 1:
    o = o.reshape(block_q, group_rows, value_dim)
  out_refs[0][...] = o
  if with_lse:  # training only: inference (prefill) never reads it, so it is not written there
    lse = jnp.where(empty, 0.0, row_max + jnp.log2(jnp.where(empty, 1.0, row_sum)))
    out_refs[1][...] = lse.reshape(block_q, group_rows) if group_rows > 1 else lse


def _dq_kernel(*refs, problem: Problem, block_q: int, block_k: int):
  (q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref), key_valid_ref, kept_refs, (dq_ref, delta_ref) = (
      _unpack(refs, problem, 3))
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  q, do = q_ref[...], do_ref[...]
  lse = lse_ref[...]
  # delta_i = sum_d o_id do_id = sum_j p_ij dp_ij, the softmax gradient's row term, computed where
  # do is loaded anyway and written for the dk/dv kernels (a separate XLA reduction read o and do
  # once more: 95 us of a 4 ms SWA fwd+bwd at B2 T16384, 2026-11-23).
  delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  delta_ref[...] = delta
  score_scale = problem.scale * LOG2_E

  def visit(dq, k, v, mask):
    p = exp2_affine(dot_nt(q, k), score_scale, -lse, problem.interpret)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (dot_nt(do, v) - delta[:, None])
    return dq + dot_nn(ds.astype(k.dtype), k)

  dq = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs,
                    visit, jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
  dq_ref[...] = (dq * problem.scale).astype(dq_ref.dtype)


def _query_major_specs(problem: Problem, block_q: int, with_backward_inputs: bool,
                       key_valid, kept, group_rows: int = 1):
  """in_specs and inputs-order tail for the grid (query tile, batch, head).

  The head axis of the grid counts query heads, or KV heads with GQA packing (group_rows > 1:
  each q block holds the group_rows query heads of one KV head).
  """
  num_q_tiles = problem.padded_query_len // block_q
  group = problem.group
  kv_head = (lambda h: h) if group_rows > 1 else (lambda h: h // group)
  head_dim = problem.head_dim
  rows_spec = _rows_spec(problem, block_q, group_rows)
  whole_kv = pl.BlockSpec((None, problem.padded_key_len, None, head_dim),
                          lambda i, b, h: (b, 0, kv_head(h), 0))
  specs = [rows_spec, whole_kv, whole_kv]
  if with_backward_inputs:  # do, o, lse
    specs += [rows_spec, rows_spec, _stat_spec(problem, block_q)]
  if key_valid is not None:
    specs.append(pl.BlockSpec((None, problem.padded_key_len), lambda i, b, h: (b, 0)))
  if kept is not None:
    capacity = kept.positions_BKC.shape[-1]
    num_kv_heads = problem.num_kv_heads
    specs.append(pl.BlockSpec((1,), lambda i, b, h: (
        (b * num_kv_heads + kv_head(h)) * num_q_tiles + num_q_tiles - 1 - i,)))
    if not problem.gather_kept_in_kernel:
      specs += [
          pl.BlockSpec((None, capacity, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0)),
          pl.BlockSpec((None, capacity, None, head_dim), lambda i, b, h: (b, 0, kv_head(h), 0)),
      ]
    specs.append(pl.BlockSpec((None, None, capacity), lambda i, b, h: (b, kv_head(h), 0)))
  return specs


def _stat_spec(problem: Problem, block_q: int):
  """One query tile of a per-row statistic [B, Hq, Tp] (lse, delta); grid (tile, batch, head)."""
  num_q_tiles = problem.padded_query_len // block_q
  return pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, num_q_tiles - 1 - i))


def _rows_spec(problem: Problem, block_q: int, group_rows: int):
  """q/o blocks: [block_q, D] of one query head, or [block_q, group_rows, D] (GQA packing)."""
  num_q_tiles = problem.padded_query_len // block_q
  if group_rows > 1:
    return pl.BlockSpec((None, block_q, group_rows, problem.head_dim),
                        lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))
  return pl.BlockSpec((None, block_q, None, problem.head_dim),
                      lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))


def packed_group(problem: Problem, blocks: BlockSizes) -> int:
  """Query heads per forward program: the GQA group when packing applies, else 1."""
  group = problem.group
  if blocks.pack_gqa and group > 1 and not group & (group - 1):
    return group
  return 1


def _tail_inputs(key_valid, kept, counts):
  inputs = []
  if key_valid is not None:
    inputs.append(key_valid)
  if kept is not None:
    values = [] if kept.k_BCKD is None else [kept.k_BCKD, kept.v_BCKD]  # None: gathered in-kernel
    inputs += [counts.reshape(-1), *values, kept.positions_BKC]
  return inputs


def forward(problem: Problem, blocks: BlockSizes, q, k, v, key_valid, kept, counts, *,
            with_lse: bool = True):
  """Padded inputs -> (o [B, Tp, Hq, D] in q's dtype, lse2 [B, Hq, Tp] float32 or None).

  with_lse=False (inference) skips the logsumexp output.
  """
  batch = q.shape[0]
  block_q, block_k = blocks.block_q, blocks.block_k
  num_q_tiles = problem.padded_query_len // block_q
  group_rows = packed_group(problem, blocks)
  rows_spec = _rows_spec(problem, block_q, group_rows)
  out_specs = [rows_spec]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if with_lse and group_rows > 1:  # rows are (position, head): lse comes out as [B, Tp, Hq]
    out_specs.append(pl.BlockSpec((None, block_q, group_rows),
                                  lambda i, b, h: (b, num_q_tiles - 1 - i, h)))
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, problem.padded_query_len, problem.num_q_heads), jnp.float32))
  elif with_lse:
    out_specs.append(pl.BlockSpec((None, None, block_q),
                                  lambda i, b, h: (b, h, num_q_tiles - 1 - i)))
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, problem.num_q_heads, problem.padded_query_len), jnp.float32))
  outputs = pl.pallas_call(
      functools.partial(_forward_kernel, problem=problem, block_q=block_q, block_k=block_k,
                        group_rows=group_rows, with_lse=with_lse),
      grid=(num_q_tiles, batch, problem.num_q_heads // group_rows),
      in_specs=_query_major_specs(problem, block_q, False, key_valid, kept, group_rows),
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
      interpret=problem.interpret,
      name="masked_attention_fwd",
  )(q, k, v, *_tail_inputs(key_valid, kept, counts))
  if not with_lse:
    return outputs[0], None
  o, lse = outputs
  if group_rows > 1:
    lse = jnp.transpose(lse, (0, 2, 1))  # small (float32 per row); the backward reads [B, Hq, Tp]
  return o, lse


def backward_dq(problem: Problem, blocks: BlockSizes, q, k, v, do, o, lse, key_valid, kept,
                counts):
  """(dq [B, Tp, Hq, D] in q's dtype, delta [B, Hq, Tp] float32: sum_d o * do per row)."""
  batch = q.shape[0]
  block_q, block_k = blocks.block_q_dq, blocks.block_k_dq
  num_q_tiles = problem.padded_query_len // block_q
  rows_spec = pl.BlockSpec((None, block_q, None, problem.head_dim),
                           lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))
  return pl.pallas_call(
      functools.partial(_dq_kernel, problem=problem, block_q=block_q, block_k=block_k),
      grid=(num_q_tiles, batch, problem.num_q_heads),
      in_specs=_query_major_specs(problem, block_q, True, key_valid, kept),
      out_specs=[rows_spec, _stat_spec(problem, block_q)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, problem.num_q_heads, problem.padded_query_len),
                                      jnp.float32)],
      compiler_params=compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=problem.interpret,
      name="masked_attention_dq",
  )(q, k, v, do, o, lse, *_tail_inputs(key_valid, kept, counts))
