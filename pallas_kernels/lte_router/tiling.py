"""What the LTE router's kernels share: tile sizes, the shifted-row loads ('same' zero padding),
the dropout bits (hashed in the kernel or unpacked from packed words), the block specs and the
launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lte_router import counter_hash
from pallas_kernels.pallas_common import interpret_mode, kernel_dot, triton_compiler_params

# Tile sizes: the fastest of a sweep of the router's conv kernels at lalte-0.4b's shapes (B4 T4096)
# on one H200, 2026-11-29 (BLOCK_T 64 / 128 / 256, 2 / 4 / 8 warps).
BLOCK_T = 128  # output rows per program of the convolution kernels
CHUNK = 1024  # tokens per program of the weight-gradient kernel
MAX_ACCUMULATOR = 8192  # float32 elements of a weight-gradient program's [C block, O] sum
# The first layer's weight-gradient program sums its key and value channels whole: [2D, O].
FIRST_LAYER_MAX_ACCUMULATOR = 16384
NUM_WARPS = 4


def rows(ref, first_row, offset, length):
  """Rows first_row + offset + [0, BLOCK_T) of a [T, C] ref; rows outside [0, T) are zeros.

  On the GPU a masked load of the contiguous rows (it may start before row 0); interpret mode
  cannot take a negative start, so there the rows are gathered at clipped indices and masked."""
  start = first_row + offset
  rows_R = start + jnp.arange(BLOCK_T, dtype=jnp.int32)
  valid_R1 = ((rows_R >= 0) & (rows_R < length))[:, None]
  if not interpret_mode():
    return pltriton.load(ref.at[pl.ds(start, BLOCK_T), :], mask=valid_R1, other=0.0)
  x_RC = ref[jnp.clip(rows_R, 0, length - 1), :]
  return jnp.where(valid_R1, x_RC, jnp.zeros_like(x_RC))


def keep(seed_ref, first_row, width, *, length, rate):
  """bool [BLOCK_T, width]: counter_hash.keep_mask's bits for the program's rows of (head, row),
  heads-first layout (token (row_offset + b) * T + t, unit head * width + channel); seed_ref
  holds the seed words and the row offset."""
  head, row = pl.program_id(0), pl.program_id(1)
  global_row = row.astype(jnp.uint32) + seed_ref[2]
  token_R1 = (global_row * jnp.uint32(length)
              + (first_row + jnp.arange(BLOCK_T, dtype=jnp.int32)).astype(jnp.uint32))[:, None]
  unit_1C = (head * width + jnp.arange(width, dtype=jnp.int32)).astype(jnp.uint32)[None, :]
  token_hash_R1 = counter_hash.mix32(token_R1 ^ seed_ref[0]) ^ seed_ref[1]
  bits_RC = counter_hash.mix32(token_hash_R1 + unit_1C * counter_hash.GOLDEN)
  return bits_RC >= counter_hash.keep_threshold(rate)


def conv_sum(x_ref, w_ref, first_row, offsets, length, transpose_taps=False):
  """float32 [BLOCK_T, O] (or [BLOCK_T, C] with transpose_taps): sum_i x[t + offset_i] W_i."""
  exact = x_ref.dtype == jnp.float32
  acc = None
  for i, offset in enumerate(offsets):
    term = kernel_dot(rows(x_ref, first_row, offset, length), w_ref[i], exact=exact,
                      trans_b=transpose_taps)
    acc = term if acc is None else acc + term
  return acc


def silu_grad(pre):
  sig = jax.nn.sigmoid(pre)
  return sig * (1.0 + pre * (1.0 - sig))


def first_layer_rows(kv_ref, words_ref, first_row, offset, channel_offset, *, length, rate):
  """The first layer's dropped input at rows first_row + offset + [0, BLOCK_T), channels
  [channel_offset, channel_offset + D) of concat(k, v), from one of k, v ([T, D] of the
  (row, head)) and the packed keep bits ([T, 2D / 32] uint32; None: no dropout)."""
  x_RD = rows(kv_ref, first_row, offset, length)
  if words_ref is None:
    return x_RD
  return apply_bits(x_RD, words_ref, first_row + offset, channel_offset, length=length,
                     rate=rate)


def apply_bits(x_RD, words_ref, start, channel_offset, *, length, rate):
  """x with dropout applied from the packed keep bits of rows start + [0, BLOCK_T)."""
  rows_R1 = jnp.clip(start + jnp.arange(BLOCK_T, dtype=jnp.int32), 0, length - 1)[:, None]
  channel_1D = channel_offset + jnp.arange(x_RD.shape[1], dtype=jnp.int32)[None, :]
  words_RD = words_ref[rows_R1, channel_1D // 32]
  keep_RD = ((words_RD >> (channel_1D % 32).astype(jnp.uint32)) & jnp.uint32(1)) == 1
  return jnp.where(keep_RD, (x_RD.astype(jnp.float32) / (1.0 - rate)).astype(x_RD.dtype),
                   jnp.zeros_like(x_RD))


def kv_row_spec(length, head_dim, row_axis=1):
  """[T, D] of (row, head) from a [B, T, Hkv, D] array; grid (head, ...) with the row at
  grid axis row_axis."""
  return pl.BlockSpec((None, length, None, head_dim),
                      lambda *grid: (grid[row_axis], 0, grid[0], 0))


def words_spec(length, words, row_axis=1):
  """[T, W] of (head, row) from the packed keep bits [Hkv, B, T, W]."""
  return pl.BlockSpec((None, None, length, words), lambda *grid: (grid[0], grid[row_axis], 0, 0))


def row_spec(length, width):
  return pl.BlockSpec((None, None, length, width), lambda k, b, j: (k, b, 0, 0))


def tile_spec(width):
  return pl.BlockSpec((None, None, BLOCK_T, width), lambda k, b, j: (k, b, j, 0))


SEED_SPEC = pl.BlockSpec((4,), lambda k, b, j: (0,))  # seed words, row offset, unused


def call(kernel, name, grid, in_specs, out_specs, out_shape, *inputs):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(NUM_WARPS, 2), interpret=interpret_mode(),
      name=name)(*inputs)


def offsets(taps: int, dilation: int) -> tuple[int, ...]:
  half = (taps // 2) * dilation
  return tuple(i * dilation - half for i in range(taps))


def tap_offset(tap_offsets: tuple[int, ...], tap):
  """int32: the offset of tap `tap`, a grid index (so not a Python int) of a kernel."""
  offset = jnp.int32(tap_offsets[0])
  for i in range(1, len(tap_offsets)):
    offset = jnp.where(tap == i, jnp.int32(tap_offsets[i]), offset)
  return offset
