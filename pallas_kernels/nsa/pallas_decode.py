"""`implementation="pallas"` of NSA decoding: one query per batch row against the caches.

    partials, scores = compressed attention at each row's position, split-K      (first kernel)
    o_cmp, selection = the partials merged, the importance from the scores, top-n (second)
    o_slc, o_swa = the selected blocks and the window, split-K                   (third)
    o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa                                  (XLA)

The compressed keys come from the compressed cache (a block is pooled once, when it completes),
so a step reads the complete blocks' means, the block_count selected blocks and the window, and
nothing else of the cache. The first and third kernels run a program per (batch row, KV head,
split) whose rows are the KV head's G query heads (each tile is read once for the group); split s
takes every `decode_splits`-th tile of compressed keys, or selected block and window tile, so that
a batch of 32 rows still keeps every core busy. The first kernel also writes each head's
compressed scores; the second, a program per (batch row, KV head), merges the first's partial
softmaxes, forms the block importance from the scores as `reference.block_importance` does and
takes its top-n as `selection.select_top_blocks` does (the lower block first among equal
importances), so that the step between the attention kernels is one launch instead of a chain of
small XLA kernels (merge, importance, top-k, counts; at a 64K context XLA's top-k alone took 60
of 93 us, H200). The third kernel's partials are merged in XLA with the gates. The caches are
stacked over layer groups ([G, B, ...]) and passed whole; the kernels read the group index from
an int32 [1] operand and index group g's rows themselves, so no slice of the cache is made for
the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.nsa import reference, selection
from pallas_kernels.nsa.tiling import NSABlockSizes, Problem, check_supported
from pallas_kernels.pallas_common import (
    cdiv, dot_nt, interpret_mode, merge_splits, next_power_of_two, softmax_start, softmax_step,
    triton_compiler_params)
from pallas_kernels.stacked import group_operand

# The row maximum written for a split that saw no key: finite, so that merging gives it weight 0
# (exp2 of a very negative number) instead of NaN.
EMPTY_MAX = -1e30


def _write_partial(carry, o_ref, max_ref, sum_ref):
  acc, row_max, row_sum = carry
  o_ref[...] = acc
  max_ref[...] = jnp.where(row_sum > 0, row_max, EMPTY_MAX)
  sum_ref[...] = row_sum


def _strided_loop(count, split, splits: int, body, carry):
  """body(i, carry) for split `split`'s share i = 0, 1, ... of `count` units (unit split + i *
  splits)."""
  return lax.fori_loop(0, cdiv(jnp.maximum(count - split, 0), splits), body, carry)


def _cache_rows(group_ref):
  """The index of this program's (layer group, batch row, :, KV head) rows in a stacked cache."""
  layer_group, row, kv_head = group_ref[0], pl.program_id(0), pl.program_id(1)
  return lambda slots: (layer_group, row, slots, kv_head, slice(None))


def _compressed_kernel(group_ref, position_ref, q_ref, kc_ref, vc_ref, o_ref, max_ref, sum_ref,
                       scores_ref, *, problem: Problem, splits: int, block_c: int):
  complete = (position_ref[0] + 1) // problem.block_size  # blocks c < complete are visible
  split = pl.program_id(2)
  rows = _cache_rows(group_ref)
  q = q_ref[...]

  def tile(i, carry):
    start = (split + i * splits) * block_c
    c_slice = pl.ds(start, block_c)
    qk = dot_nt(q, kc_ref[rows(c_slice)])
    visible = (start + jnp.arange(block_c, dtype=jnp.int32) < complete)[None, :]
    scores_ref[:, c_slice] = jnp.where(visible, qk * problem.score_scale, -jnp.inf)
    return softmax_step(carry, qk, vc_ref[rows(c_slice)], visible, problem.score_scale,
                        problem.interpret)

  carry = _strided_loop(cdiv(complete, block_c), split, splits, tile,
                        softmax_start(problem.group, vc_ref.shape[-1]))
  _write_partial(carry, o_ref, max_ref, sum_ref)


