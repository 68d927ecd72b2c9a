"""`implementation="pallas"` of `short_conv_silu`: the convolution and its SiLU fused (Triton
backend), one kernel forward and two backward.

Forward, grid (B, T / block_t, C / block_c): a program reads its rows at the K tap offsets (K
shifted tiles of one [T, block_c] column strip; the overlap comes from L1/L2) and writes
SiLU(sum_i w_i x_{t-K+1+i}). Nothing but x is kept for the backward.

Backward, two kernels:
- `short_conv_dpre_dw`, grid (B, T / (block_t_dw * dw_steps), C / block_c_dw): each program walks
  `dw_steps` row tiles; per tile it reads x at the K offsets t-K+1 .. t and dy at t, recomputes
  the pre-activation, writes dpre = dy * SiLU'(pre) (in x's dtype) and adds x_{t-K+1+i} * dpre_t
  to K float32 accumulator tiles, summed over rows once at the end: each program writes a
  [K, block_c_dw] partial weight gradient, which XLA adds up (a few MB);
- `short_conv_dx`, the forward's grid: dx_t = sum_s w_{K-1-s} dpre_{t+s} (output t+s reads x_t
  through tap K-1-s), dpre read at the K offsets t .. t+K-1.
One kernel computing dx from x and dy directly (dpre recomputed at the K rows each x_t feeds:
2K-1 reads of x and K of dy per tile) measured slower than XLA; the two kernels take about half of
XLA's backward time (docs/benchmarks.md, section 5).

Rows are read through clamped row indices and zeroed outside [0, T) instead of shifted slices, so
that the first tile's rows before the sequence read as zeros (the conv's zero padding) on the GPU
and in interpret mode alike. T is padded at the end to whole tiles (a copy only for such lengths;
the zeros there add nothing, as dy is zero there too).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.pallas_common import (
    cdiv, check_launch_fields, interpret_mode, is_power_of_two, next_power_of_two, round_up,
    triton_compiler_params)

__all__ = ["ShortConvBlocks", "short_conv_silu"]

# A column strip narrower than this is not worth a kernel (Triton wants power-of-two tiles).
MIN_BLOCK_C = 8


@dataclasses.dataclass(frozen=True)
class ShortConvBlocks:
  """Tiles (powers of two) and launch parameters of the kernels.

  Defaults: the fastest candidates of `tools/bench_short_conv.py --sweep` (B8 T4096, C 1024 and
  2048, bf16, GPU kernel time, one H200, 2026-11-30): forward 59.9 / 113.6 us at 128 rows and 8
  warps against 69.9 / 133.4 at 64 and 4; backward 152.0 / 287.9 us at 8-row steps, 32 a program,
  against 156.5 / 300.2 at 16 and 16 (XLA: 67.2 / 132.4 and 288.8 / 561.7).
  """
  block_t: int = 128  # forward and dx: rows per program
  block_c: int = 128  # forward and dx: channels per program
  num_warps: int = 8
  block_t_dw: int = 8  # dpre/dw: rows per loop step
  block_c_dw: int = 64  # dpre/dw: channels per program
  dw_steps: int = 32  # dpre/dw: row tiles per program (the weight-gradient partials shrink by it)
  num_warps_dw: int = 4

  def __post_init__(self):
    check_launch_fields(self, power_of_two=lambda name: name.startswith("block"))


def _channel_block(channels: int, wanted: int) -> int:
  """The largest power of two <= wanted that divides C."""
  block = wanted
  while channels % block:
    block //= 2
  if block < MIN_BLOCK_C:
    raise NotImplementedError(f"short_conv_silu (pallas): {channels} channels have no power-of-two"
                              f" tile of at least {MIN_BLOCK_C}")
  return block


def _rows(ref, first_row, size: int):
  """Rows first_row .. first_row + size - 1 of a [rows, channels] ref in float32, zeros outside
  the ref's rows."""
  count = ref.shape[0]
  row_R = first_row + jnp.arange(size, dtype=jnp.int32)
  inside_R = (row_R >= 0) & (row_R < count)
  tile_RC = ref[jnp.clip(row_R, 0, count - 1), :]
  return jnp.where(inside_R[:, None], tile_RC.astype(jnp.float32), 0.0)


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _forward_kernel(x_ref, w_ref, y_ref, *, taps: int, block_t: int):
  # x_ref: [Tp, block_c] (one row's column strip), w_ref: [K, block_c], y_ref: [block_t, block_c].
  t0 = pl.program_id(1) * block_t
  pre_RC = jnp.zeros(y_ref.shape, jnp.float32)
  for i in range(taps):
    pre_RC += _rows(x_ref, t0 + i - (taps - 1), block_t) * w_ref[i, :].astype(jnp.float32)[None]
  y_ref[...] = (pre_RC * _sigmoid(pre_RC)).astype(y_ref.dtype)


