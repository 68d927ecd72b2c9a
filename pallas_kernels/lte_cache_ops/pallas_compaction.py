"""The LTE prefill compaction (§5.2 step 5, `reference.compact_top_scores`) in Pallas (Triton).

One program per (row, KV head) selects the top-min(b, n) of the first n scores without sorting:
  1. scores map to int32 keys whose order is the float order (no NaN in scores);
  2. the take-th largest key tau is built bit by bit (33 counting passes over the n scores: in
     registers when n <= count_chunk, else streamed from L1/L2 in count_chunk steps);
  3. a token is selected when key > tau, or key == tau and it is among the first (take -
     #{key > tau}) such ties by position: exactly `lax.top_k`'s choice (ties to the earlier token);
  4. kept = selected and score > 0; a running prefix count gives each kept token its slot, so the
     set comes out in position order, and only the kept K/V rows are read and written.
Slots past the kept count get zeros / -inf, as in the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.pallas_common import interpret_mode, triton_compiler_params

INT32_MIN = -(1 << 31)


def _ordered_key(score):
  """int32 keys with the order of the float32 scores (-0.0 sorts just below +0.0)."""
  bits = jax.lax.bitcast_convert_type(score, jnp.int32)
  # Negative floats order backwards as integers: flip their magnitude bits.
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _compact_kernel(score_ref, k_ref, v_ref, oow_k_ref, oow_v_ref, oow_score_ref, past_len_ref,
                    kept_ref, *, num_candidates, take, cap, count_chunk, copy_chunk):
  row, head = pl.program_id(0), pl.program_id(1)
  length = score_ref.shape[1]
  head_dim, value_dim = k_ref.shape[-1], v_ref.shape[-1]

  def chunk_scores(c, chunk):
    pos_N = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    valid_N = pos_N < num_candidates
    score_N = plgpu.load(score_ref.at[row, pl.ds(c * chunk, chunk), head], mask=valid_N,
                         other=-jnp.inf)
    return pos_N, valid_N, score_N

  num_count_chunks = pl.cdiv(num_candidates, count_chunk)
  if num_count_chunks == 1:
    # All candidates fit one tile: load them once, and the 33 counting passes run in registers.
    _, resident_valid_N, resident_score_N = chunk_scores(0, count_chunk)
    resident_key_N = _ordered_key(resident_score_N)

    def count_at_least(threshold):
      return jnp.sum(((resident_key_N >= threshold) & resident_valid_N).astype(jnp.int32))
  else:
    def count_at_least(threshold):
      def body(c, total):
        _, valid_N, score_N = chunk_scores(c, count_chunk)
        key_N = _ordered_key(score_N)
        return total + jnp.sum(((key_N >= threshold) & valid_N).astype(jnp.int32))
      return jax.lax.fori_loop(0, num_count_chunks, body, jnp.int32(0))

  # tau = the largest key with count(key >= tau) >= take (the take-th largest), sign bit first.
  tau = jnp.where(count_at_least(jnp.int32(0)) >= take, jnp.int32(0), jnp.int32(INT32_MIN))

  def bit_step(i, tau):
    candidate = tau | jnp.left_shift(jnp.int32(1), 30 - i)
    return jnp.where(count_at_least(candidate) >= take, candidate, tau)

  tau = jax.lax.fori_loop(0, 31, bit_step, tau)
  # Keys are at most the key of +inf, far below INT32_MAX: tau + 1 does not overflow.
  ties_to_take = take - count_at_least(tau + 1)

  chunk = copy_chunk

  def select(c, carry):
    ties_seen, kept_seen = carry
    pos_N, valid_N, score_N = chunk_scores(c, chunk)
    key_N = _ordered_key(score_N)
    tie_N = (key_N == tau) & valid_N
    tie_rank_N = ties_seen + jnp.cumsum(tie_N.astype(jnp.int32))  # 1-based among the ties
    selected_N = valid_N & ((key_N > tau) | (tie_N & (tie_rank_N <= ties_to_take)))
    kept_N = selected_N & (score_N > 0)
    kept_count_N = jnp.cumsum(kept_N.astype(jnp.int32))
    plgpu.store(kept_ref.at[row, pl.ds(c * chunk, chunk), head], kept_N.astype(jnp.int8),
                mask=pos_N < length)
    # Scatter the kept rows to their slots. Non-kept lanes are masked (no access on the GPU) and
    # point past the end, so that interpret mode, which writes the old value back for masked
    # lanes, drops them instead of racing a kept lane for its slot.
    slot_N = jnp.where(kept_N, kept_seen + kept_count_N - 1, cap)
    # Array indices on every non-scalar axis (a [N, 1] x [1, D] grid): the form of scatter that
    # both Triton and interpret mode lower.
    slot_N1 = slot_N[:, None]
    dim_1D = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    dim_1V = jnp.arange(value_dim, dtype=jnp.int32)[None, :]
    row_mask_ND = jnp.broadcast_to(kept_N[:, None], (chunk, head_dim))
    k_ND = plgpu.load(k_ref.at[row, pl.ds(c * chunk, chunk), head, :], mask=row_mask_ND,
                      other=0)
    plgpu.store(oow_k_ref.at[row, slot_N1, head, dim_1D], k_ND, mask=row_mask_ND)
    row_mask_NV = jnp.broadcast_to(kept_N[:, None], (chunk, value_dim))
    v_NV = plgpu.load(v_ref.at[row, pl.ds(c * chunk, chunk), head, :], mask=row_mask_NV,
                      other=0)
    plgpu.store(oow_v_ref.at[row, slot_N1, head, dim_1V], v_NV, mask=row_mask_NV)
    plgpu.store(oow_score_ref.at[row, slot_N, head], score_N, mask=kept_N)
    return ties_seen + jnp.sum(tie_N.astype(jnp.int32)), kept_seen + jnp.sum(kept_N.astype(
        jnp.int32))

  # Over all T positions: tokens [n, T) (the window) get kept = False.
  _, past_len = jax.lax.fori_loop(0, pl.cdiv(length, chunk), select,
                                  (jnp.int32(0), jnp.int32(0)))
  past_len_ref[row, head] = past_len

  def fill_empty(c, _):  # slots [past_len, cap): disjoint from the scattered ones, no race
    slot_N = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    empty_N = (slot_N >= past_len) & (slot_N < cap)
    slots = pl.ds(c * chunk, chunk)
    plgpu.store(oow_k_ref.at[row, slots, head, :], jnp.zeros((chunk, head_dim), oow_k_ref.dtype),
                mask=jnp.broadcast_to(empty_N[:, None], (chunk, head_dim)))
    plgpu.store(oow_v_ref.at[row, slots, head, :],
                jnp.zeros((chunk, value_dim), oow_v_ref.dtype),
                mask=jnp.broadcast_to(empty_N[:, None], (chunk, value_dim)))
    plgpu.store(oow_score_ref.at[row, slots, head], jnp.full((chunk,), -jnp.inf, jnp.float32),
                mask=empty_N)
    return 0

  jax.lax.fori_loop(0, pl.cdiv(cap, chunk), fill_empty, 0)


def _check_supported(k_BTKD, v_BTKD, score_BTK):
  for name, dim in (("head dim", k_BTKD.shape[-1]), ("value dim", v_BTKD.shape[-1])):
    if dim < 16 or dim & (dim - 1):
      raise NotImplementedError(
          f"compact_top_scores[pallas]: {name} {dim} must be a power of two >= 16 (Triton)")
  if score_BTK.dtype != jnp.float32:
    raise NotImplementedError(
        f"compact_top_scores[pallas]: scores must be float32, got {score_BTK.dtype}")


@functools.partial(jax.jit, static_argnames=("num_candidates", "cap", "count_chunk",
                                             "copy_chunk"))
def compact_top_scores(k_BTKD, v_BTKD, score_BTK, num_candidates: int, cap: int,
                       count_chunk: int = 4096, copy_chunk: int = 64):
  """Same contract as `reference.compact_top_scores` (scores must not be NaN).

  count_chunk: scores per step of the counting passes (up to it, they stay in registers: 4096
  int32 keys are 32 registers per thread at 4 warps); copy_chunk: tokens per step of the final
  pass that moves the kept K/V rows. Both powers of two >= 16.
  """
  _check_supported(k_BTKD, v_BTKD, score_BTK)
  for name, value in (("count_chunk", count_chunk), ("copy_chunk", copy_chunk)):
    if value < 16 or value & (value - 1):
      raise ValueError(f"compact_top_scores: {name} must be a power of two >= 16, got {value}")
  batch, length, num_kv_heads, _ = k_BTKD.shape
  kernel = functools.partial(
      _compact_kernel, num_candidates=num_candidates, take=min(cap, num_candidates), cap=cap,
      count_chunk=max(16, min(count_chunk, pl.next_power_of_2(num_candidates))),
      copy_chunk=copy_chunk)
  oow_k, oow_v, oow_score, past_len, kept = pl.pallas_call(
      kernel,
      out_shape=(
          jax.ShapeDtypeStruct((batch, cap, num_kv_heads, k_BTKD.shape[-1]), k_BTKD.dtype),
          jax.ShapeDtypeStruct((batch, cap, num_kv_heads, v_BTKD.shape[-1]), v_BTKD.dtype),
          jax.ShapeDtypeStruct((batch, cap, num_kv_heads), jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads), jnp.int32),
          jax.ShapeDtypeStruct((batch, length, num_kv_heads), jnp.int8),  # Triton stores bytes
      ),
      grid=(batch, num_kv_heads),
      compiler_params=triton_compiler_params(num_warps=4, num_stages=2),
      interpret=interpret_mode(),
      name="lte_compact_top_scores",
  )(score_BTK, k_BTKD, v_BTKD)
  return oow_k, oow_v, oow_score, past_len, kept != 0
