"""Decode attention in Pallas (Triton backend): split-K flash-decoding over the cache slots.

Grid (B, Hkv / heads per program, splits): one program reads one contiguous range of slots of
its KV heads (one by default) once, for all G = Hq / Hkv query heads of each head together (rows
padded to 16 for tl.dot), so K and V are read from memory exactly once per step: the op is bandwidth-bound and that is the point. With
one split the program normalises and writes the output itself; with several, each writes its
unnormalised partial output and softmax statistics (float32) and a small XLA step combines them.

Visibility follows `reference`: slot n < length[b, h] and key_valid[b, (h,) n]. Loads of slots
that are not visible are masked, so invisible slots may hold anything (NaN included) and slots
past a row's length cost no memory traffic.

The cache arrives stacked over layer groups, [G, B, N, Hkv, D], with the group index as an int32
[1] operand: programs read group g's slots straight from the stacked buffer (no copy of the
group's slice is made for the call).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.pallas_common import (
    MIN_DOT_DIM, interpret_mode, is_power_of_two, merge_splits, triton_compiler_params,
    triton_dot)
from pallas_kernels.stacked import group_operand

# Running max before any visible slot: finite, so exp(m_old - m_new) stays 1 instead of NaN while
# a program has seen only masked slots, and exp(-inf - m) = 0 for the masked scores.
EMPTY_MAX = -1e30


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
  """Tiling of the slot axis. None fields are chosen per call (`slots_and_splits`)."""
  # block_slots None: 128 slots per step when the grid fits on the GPU at 2 programs per SM (a
  # 128-slot, 3-stage program holds 96 KiB of shared memory), else 64 (4 per SM). 2026-11-23, one
  # H100, B32, GPU kernel time from profiler traces (docs/benchmarks.md): lalte-1.4b (256
  # programs) 34.0 us at 128 slots against 37.0 at 64 with 2 splits (the earlier default); lalte-0.4b
  # (512 programs) 62.1 us at 64 slots against 68.2 at 128, whose 512 programs need two waves.
  block_slots: int | None = None
  num_splits: int | None = None  # None: enough programs to reach target_programs
  num_warps: int = 4
  num_stages: int = 3
  # B32 gives one split at both model caches (256 programs at Hkv 8, 512 at Hkv 16); a small batch
  # splits the slots (each split one more partial softmax for the combine step).
  target_programs: int = 256
  # KV heads read by one program (each step loads this many heads' rows of the same slots, i.e.
  # one contiguous [block_slots, heads, D] slab when it is Hkv, instead of 128-byte rows strided by
  # Hkv * D). Reduced to the largest divisor of Hkv not above it.
  kv_heads_per_program: int = 1

  def __post_init__(self):
    if self.block_slots is not None and (self.block_slots < MIN_DOT_DIM
                                         or self.block_slots & (self.block_slots - 1)):
      raise ValueError(f"DecodeBlockSizes.block_slots must be None or a power of two >="
                       f" {MIN_DOT_DIM}, got {self.block_slots}")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"DecodeBlockSizes.num_splits must be >= 1 or None, got {self.num_splits}")
    for name in ("num_warps", "num_stages", "target_programs", "kv_heads_per_program"):
      if getattr(self, name) < 1:
        raise ValueError(f"DecodeBlockSizes.{name} must be >= 1, got {getattr(self, name)}")

  def heads_per_program(self, num_kv_heads: int) -> int:
    heads = min(self.kv_heads_per_program, num_kv_heads)
    while num_kv_heads % heads:
      heads -= 1
    return heads

  def slots_and_splits(self, batch: int, num_kv_heads: int, num_slots: int,
                       num_cores: int = 132) -> tuple[int, int]:
    """(slots per step, splits of the slot axis) for one call on a GPU of num_cores SMs."""
    head_programs = num_kv_heads // self.heads_per_program(num_kv_heads)

    def splits(block_slots):
      blocks = pl.cdiv(num_slots, block_slots)
      if self.num_splits is not None:
        return min(self.num_splits, blocks)
      return max(1, min(blocks, pl.cdiv(self.target_programs, batch * head_programs)))

    if self.block_slots is not None:
      return self.block_slots, splits(self.block_slots)
    fits_at_two_per_core = batch * head_programs * splits(128) <= 2 * num_cores
    block_slots = 128 if fits_at_two_per_core else 64
    return block_slots, splits(block_slots)


def _num_cores() -> int:
  """SMs of the default GPU (132 on H100/H200 SXM when unknown, e.g. in interpret mode)."""
  return getattr(jax.devices()[0], "core_count", None) or 132


def _check_supported(q_BHD, k_GBNKD, v_GBNKD):
  head_dim, value_dim = k_GBNKD.shape[-1], v_GBNKD.shape[-1]
  for name, dim in (("head dim", head_dim), ("value dim", value_dim)):
    if not is_power_of_two(dim) or dim < MIN_DOT_DIM:
      raise NotImplementedError(
          f"decode_attention[pallas]: {name} {dim} must be a power of two >= {MIN_DOT_DIM}"
          " (Triton block shapes and tl.dot)")
  if q_BHD.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise NotImplementedError(
        f"decode_attention[pallas]: dtype {q_BHD.dtype} is not supported (bf16, f16, f32)")


def _decode_kernel(*refs, has_valid, valid_per_head, group, group_pad, heads_per_program,
                   block_slots, blocks_per_split, scale, final, precision):
  if has_valid:
    group_ref, q_ref, k_ref, v_ref, length_ref, valid_ref, *out_refs = refs
  else:
    (group_ref, q_ref, k_ref, v_ref, length_ref, *out_refs), valid_ref = refs, None
  row, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer_group = group_ref[0]
  head_dim, value_dim = q_ref.shape[-1], v_ref.shape[-1]
  kv_heads = [head_block * heads_per_program + j for j in range(heads_per_program)]

  # The G query heads of a KV head are consecutive: rows [kv_head * G, kv_head * G + G).
  row_ok_G = jnp.arange(group_pad) < group
  q_GD = [plgpu.load(q_ref.at[row, pl.ds(kv_head * group, group_pad), :],
                     mask=jnp.broadcast_to(row_ok_G[:, None], (group_pad, head_dim)), other=0.0)
          for kv_head in kv_heads]
  lengths = [length_ref[row, kv_head] for kv_head in kv_heads]

  def attend(carry, q_GD, k_ND, v_NV, visible_N):
    max_G, sum_G, acc_GV = carry
    scores_GN = triton_dot(q_GD, k_ND, trans_b=True, precision=precision) * scale
    scores_GN = jnp.where(visible_N[None, :], scores_GN, -jnp.inf)
    new_max_G = jnp.maximum(max_G, jnp.max(scores_GN, axis=1))
    rescale_G = jnp.exp(max_G - new_max_G)
    probs_GN = jnp.exp(scores_GN - new_max_G[:, None])
    sum_G = sum_G * rescale_G + jnp.sum(probs_GN, axis=1)
    acc_GV = acc_GV * rescale_G[:, None] + triton_dot(probs_GN.astype(v_NV.dtype), v_NV,
                                                precision=precision)
    return new_max_G, sum_G, acc_GV

  def body(i, carries):
    start = (split * blocks_per_split + i) * block_slots
    slot_N = start + jnp.arange(block_slots)
    shared_flag_N = None
    if has_valid and not valid_per_head:
      # Lengths are clamped to N, so the longest one bounds the load.
      shared_flag_N = plgpu.load(valid_ref.at[row, pl.ds(start, block_slots)],
                                 mask=slot_N < functools.reduce(jnp.maximum, lengths), other=0)
    # All heads' loads are issued before any math: together they cover whole slot rows.
    loaded = []
    for kv_head, length in zip(kv_heads, lengths):
      visible_N = slot_N < length
      if has_valid:
        if valid_per_head:
          flag_N = plgpu.load(valid_ref.at[row, kv_head, pl.ds(start, block_slots)],
                              mask=visible_N, other=0)
        else:
          flag_N = shared_flag_N
        visible_N = visible_N & (flag_N != 0)
      k_ND = plgpu.load(k_ref.at[layer_group, row, pl.ds(start, block_slots), kv_head, :],
                        mask=jnp.broadcast_to(visible_N[:, None], (block_slots, head_dim)),
                        other=0.0)
      v_NV = plgpu.load(v_ref.at[layer_group, row, pl.ds(start, block_slots), kv_head, :],
                        mask=jnp.broadcast_to(visible_N[:, None], (block_slots, value_dim)),
                        other=0.0)
      loaded.append((k_ND, v_NV, visible_N))
    return tuple(attend(carry, q, k_ND, v_NV, visible_N)
                 for carry, q, (k_ND, v_NV, visible_N) in zip(carries, q_GD, loaded))

  init = (jnp.full((group_pad,), EMPTY_MAX, jnp.float32), jnp.zeros((group_pad,), jnp.float32),
          jnp.zeros((group_pad, value_dim), jnp.float32))
  carries = jax.lax.fori_loop(0, blocks_per_split, body, (init,) * heads_per_program)

  out_mask_GV = jnp.broadcast_to(row_ok_G[:, None], (group_pad, value_dim))
  for kv_head, (max_G, sum_G, acc_GV) in zip(kv_heads, carries):
    first_head = kv_head * group
    if final:
      (o_ref,) = out_refs
      out_GV = acc_GV / jnp.where(sum_G > 0, sum_G, 1.0)[:, None]
      plgpu.store(o_ref.at[row, pl.ds(first_head, group_pad), :], out_GV.astype(o_ref.dtype),
                  mask=out_mask_GV)
    else:
      o_ref, max_ref, sum_ref = out_refs
      plgpu.store(o_ref.at[row, split, pl.ds(first_head, group_pad), :], acc_GV,
                  mask=out_mask_GV)
      plgpu.store(max_ref.at[row, split, pl.ds(first_head, group_pad)], max_G, mask=row_ok_G)
      plgpu.store(sum_ref.at[row, split, pl.ds(first_head, group_pad)], sum_G, mask=row_ok_G)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes"))
def decode_attention(q_BHD, k_GBNKD, v_GBNKD, layer_group, *, scale: float, length_BK=None,
                     key_valid=None, block_sizes: DecodeBlockSizes = DecodeBlockSizes()):
  """Same contract as `reference.decode_attention`; interpret mode off GPU."""
  _check_supported(q_BHD, k_GBNKD, v_GBNKD)
  batch, num_q_heads, _ = q_BHD.shape
  num_slots, num_kv_heads = k_GBNKD.shape[2], k_GBNKD.shape[3]
  value_dim = v_GBNKD.shape[-1]
  group = num_q_heads // num_kv_heads
  group_pad = max(MIN_DOT_DIM, pl.next_power_of_2(group))
  heads_per_program = block_sizes.heads_per_program(num_kv_heads)
  block_slots, splits = block_sizes.slots_and_splits(batch, num_kv_heads, num_slots, _num_cores())
  blocks_per_split = pl.cdiv(pl.cdiv(num_slots, block_slots), splits)

  # Clamping to N makes `slot < length` the only bounds check the kernel needs.
  if length_BK is None:
    length_BK = jnp.full((batch, num_kv_heads), num_slots, jnp.int32)
  length_BK = jnp.clip(length_BK.astype(jnp.int32), 0, num_slots)
  operands = [group_operand(layer_group), q_BHD, k_GBNKD, v_GBNKD, length_BK]
  if key_valid is not None:
    operands.append(key_valid.astype(jnp.int8))  # Triton loads bytes, not i1

  if q_BHD.dtype == jnp.float32:
    precision = jax.lax.Precision.HIGHEST  # no TF32: float32 callers get float32 accuracy
  else:
    precision = None
  final = splits == 1
  if final:
    out_shape = jax.ShapeDtypeStruct((batch, num_q_heads, value_dim), q_BHD.dtype)
  else:
    out_shape = (jax.ShapeDtypeStruct((batch, splits, num_q_heads, value_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, splits, num_q_heads), jnp.float32),
                 jax.ShapeDtypeStruct((batch, splits, num_q_heads), jnp.float32))
  kernel = functools.partial(
      _decode_kernel, has_valid=key_valid is not None,
      valid_per_head=key_valid is not None and key_valid.ndim == 3, group=group,
      group_pad=group_pad, heads_per_program=heads_per_program,
      block_slots=block_slots,
      blocks_per_split=blocks_per_split, scale=float(scale), final=final, precision=precision)
  result = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(batch, num_kv_heads // heads_per_program, splits),
      compiler_params=triton_compiler_params(block_sizes.num_warps, block_sizes.num_stages),
      interpret=interpret_mode(),
      name="decode_attention",
  )(*operands)
  if final:
    return result
  return merge_splits(*result, base2=False)[0].astype(q_BHD.dtype)