def _dpre_dw_kernel(x_ref, w_ref, dy_ref, dpre_ref, dw_ref, *, taps: int, block_t: int,
                    steps: int):
  # x_ref, dy_ref: [Tp, block_c]; dpre_ref: [block_t * steps, block_c]; dw_ref: [K, block_c].
  w_1C = [w_ref[i, :].astype(jnp.float32)[None] for i in range(taps)]
  first = pl.program_id(1) * block_t * steps

  def tile(j, dw_RC):
    t0 = first + j * block_t
    xs = [_rows(x_ref, t0 + i - (taps - 1), block_t) for i in range(taps)]
    pre_RC = sum(w_1C[i] * xs[i] for i in range(taps))
    sig_RC = _sigmoid(pre_RC)
    dy_RC = dy_ref[pl.ds(t0, block_t), :].astype(jnp.float32)
    dpre_RC = dy_RC * sig_RC * (1.0 + pre_RC * (1.0 - sig_RC))
    dpre_ref[pl.ds(j * block_t, block_t), :] = dpre_RC.astype(dpre_ref.dtype)
    # Row sums once at the end, not per tile: a per-tile sum measured 1.45x the kernel's time.
    return tuple(acc + xs[i] * dpre_RC for i, acc in enumerate(dw_RC))

  init = tuple(jnp.zeros((block_t, x_ref.shape[1]), jnp.float32) for _ in range(taps))
  dw_RC = jax.lax.fori_loop(0, steps, tile, init)
  for i in range(taps):
    dw_ref[i, :] = jnp.sum(dw_RC[i], axis=0)


def _dx_kernel(dpre_ref, w_ref, dx_ref, *, taps: int, block_t: int):
  # dpre_ref: [Tp, block_c] (one row's strip), w_ref: [K, block_c], dx_ref: [block_t, block_c].
  t0 = pl.program_id(1) * block_t
  dx_RC = jnp.zeros(dx_ref.shape, jnp.float32)
  for shift in range(taps):
    dx_RC += (_rows(dpre_ref, t0 + shift, block_t)
              * w_ref[taps - 1 - shift, :].astype(jnp.float32)[None])
  dx_ref[...] = dx_RC.astype(dx_ref.dtype)


def _pad_rows(x_BTC, padded: int):
  length = x_BTC.shape[1]
  return x_BTC if padded == length else jnp.pad(x_BTC, ((0, 0), (0, padded - length), (0, 0)))