def _selected_window_kernel(group_ref, position_ref, idx_ref, count_ref, q_ref, k_ref, v_ref,
                            o_slc_ref, max_slc_ref, sum_slc_ref, o_swa_ref, max_swa_ref,
                            sum_swa_ref, *, problem: Problem, window_size: int, splits: int):
  position = position_ref[0]
  split = pl.program_id(2)
  size = problem.block_size
  rows = _cache_rows(group_ref)
  q = q_ref[...]

  def attend(carry, start, visible_C):
    keys = rows(pl.ds(start, size))
    return softmax_step(carry, dot_nt(q, k_ref[keys]), v_ref[keys], visible_C[None, :],
                        problem.score_scale, problem.interpret)

  def selected(i, carry):
    start = idx_ref[split + i * splits] * size
    return attend(carry, start, start + jnp.arange(size, dtype=jnp.int32) <= position)

  first_tile = jnp.maximum(position - window_size + 1, 0) // size

  def window(i, carry):
    start = (first_tile + split + i * splits) * size
    key_pos = start + jnp.arange(size, dtype=jnp.int32)
    return attend(carry, start, (key_pos <= position) & (key_pos > position - window_size))

  start_carry = softmax_start(problem.group, v_ref.shape[-1])
  _write_partial(_strided_loop(count_ref[0], split, splits, selected, start_carry),
                 o_slc_ref, max_slc_ref, sum_slc_ref)
  _write_partial(
      _strided_loop(position // size - first_tile + 1, split, splits, window, start_carry),
      o_swa_ref, max_swa_ref, sum_swa_ref)


def _merge_partials(acc_ref, max_ref, sum_ref, splits: int):
  """(o [G, Dv] float32, lse2 [G]) of a program's G rows from `splits` partial softmaxes in the
  exp2 domain (as `merge_splits`); a row that saw no key gets o = 0 and lse2 = -inf. One load per
  split: Pallas-Triton cannot slice a loaded value."""
  max_rows = [max_ref[split] for split in range(splits)]
  total_max_G = functools.reduce(jnp.maximum, max_rows)
  weights = [jnp.exp2(row - total_max_G) for row in max_rows]
  total_sum_G = sum(weight * sum_ref[split] for split, weight in enumerate(weights))
  acc_GV = sum(weight[:, None] * acc_ref[split] for split, weight in enumerate(weights))
  o_GV = acc_GV / jnp.where(total_sum_G > 0, total_sum_G, 1.0)[:, None]
  return o_GV, total_max_G + jnp.log2(total_sum_G)


def _select_kernel(position_ref, acc_ref, max_ref, sum_ref, scores_ref, o_ref, idx_ref,
                   count_ref, *, problem: Problem, splits: int):
  position = position_ref[0]
  o_GV, lse_G = _merge_partials(acc_ref, max_ref, sum_ref, splits)
  o_ref[...] = o_GV
  # reference.block_importance: the group's probabilities of complete earlier blocks, the group
  # size for the forced blocks (first, previous, current), -inf past the current block.
  current = position // problem.block_size
  num_padded = scores_ref.shape[-1]
  block_N = jnp.arange(num_padded, dtype=jnp.int32)
  probs_GN = jnp.where(block_N[None, :] < (position + 1) // problem.block_size,
                       jnp.exp2(scores_ref[...] - lse_G[:, None]), 0.0)
  forced_N = (block_N == 0) | (block_N == current - 1) | (block_N == current)
  importance_N = jnp.where(forced_N, float(problem.group), jnp.sum(probs_GN, axis=0))
  importance_N = jnp.where(block_N <= current, importance_N, -jnp.inf)
  # selection.select_top_blocks: the block_count largest, the lower block first among equal
  # ones, NO_BLOCK (-1) in the slots past the valid blocks.
  slot_S = jnp.arange(idx_ref.shape[-1], dtype=jnp.int32)
  indices_S = jnp.full(slot_S.shape, selection.NO_BLOCK, jnp.int32)
  for slot in range(problem.block_count):  # static: block_count top-1 rounds
    top = jnp.max(importance_N)
    block = jnp.min(jnp.where(importance_N == top, block_N, num_padded))
    indices_S = jnp.where(slot_S == slot,
                          jnp.where(top > -jnp.inf, block, selection.NO_BLOCK), indices_S)
    importance_N = jnp.where(block_N == block, -jnp.inf, importance_N)
  idx_ref[...] = indices_S
  count_ref[...] = jnp.sum((indices_S >= 0).astype(jnp.int32), keepdims=True)


def _partial_specs(problem: Problem, splits: int, batch: int, value_dim: int):
  """Out specs and shapes of one branch's split partials: acc [B, splits, Hq, Dv], max, sum."""
  group, num_q_heads = problem.group, problem.num_q_heads
  specs = [pl.BlockSpec((None, None, group, value_dim), lambda b, h, s: (b, s, h, 0)),
           pl.BlockSpec((None, None, group), lambda b, h, s: (b, s, h)),
           pl.BlockSpec((None, None, group), lambda b, h, s: (b, s, h))]
  shapes = [jax.ShapeDtypeStruct((batch, splits, num_q_heads, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits, num_q_heads), jnp.float32)]
  return specs, shapes


def _call(problem: Problem, blocks: NSABlockSizes, kernel, name: str, *, in_specs, out_specs,
          out_shape):
  """A pallas_call on the grid (batch row, KV head, split)."""
  batch = out_shape[0].shape[0]
  return pl.pallas_call(
      kernel, grid=(batch, problem.num_kv_heads, blocks.decode_splits), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(blocks.num_warps, blocks.num_stages),
      interpret=problem.interpret, name=name)


def _compressed_and_select(problem: Problem, blocks: NSABlockSizes, q_BHD, k_cmp_GBNKD,
                           v_cmp_GBNKD, position_B, group_1):
  """(o_cmp [B, Hq, Dv] float32, selected blocks int32 [B, Hkv, S] (S >= block_count, a power
  of two; NO_BLOCK past the valid ones), their counts int32 [B * Hkv])."""
  batch, num_q_heads, head_dim = q_BHD.shape
  group, num_blocks, value_dim = problem.group, k_cmp_GBNKD.shape[2], v_cmp_GBNKD.shape[-1]
  splits = blocks.decode_splits
  # Triton blocks are powers of two: the select kernel reads every head's scores of the group
  # in one block of the padded length (the first kernel leaves the padding unwritten; the
  # select kernel masks it with the blocks past the complete ones).
  padded_blocks = next_power_of_two(num_blocks)
  specs, shapes = _partial_specs(problem, splits, batch, value_dim)
  *partials, scores_BHN = _call(
      problem, blocks,
      functools.partial(_compressed_kernel, problem=problem, splits=splits,
                        block_c=blocks.cmp_keys),
      "nsa_decode_compressed",
      in_specs=[pl.no_block_spec, pl.BlockSpec((1,), lambda b, h, s: (b,)),
                pl.BlockSpec((None, group, head_dim), lambda b, h, s: (b, h, 0)),
                pl.no_block_spec, pl.no_block_spec],
      out_specs=specs + [pl.BlockSpec((None, group, padded_blocks), lambda b, h, s: (b, h, 0))],
      out_shape=shapes + [jax.ShapeDtypeStruct((batch, num_q_heads, padded_blocks),
                                               jnp.float32)],
  )(group_1, position_B, q_BHD, k_cmp_GBNKD, v_cmp_GBNKD)
  slots = next_power_of_two(problem.block_count, minimum=1)
  num_kv_heads = problem.num_kv_heads
  partial_in = [pl.BlockSpec((None, splits, group, value_dim), lambda b, h: (b, 0, h, 0)),
                pl.BlockSpec((None, splits, group), lambda b, h: (b, 0, h)),
                pl.BlockSpec((None, splits, group), lambda b, h: (b, 0, h))]
  return pl.pallas_call(
      functools.partial(_select_kernel, problem=problem, splits=splits),
      grid=(batch, num_kv_heads),
      in_specs=[pl.BlockSpec((1,), lambda b, h: (b,))] + partial_in + [
          pl.BlockSpec((None, group, padded_blocks), lambda b, h: (b, h, 0))],
      out_specs=[pl.BlockSpec((None, group, value_dim), lambda b, h: (b, h, 0)),
                 pl.BlockSpec((None, None, slots), lambda b, h: (b, h, 0)),
                 pl.BlockSpec((1,), lambda b, h: (b * num_kv_heads + h,))],
      out_shape=[jax.ShapeDtypeStruct((batch, num_q_heads, value_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, slots), jnp.int32),
                 jax.ShapeDtypeStruct((batch * num_kv_heads,), jnp.int32)],
      compiler_params=triton_compiler_params(blocks.num_warps, 1),
      interpret=problem.interpret, name="nsa_decode_select",
  )(position_B, *partials, scores_BHN)


def _selected_and_window(problem: Problem, blocks: NSABlockSizes, q_BHD, k_GBSKD, v_GBSKD,
                         indices_BKS, counts_BK, position_B, group_1, window_size: int):
  """(o_slc, o_swa) [B, Hq, Dv] float32, merged over the splits; counts_BK flat [B * Hkv]."""
  batch, _, head_dim = q_BHD.shape
  num_kv_heads, splits = problem.num_kv_heads, blocks.decode_splits
  specs, shapes = _partial_specs(problem, splits, batch, v_GBSKD.shape[-1])
  partials = _call(
      problem, blocks,
      functools.partial(_selected_window_kernel, problem=problem, window_size=window_size,
                        splits=splits),
      "nsa_decode_selected_window",
      in_specs=[pl.no_block_spec, pl.BlockSpec((1,), lambda b, h, s: (b,)),
                pl.BlockSpec((None, None, indices_BKS.shape[-1]), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((1,), lambda b, h, s: (b * num_kv_heads + h,)),
                pl.BlockSpec((None, problem.group, head_dim), lambda b, h, s: (b, h, 0)),
                pl.no_block_spec, pl.no_block_spec],
      out_specs=specs * 2, out_shape=shapes * 2,
  )(group_1, position_B, indices_BKS, counts_BK, q_BHD, k_GBSKD, v_GBSKD)
  return (merge_splits(*partials[:3], base2=True)[0],
          merge_splits(*partials[3:], base2=True)[0])


def decode_attention(q_BHD, gates_BH3, k_GBSKD, v_GBSKD, k_cmp_GBNKD, v_cmp_GBNKD, position_B,
                     group, *, block_size: int, block_count: int, window_size: int,
                     scale: float | None = None, block_sizes: NSABlockSizes = NSABlockSizes(),
                     interpret: bool | None = None):
  """Same contract as `reference.decode_attention`, for caches whose length is a multiple of
  block_size and compressed caches whose block count is a multiple of block_sizes.cmp_keys
  (`decode.compressed_blocks`)."""
  if interpret is None:
    interpret = interpret_mode()
  check_supported(q_BHD.shape[:1] + (1,) + q_BHD.shape[1:], v_GBSKD.shape[1:], q_BHD.dtype,
                  block_size=block_size, blocks=block_sizes, interpret=interpret)
  batch, num_q_heads, head_dim = q_BHD.shape
  cache_len, num_kv_heads = k_GBSKD.shape[2], k_GBSKD.shape[3]
  num_blocks = k_cmp_GBNKD.shape[2]
  if cache_len % block_size or num_blocks % block_sizes.cmp_keys:
    raise NotImplementedError(
        f"nsa_decode_attention[pallas]: cache length {cache_len} must be a multiple of"
        f" block_size {block_size} and compressed blocks {num_blocks} of"
        f" {block_sizes.cmp_keys} (decode.compressed_blocks)")
  if scale is None:
    scale = head_dim ** -0.5
  problem = Problem(
      query_len=1, key_len=cache_len, padded_query_len=1, padded_key_len=cache_len,
      num_blocks_padded=num_blocks, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim, block_size=block_size, block_count=block_count, scale=float(scale),
      interpret=interpret)
  position_B = position_B.astype(jnp.int32)
  group_1 = group_operand(group)
  o_cmp_BHD, indices_BKS, counts_BK = _compressed_and_select(
      problem, block_sizes, q_BHD, k_cmp_GBNKD, v_cmp_GBNKD, position_B, group_1)
  o_slc_BHD, o_swa_BHD = _selected_and_window(
      problem, block_sizes, q_BHD, k_GBSKD, v_GBSKD, indices_BKS, counts_BK, position_B,
      group_1, window_size)
  return reference.gated_sum(gates_BH3.astype(jnp.float32), o_cmp_BHD, o_slc_BHD,
                             o_swa_BHD).astype(q_BHD.dtype)
