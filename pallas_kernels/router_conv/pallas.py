"""One router conv layer, silu(conv(dropout(x)) + bias), forward and backward in Pallas (Triton).

XLA computes the layer as separate passes over HBM: the dropout's select, one batched matmul that
writes every tap's output ([K, B, T, taps, O]), the shifted sum, the bias and the SiLU; its
backward transposes each. Here one program per (head, row, block of BLOCK_T tokens) loads the
block's input rows at each tap's offset (the input padded once with a halo of zeros), redraws the
dropout mask from the counter hash (pallas_kernels/counter_hash.py: the same bits as the XLA
version), and accumulates the taps' dots in float32 before the bias and the SiLU.

The backward kernel recomputes, for each tap i, the pre-activations of the outputs that read the
block's inputs through tap i (rows t - offset_i, from the input at offsets up to twice the
halo), multiplies the output gradient by the SiLU's derivative there, and accumulates
dx += dpre W_i^T; it also writes the pre-activation gradient at the block's own rows, from which
XLA takes the weight and bias gradients (a reduction over B x T per head, which a matmul does
well).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import counter_hash
from pallas_kernels.router_conv import reference
from pallas_kernels.pallas_common import (MIN_DOT_DIM, cdiv, dot_nn, dot_nt, interpret_mode,
                                          is_power_of_two, triton_compiler_params)

BLOCK_T = 64
NUM_WARPS = 4


def _tileable(width: int) -> bool:
  return width >= MIN_DOT_DIM and is_power_of_two(width)


def handles(channels: int, c_out: int) -> bool:
  """Whether the kernels tile these channel widths (powers of two >= MIN_DOT_DIM)."""
  return _tileable(channels) and _tileable(c_out)


def check_shapes(x_KBTC: jax.Array, weight_KICO: jax.Array) -> None:
  """NotImplementedError for channel widths the kernels do not tile."""
  channels, c_out = weight_KICO.shape[2], weight_KICO.shape[3]
  for name, width in (("input channels", channels), ("output channels", c_out)):
    if not _tileable(width):
      raise NotImplementedError(f"router_conv pallas: {name} {width} must be a power of two >="
                                f" {MIN_DOT_DIM}")
  if x_KBTC.shape[-1] != channels:
    raise ValueError(f"router_conv: x_KBTC {x_KBTC.shape} and weight_KICO {weight_KICO.shape}"
                     " disagree on the input channels")


def _dropped(x_RC, rows_R, head, row, seed_ref, *, length, rate):
  """x with the dropout of its rows applied (inverted scaling), as counter_hash.keep_mask draws
  it for element (row, token, head, channel); rows outside [0, T) are zero padding anyway."""
  if rate == 0.0:
    return x_RC
  channels = x_RC.shape[1]
  token_R1 = (row * length + rows_R).astype(jnp.uint32)[:, None]
  unit_1C = (head * channels + jnp.arange(channels, dtype=jnp.int32)).astype(jnp.uint32)[None, :]
  bits_RC = counter_hash.element_bits(token_R1, unit_1C, seed_ref[0], seed_ref[1])
  keep_RC = bits_RC >= counter_hash.keep_threshold(rate)
  return jnp.where(keep_RC, x_RC * (1.0 / (1.0 - rate)), 0.0).astype(x_RC.dtype)


def _pre_activation(x_ref, w_ref, bias_O, seed_ref, first_row, head, row, *, length, rate,
                    dilation, halo):
  """conv(dropout(x)) + bias at rows [first_row, first_row + BLOCK_T) (any of them may lie
  outside [0, T): the padded input holds zeros there), float32 [BLOCK_T, O]."""
  taps = w_ref.shape[0]
  half = (taps // 2) * dilation
  acc_RO = jnp.zeros((BLOCK_T, w_ref.shape[2]), jnp.float32) + bias_O[None, :]
  for i in range(taps):
    start = first_row + (i * dilation - half)
    x_RC = x_ref[pl.ds(start + halo, BLOCK_T), :]
    source_R = start + jnp.arange(BLOCK_T, dtype=jnp.int32)
    x_RC = _dropped(x_RC, source_R, head, row, seed_ref, length=length, rate=rate)
    acc_RO = acc_RO + dot_nn(x_RC, w_ref[i])
  return acc_RO


def _forward_kernel(seed_ref, x_ref, w_ref, bias_ref, out_ref, *, length, rate, dilation, halo):
  head, row, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  pre_RO = _pre_activation(x_ref, w_ref, bias_ref[...].astype(jnp.float32), seed_ref,
                           block * BLOCK_T, head, row, length=length, rate=rate,
                           dilation=dilation, halo=halo)
  out_ref[...] = (pre_RO * jax.nn.sigmoid(pre_RO)).astype(out_ref.dtype)


def _backward_kernel(seed_ref, x_ref, w_ref, bias_ref, dout_ref, dx_ref, dpre_ref, *, length,
                     rate, dilation, halo):
  head, row, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  taps = w_ref.shape[0]
  half = (taps // 2) * dilation
  first_row = block * BLOCK_T
  rows_R = first_row + jnp.arange(BLOCK_T, dtype=jnp.int32)
  bias_O = bias_ref[...].astype(jnp.float32)
  dx_RC = jnp.zeros((BLOCK_T, x_ref.shape[1]), jnp.float32)
  for i in range(taps):
    offset = i * dilation - half
    out_rows_R = rows_R - offset  # the outputs whose tap i reads these input rows
    pre_RO = _pre_activation(x_ref, w_ref, bias_O, seed_ref, first_row - offset, head, row,
                             length=length, rate=rate, dilation=dilation, halo=halo)
    sig_RO = jax.nn.sigmoid(pre_RO)
    dout_RO = dout_ref[pl.ds(first_row - offset + half, BLOCK_T), :].astype(jnp.float32)
    valid_R1 = ((out_rows_R >= 0) & (out_rows_R < length))[:, None]
    dpre_RO = jnp.where(valid_R1, dout_RO * sig_RO * (1.0 + pre_RO * (1.0 - sig_RO)), 0.0)
    if offset == 0:
      dpre_ref[...] = dpre_RO
    dx_RC = dx_RC + dot_nt(dpre_RO.astype(w_ref.dtype), w_ref[i])
  # Dropout's backward: the same mask and scale on the gradient.
  dx_ref[...] = _dropped(dx_RC, rows_R, head, row, seed_ref, length=length,
                         rate=rate).astype(dx_ref.dtype)


def _padded(a_KBTC: jax.Array, front: int, length: int) -> jax.Array:
  """Rows [front, front + T) hold `a`; zeros around, to a whole number of blocks plus 2 front."""
  back = cdiv(length, BLOCK_T) * BLOCK_T - length + front
  return jnp.pad(a_KBTC, ((0, 0), (0, 0), (front, back), (0, 0)))


def _seed_or_zeros(seed: jax.Array | None) -> jax.Array:
  return jnp.zeros((2,), jnp.uint32) if seed is None else seed.astype(jnp.uint32)


def _input_specs(padded_rows: int, channels: int, taps: int, c_out: int,
                 dout_rows: int | None = None) -> list[pl.BlockSpec]:
  """Seed words, the (head, row)'s whole padded input, the head's taps and bias; for the
  backward also the (head, row)'s padded output gradient."""
  specs = [pl.BlockSpec((2,), lambda k, b, j: (0,)),
           pl.BlockSpec((None, None, padded_rows, channels), lambda k, b, j: (k, b, 0, 0)),
           pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0)),
           pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0))]
  if dout_rows is not None:
    specs.append(pl.BlockSpec((None, None, dout_rows, c_out), lambda k, b, j: (k, b, 0, 0)))
  return specs