def _shifted_sum(name: str, kernel, x_BTC, weight_KC, blocks: ShortConvBlocks):
  """A kernel over the forward's grid that reads rows of one [T, block_c] strip of x at the K
  tap offsets and writes one [block_t, block_c] tile: the forward, and dx from dpre."""
  batch, length, channels = x_BTC.shape
  taps = weight_KC.shape[0]
  block_t = min(blocks.block_t, next_power_of_two(length, 8))
  block_c = _channel_block(channels, blocks.block_c)
  padded = round_up(length, block_t)
  out_BTC = pl.pallas_call(
      functools.partial(kernel, taps=taps, block_t=block_t),
      grid=(batch, padded // block_t, channels // block_c),
      in_specs=[pl.BlockSpec((None, padded, block_c), lambda b, t, c: (b, 0, c)),
                pl.BlockSpec((taps, block_c), lambda b, t, c: (0, c))],
      out_specs=pl.BlockSpec((None, block_t, block_c), lambda b, t, c: (b, t, c)),
      out_shape=jax.ShapeDtypeStruct((batch, padded, channels), x_BTC.dtype),
      compiler_params=triton_compiler_params(blocks.num_warps, 1),
      interpret=interpret_mode(),
      name=name,
  )(_pad_rows(x_BTC, padded), weight_KC)
  return out_BTC[:, :length]


def _forward(x_BTC, weight_CK, blocks: ShortConvBlocks):
  return _shifted_sum("short_conv_fwd", _forward_kernel, x_BTC, weight_CK.astype(x_BTC.dtype).T,
                      blocks)


def _backward(x_BTC, weight_CK, dy_BTC, blocks: ShortConvBlocks):
  batch, length, channels = x_BTC.shape
  taps = weight_CK.shape[1]
  block_t = min(blocks.block_t_dw, next_power_of_two(length, 8))
  steps = max(1, min(blocks.dw_steps, cdiv(length, block_t)))
  block_c = _channel_block(channels, blocks.block_c_dw)
  rows_per_program = block_t * steps
  padded = round_up(length, rows_per_program)
  num_programs_t = padded // rows_per_program
  weight_KC = weight_CK.astype(x_BTC.dtype).T
  strip = pl.BlockSpec((None, padded, block_c), lambda b, t, c: (b, 0, c))
  dpre_BTC, dw_partial_BNKC = pl.pallas_call(
      functools.partial(_dpre_dw_kernel, taps=taps, block_t=block_t, steps=steps),
      grid=(batch, num_programs_t, channels // block_c),
      in_specs=[strip, pl.BlockSpec((taps, block_c), lambda b, t, c: (0, c)), strip],
      out_specs=[pl.BlockSpec((None, rows_per_program, block_c), lambda b, t, c: (b, t, c)),
                 pl.BlockSpec((None, None, taps, block_c), lambda b, t, c: (b, t, 0, c))],
      out_shape=[jax.ShapeDtypeStruct((batch, padded, channels), x_BTC.dtype),
                 jax.ShapeDtypeStruct((batch, num_programs_t, taps, channels), jnp.float32)],
      compiler_params=triton_compiler_params(blocks.num_warps_dw, 1),
      interpret=interpret_mode(),
      name="short_conv_dpre_dw",
  )(_pad_rows(x_BTC, padded), weight_KC, _pad_rows(dy_BTC.astype(x_BTC.dtype), padded))
  # The padded rows' dpre are zeros (dy is zero there), so the padded dpre goes in as it is.
  dx_BTC = _shifted_sum("short_conv_dx", _dx_kernel, dpre_BTC, weight_KC, blocks)[:, :length]
  dw_CK = jnp.sum(dw_partial_BNKC, axis=(0, 1)).T.astype(weight_CK.dtype)
  return dx_BTC, dw_CK


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _conv_silu(x_BTC, weight_CK, blocks):
  return _forward(x_BTC, weight_CK, blocks)


def _conv_silu_fwd(x_BTC, weight_CK, blocks):
  return _forward(x_BTC, weight_CK, blocks), (x_BTC, weight_CK)


def _conv_silu_bwd(blocks, residuals, dy_BTC):
  x_BTC, weight_CK = residuals
  return _backward(x_BTC, weight_CK, dy_BTC, blocks)


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def short_conv_silu(x_BTC: jax.Array, weight_CK: jax.Array, state_BKC: jax.Array | None = None,
                    *, blocks: ShortConvBlocks = ShortConvBlocks()) -> jax.Array:
  """See `pallas_kernels.short_conv.short_conv_silu`; from a zero state only."""
  if state_BKC is not None:
    raise NotImplementedError("short_conv_silu (pallas): no state (training and whole prompts);"
                              " a call that continues a state runs on XLA")
  if not is_power_of_two(weight_CK.shape[1]):
    raise NotImplementedError(f"short_conv_silu (pallas): {weight_CK.shape[1]} taps; the weight"
                              " gradient's tile needs a power of two")
  _channel_block(x_BTC.shape[2], 1 << 30)  # refuses at trace time, before any launch
  return _conv_silu(x_BTC, weight_CK, blocks)
