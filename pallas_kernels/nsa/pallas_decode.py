"""`implementation="pallas"` of NSA decoding: one query per batch row against the caches.

    o_cmp, importance = compressed attention at each row's position  (pallas_compressed.forward)
    selection = top block_count of importance                        (XLA top_k, selection.py)
    o_slc, o_swa = selected blocks and the window, split-K           (the kernel below)
    o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa                      (XLA)

The compressed keys come from the compressed cache (a block is pooled once, when it completes),
so a step reads the complete blocks' means, the block_count selected blocks and the window, and
nothing else of the cache. The split-K kernel (grid: batch, KV head, split) gives each split every
`splits`-th selected block and window tile; its rows are the KV head's G query heads, so each
block is read once for the group. The splits' partial softmaxes are merged in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.nsa import pallas_compressed, reference, selection
from pallas_kernels.nsa.tiling import NSABlockSizes, Problem, check_supported
from pallas_kernels.pallas_common import (
    cdiv, dot_nt, interpret_mode, merge_splits, softmax_start, softmax_step,
    triton_compiler_params)

# The row maximum written for a split that saw no key: finite, so that merging gives it weight 0
# (exp2 of a very negative number) instead of NaN.
EMPTY_MAX = -1e30


def _decode_kernel(position_ref, idx_ref, count_ref, q_ref, k_ref, v_ref, o_slc_ref,
                   max_slc_ref, sum_slc_ref, o_swa_ref, max_swa_ref, sum_swa_ref, *,
                   problem: Problem, window_size: int, splits: int):
  position = position_ref[0]
  split = pl.program_id(2)
  size = problem.block_size
  q = q_ref[...]

  def attend(carry, start, visible_C):
    keys = pl.ds(start, size)
    return softmax_step(carry, dot_nt(q, k_ref[keys, :]), v_ref[keys, :], visible_C[None, :],
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
  num_window_tiles = position // size - first_tile + 1
  for fn, count, (o_ref, max_ref, sum_ref) in (
      (selected, count_ref[0], (o_slc_ref, max_slc_ref, sum_slc_ref)),
      (window, num_window_tiles, (o_swa_ref, max_swa_ref, sum_swa_ref))):
    acc, row_max, row_sum = lax.fori_loop(0, cdiv(jnp.maximum(count - split, 0), splits), fn,
                                          start_carry)
    o_ref[...] = acc
    max_ref[...] = jnp.where(row_sum > 0, row_max, EMPTY_MAX)
    sum_ref[...] = row_sum


def _selected_and_window(problem: Problem, blocks: NSABlockSizes, q_BHD, k_BSKD, v_BSKD,
                         indices_BKS, counts_BK, position_B, window_size: int):
  """(o_slc, o_swa) [B, Hq, Dv] float32, merged over the splits."""
  batch, num_q_heads, head_dim = q_BHD.shape
  group, value_dim, splits = problem.group, v_BSKD.shape[-1], blocks.decode_splits
  num_kv_heads = problem.num_kv_heads
  rows = pl.BlockSpec((None, group, head_dim), lambda b, h, s: (b, h, 0))
  keys = pl.BlockSpec((None, k_BSKD.shape[1], None, head_dim), lambda b, h, s: (b, 0, h, 0))
  partial_out = pl.BlockSpec((None, None, group, value_dim), lambda b, h, s: (b, s, h, 0))
  partial_stat = pl.BlockSpec((None, None, group), lambda b, h, s: (b, s, h))
  out_shape = jax.ShapeDtypeStruct((batch, splits, num_q_heads, value_dim), jnp.float32)
  stat_shape = jax.ShapeDtypeStruct((batch, splits, num_q_heads), jnp.float32)
  partials = pl.pallas_call(
      functools.partial(_decode_kernel, problem=problem, window_size=window_size, splits=splits),
      grid=(batch, num_kv_heads, splits),
      in_specs=[pl.BlockSpec((1,), lambda b, h, s: (b,)),
                pl.BlockSpec((None, None, indices_BKS.shape[-1]), lambda b, h, s: (b, h, 0)),
                pl.BlockSpec((1,), lambda b, h, s: (b * num_kv_heads + h,)),
                rows, keys, keys],
      out_specs=[partial_out, partial_stat, partial_stat] * 2,
      out_shape=[out_shape, stat_shape, stat_shape] * 2,
      compiler_params=triton_compiler_params(blocks.num_warps, blocks.num_stages),
      interpret=problem.interpret, name="nsa_decode_selected_window",
  )(position_B, indices_BKS, counts_BK.reshape(-1), q_BHD, k_BSKD, v_BSKD)
  return merge_splits(*partials[:3], jnp.exp2), merge_splits(*partials[3:], jnp.exp2)


def decode_attention(q_BHD, gates_BH3, k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD, position_B, *,
                     block_size: int, block_count: int, window_size: int,
                     scale: float | None = None, block_sizes: NSABlockSizes = NSABlockSizes(),
                     interpret: bool | None = None):
  """Same contract as `reference.decode_attention`, for caches whose length is a multiple of
  block_size and compressed caches whose block count is a multiple of block_sizes.cmp_keys
  (`decode.compressed_blocks`)."""
  if interpret is None:
    interpret = interpret_mode()
  check_supported(q_BHD.shape[:1] + (1,) + q_BHD.shape[1:], v_BSKD.shape, q_BHD.dtype,
                  block_size=block_size, blocks=block_sizes, interpret=interpret)
  batch, num_q_heads, head_dim = q_BHD.shape
  cache_len, num_kv_heads = k_BSKD.shape[1], k_BSKD.shape[2]
  num_blocks = k_cmp_BNKD.shape[1]
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
  o_cmp_B1HD, _, importance_B1KN = pallas_compressed.forward(
      problem, block_sizes, q_BHD[:, None], k_cmp_BNKD, v_cmp_BNKD, position_B)
  indices_B1KS, counts_B1K = selection.select_top_blocks(importance_B1KN, block_count)
  o_slc_BHD, o_swa_BHD = _selected_and_window(
      problem, block_sizes, q_BHD, k_BSKD, v_BSKD, indices_B1KS[:, 0], counts_B1K[:, 0],
      position_B, window_size)
  return reference.gated_sum(gates_BH3.astype(jnp.float32),
                             o_cmp_B1HD[:, 0].astype(jnp.float32), o_slc_BHD,
                             o_swa_BHD).astype(q_BHD.dtype)