def _forward(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation):
  heads, batch, length, channels = x_KBTC.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  halo = 2 * (taps // 2) * dilation  # the backward reads twice the forward's reach
  x_pad = _padded(x_KBTC, halo, length)
  blocks = cdiv(length, BLOCK_T)
  kernel = functools.partial(_forward_kernel, length=length, rate=rate, dilation=dilation,
                             halo=halo)
  out = pl.pallas_call(
      kernel,
      grid=(heads, batch, blocks),
      in_specs=_input_specs(x_pad.shape[2], channels, taps, c_out),
      out_specs=pl.BlockSpec((None, None, BLOCK_T, c_out), lambda k, b, j: (k, b, j, 0)),
      out_shape=jax.ShapeDtypeStruct((heads, batch, blocks * BLOCK_T, c_out), x_KBTC.dtype),
      compiler_params=triton_compiler_params(NUM_WARPS, 1),
      interpret=interpret_mode(),
      name="router_conv_fwd",
  )(_seed_or_zeros(seed), x_pad, weight_KICO.astype(x_KBTC.dtype), bias_KO)
  return out[:, :, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def conv_silu(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation):
  """silu(conv(dropout(x)) + bias) [K, B, T, O] in x's dtype (reference.conv_silu, no mask)."""
  return _forward(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation)


def _conv_silu_fwd(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation):
  out = _forward(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation)
  return out, (x_KBTC, weight_KICO, bias_KO, seed)


def _conv_silu_bwd(rate, dilation, residuals, dout_KBTO):
  x_KBTC, weight_KICO, bias_KO, seed = residuals
  heads, batch, length, channels = x_KBTC.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  half = (taps // 2) * dilation
  halo = 2 * half
  x_pad = _padded(x_KBTC, halo, length)
  dout_pad = _padded(dout_KBTO.astype(x_KBTC.dtype), half, length)
  blocks = cdiv(length, BLOCK_T)
  kernel = functools.partial(_backward_kernel, length=length, rate=rate, dilation=dilation,
                             halo=halo)
  dx, dpre = pl.pallas_call(
      kernel,
      grid=(heads, batch, blocks),
      in_specs=_input_specs(x_pad.shape[2], channels, taps, c_out, dout_pad.shape[2]),
      out_specs=[pl.BlockSpec((None, None, BLOCK_T, channels), lambda k, b, j: (k, b, j, 0)),
                 pl.BlockSpec((None, None, BLOCK_T, c_out), lambda k, b, j: (k, b, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((heads, batch, blocks * BLOCK_T, channels), x_KBTC.dtype),
                 jax.ShapeDtypeStruct((heads, batch, blocks * BLOCK_T, c_out), jnp.float32)],
      compiler_params=triton_compiler_params(NUM_WARPS, 1),
      interpret=interpret_mode(),
      name="router_conv_bwd",
  )(_seed_or_zeros(seed), x_pad, weight_KICO.astype(x_KBTC.dtype), bias_KO, dout_pad)
  dpre_KBTO = dpre[:, :, :length]
  # Weight and bias gradients: per tap, the dropped inputs at the tap's offset against dpre.
  shifted = jnp.pad(reference.dropped(x_KBTC, seed, rate), ((0, 0), (0, 0), (half, half), (0, 0)))
  dweight_KICO = jnp.stack(
      [jnp.einsum("kbtc,kbto->kco", shifted[:, :, i * dilation:i * dilation + length],
                  dpre_KBTO.astype(x_KBTC.dtype), preferred_element_type=jnp.float32)
       for i in range(taps)], axis=1)
  dbias_KO = jnp.sum(dpre_KBTO, axis=(1, 2))
  dseed = None if seed is None else np.zeros(seed.shape, jax.dtypes.float0)
  return (dx[:, :, :length], dweight_KICO.astype(weight_KICO.dtype), dbias_KO.astype(bias_KO.dtype),
          dseed)


conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)
