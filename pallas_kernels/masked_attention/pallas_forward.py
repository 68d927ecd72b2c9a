"""Query-tile-major Pallas kernels of masked attention: the forward pass and dq.

One program per (query tile, batch, query head). It visits the key tiles that intersect the
tile's window (three loops: masked edge, unmasked interior, masked edge) and then the first
entries of its KV head's kept list (sinks + LTE's kept keys, sorted by position) that are outside
the window of some query of the tile (two loops: unmasked, the list tiles outside every query's
window; masked, the last one or two); an entry counts for a query only when it is outside that
query's window, so nothing is counted twice. Scores live in the log2 domain (exp2 is what the GPU
computes natively); the saved logsumexp is log2-based too.

Without gradients the forward writes no logsumexp and reads the kept-list keys from k/v by
position; under differentiation it reads the gathered copies that the backward needs anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.masked_attention.tiling import (
    BlockSizes, Problem, kept_mask, key_tiles_of_query_tile, window_mask)
from pallas_kernels.pallas_common import (
    LOG2_E, cdiv, dot_nt, dq_step, probabilities, softmax_finish, softmax_start, softmax_step,
    triton_compiler_params)


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
                 carry):
  """Runs visit(carry, k, v, mask_or_None) over the window tiles, then the kept list."""
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

    def kept_tile(masked, ct, carry):
      c_slice = pl.ds(ct * block_k, block_k)
      entry_pos = kept_pos_ref[c_slice]
      mask = kept_mask(problem, query_pos, entry_pos) if masked else None
      if kept_k_ref is None:
        # Gather load from the whole K/V block. Padding entries (PAD_POSITION) read the last row
        # instead, a finite value that their mask hides.
        rows = jnp.minimum(entry_pos, problem.padded_key_len - 1)
        return visit(carry, k_ref[rows, :], v_ref[rows, :], mask)
      return visit(carry, kept_k_ref[c_slice, :], kept_v_ref[c_slice, :], mask)

    # The count is of the entries outside the window of the tile's last query. Those that some
    # earlier query of the tile still has in its window sit at the block_q - 1 positions before,
    # so they are at most the count's last block_q - 1 entries (distinct, sorted positions): the
    # list tiles before them are visible to every query of the tile and need no mask.
    count = counts_ref[0]
    full_tiles = jnp.maximum(count - (block_q - 1), 0) // block_k
    carry = lax.fori_loop(0, full_tiles, functools.partial(kept_tile, False), carry)
    carry = lax.fori_loop(full_tiles, cdiv(count, block_k), functools.partial(kept_tile, True),
                          carry)
  return carry


def _forward_kernel(*refs, problem: Problem, block_q: int, block_k: int, with_lse: bool):
  (q_ref, k_ref, v_ref), key_valid_ref, kept_refs, out_refs = _unpack(refs, problem, 0)
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  value_dim = v_ref.shape[-1]
  q = q_ref[...]
  score_scale = problem.scale * LOG2_E
  visit = lambda carry, k, v, mask: softmax_step(carry, dot_nt(q, k), v, mask, score_scale,
                                                 problem.interpret)
  carry = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs,
                       visit, softmax_start(block_q, value_dim))
  o, lse = softmax_finish(carry)
  out_refs[0][...] = o.astype(out_refs[0].dtype)
  if with_lse:  # training only: inference (prefill) never reads it, so it is not written there
    out_refs[1][...] = lse


def _dq_kernel(*refs, problem: Problem, block_q: int, block_k: int):
  (q_ref, k_ref, v_ref, do_ref, o_ref, lse_ref), key_valid_ref, kept_refs, (dq_ref, delta_ref) = (
      _unpack(refs, problem, 3))
  num_q_tiles = problem.padded_query_len // block_q
  q_start = (num_q_tiles - 1 - pl.program_id(0)) * block_q
  q, do = q_ref[...], do_ref[...]
  lse = lse_ref[...]
  # delta_i = sum_d o_id do_id = sum_j p_ij dp_ij, the softmax gradient's row term, computed where
  # do is loaded anyway and written for the dk/dv kernels (a separate XLA reduction read o and do
  # once more: 95 us of a 4 ms SWA fwd+bwd at B2 T16384).
  delta = jnp.sum(o_ref[...].astype(jnp.float32) * do.astype(jnp.float32), axis=1)
  delta_ref[...] = delta
  score_scale = problem.scale * LOG2_E

  def visit(dq, k, v, mask):
    p = probabilities(dot_nt(q, k), score_scale, lse, mask, problem.interpret)
    return dq_step(dq, p, do, k, v, delta)

  dq = _visit_tiles(problem, q_start, block_q, block_k, k_ref, v_ref, key_valid_ref, kept_refs,
                    visit, jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32))
  dq_ref[...] = (dq * problem.scale).astype(dq_ref.dtype)


def _query_major_specs(problem: Problem, block_q: int, with_backward_inputs: bool,
                       key_valid, kept):
  """in_specs and inputs-order tail for the grid (query tile, batch, query head)."""
  num_q_tiles = problem.padded_query_len // block_q
  group = problem.group
  kv_head = lambda h: h // group
  head_dim = problem.head_dim
  rows_spec = _rows_spec(problem, block_q)
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


def _rows_spec(problem: Problem, block_q: int):
  """q/o/do blocks: [block_q, D] of one query head; grid (tile, batch, head)."""
  num_q_tiles = problem.padded_query_len // block_q
  return pl.BlockSpec((None, block_q, None, problem.head_dim),
                      lambda i, b, h: (b, num_q_tiles - 1 - i, h, 0))


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
  out_specs = [_rows_spec(problem, block_q)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
  if with_lse:
    out_specs.append(_stat_spec(problem, block_q))
    out_shape.append(jax.ShapeDtypeStruct(
        (batch, problem.num_q_heads, problem.padded_query_len), jnp.float32))
  outputs = pl.pallas_call(
      functools.partial(_forward_kernel, problem=problem, block_q=block_q, block_k=block_k,
                        with_lse=with_lse),
      grid=(num_q_tiles, batch, problem.num_q_heads),
      in_specs=_query_major_specs(problem, block_q, False, key_valid, kept),
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=triton_compiler_params(blocks.num_warps, blocks.num_stages),
      interpret=problem.interpret,
      name="masked_attention_fwd",
  )(q, k, v, *_tail_inputs(key_valid, kept, counts))
  if not with_lse:
    return outputs[0], None
  return tuple(outputs)


def backward_dq(problem: Problem, blocks: BlockSizes, q, k, v, do, o, lse, key_valid, kept,
                counts):
  """(dq [B, Tp, Hq, D] in q's dtype, delta [B, Hq, Tp] float32: sum_d o * do per row)."""
  batch = q.shape[0]
  block_q, block_k = blocks.block_q_dq, blocks.block_k_dq
  num_q_tiles = problem.padded_query_len // block_q
  return pl.pallas_call(
      functools.partial(_dq_kernel, problem=problem, block_q=block_q, block_k=block_k),
      grid=(num_q_tiles, batch, problem.num_q_heads),
      in_specs=_query_major_specs(problem, block_q, True, key_valid, kept),
      out_specs=[_rows_spec(problem, block_q), _stat_spec(problem, block_q)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, problem.num_q_heads, problem.padded_query_len),
                                      jnp.float32)],
      compiler_params=triton_compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=problem.interpret,
      name="masked_attention_dq",
  )(q, k, v, do, o, lse, *_tail_inputs(key_valid, kept, counts))
