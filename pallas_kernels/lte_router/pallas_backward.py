"""The LTE router's backward kernels: per layer the input gradient (the convolution with the taps
transposed, the dropout and the SiLU derivative fused; the first layer's written as dk and dv in
place) and the weight gradient (summed per chunk of tokens, the chunks added by XLA)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.lte_router import reference, tiling
from pallas_kernels.pallas_common import (
    MIN_DOT_DIM, cdiv, interpret_mode, kernel_dot, triton_compiler_params)


def _input_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, row, tile): d pre_{l-1} of the tile, from d pre_l (layer l > 1)."""
  dpre_ref, w_ref, prev_pre_ref = refs[:3]
  out_ref = refs[-1]
  first_row = pl.program_id(2) * tiling.BLOCK_T
  dx_RC = tiling.conv_sum(dpre_ref, w_ref, first_row, offsets, length, transpose_taps=True)
  if rate:
    keep_RC = tiling.keep(refs[3], first_row, dx_RC.shape[1], length=length, rate=rate)
    dx_RC = jnp.where(keep_RC, dx_RC / (1.0 - rate), 0.0)
  prev_pre_RC = tiling.rows(prev_pre_ref, first_row, 0, length).astype(jnp.float32)
  out_ref[...] = (dx_RC * tiling.silu_grad(prev_pre_RC)).astype(out_ref.dtype)


def _weight_grad_kernel(x_ref, dy_ref, dw_ref, *, offsets, length):
  tap, chunk = pl.program_id(1), pl.program_id(4)
  offset = tiling.tap_offset(offsets, tap)
  exact = x_ref.dtype == jnp.float32
  first_tile = chunk * (tiling.CHUNK // tiling.BLOCK_T)
  tiles = jnp.minimum(tiling.CHUNK // tiling.BLOCK_T, cdiv(length, tiling.BLOCK_T) - first_tile)

  def tile(t, acc_CO):
    first_row = (first_tile + t) * tiling.BLOCK_T
    x_RC = tiling.rows(x_ref, first_row, offset, length)
    dy_RO = tiling.rows(dy_ref, first_row, 0, length)
    return acc_CO + kernel_dot(x_RC, dy_RO, exact=exact, trans_a=True)

  dw_ref[...] = lax.fori_loop(0, tiles, tile, jnp.zeros(dw_ref.shape, jnp.float32))


def _first_input_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, row, tile): dk and dv of the tile ([B, T, Hkv, D] blocks), the first layer's
  input gradient with its dropout applied and split into the key and value channels."""
  dpre_ref, w_ref = refs[:2]
  words_ref = refs[2] if rate else None
  dk_ref, dv_ref = refs[-2:]
  head_dim = dk_ref.shape[-1]
  first_row = pl.program_id(2) * tiling.BLOCK_T
  exact = dpre_ref.dtype == jnp.float32
  for out_ref, channel_offset in ((dk_ref, 0), (dv_ref, head_dim)):
    dx_RD = None
    for i, offset in enumerate(offsets):
      term = kernel_dot(tiling.rows(dpre_ref, first_row, offset, length),
                        w_ref[i, pl.ds(channel_offset, head_dim), :], exact=exact, trans_b=True)
      dx_RD = term if dx_RD is None else dx_RD + term
    if words_ref is not None:
      dx_RD = tiling.apply_bits(dx_RD, words_ref, first_row, channel_offset, length=length,
                                rate=rate)
    out_ref[...] = dx_RD.astype(out_ref.dtype)


def _first_weight_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, tap, row, chunk): the first layer's weight gradient of the chunk, the key and
  the value channels as two [D, O] sums."""
  k_ref, v_ref = refs[:2]
  words_ref = refs[2] if rate else None
  dy_ref, dw_ref = refs[-2:]
  tap, chunk = pl.program_id(1), pl.program_id(3)
  offset = tiling.tap_offset(offsets, tap)
  head_dim = k_ref.shape[-1]
  exact = k_ref.dtype == jnp.float32
  first_tile = chunk * (tiling.CHUNK // tiling.BLOCK_T)
  tiles = jnp.minimum(tiling.CHUNK // tiling.BLOCK_T, cdiv(length, tiling.BLOCK_T) - first_tile)

  def tile(t, sums):
    first_row = (first_tile + t) * tiling.BLOCK_T
    dy_RO = tiling.rows(dy_ref, first_row, 0, length)
    return tuple(
        acc_DO + kernel_dot(tiling.first_layer_rows(kv_ref, words_ref, first_row, offset,
                                                    channel_offset, length=length, rate=rate),
                            dy_RO, exact=exact, trans_a=True)
        for acc_DO, (kv_ref, channel_offset) in zip(sums, ((k_ref, 0), (v_ref, head_dim))))

  zeros = jnp.zeros((head_dim, dw_ref.shape[-1]), jnp.float32)
  dk_sum, dv_sum = lax.fori_loop(0, tiles, tile, (zeros, zeros))
  dw_ref[pl.ds(0, head_dim), :] = dk_sum
  dw_ref[pl.ds(head_dim, head_dim), :] = dv_sum


def first_input_grad(dpre_KBTO, weight_KICO, words_KBTW, offsets, rate):
  """(dk, dv) [B, T, K, D] in dpre's dtype: the first layer's input gradient, dropout applied."""
  heads, batch, length, c_out = dpre_KBTO.shape
  taps, channels = weight_KICO.shape[1], weight_KICO.shape[2]
  head_dim = channels // 2
  tiles = cdiv(length, tiling.BLOCK_T)
  in_specs = [tiling.row_spec(length, c_out),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0))]
  inputs = [dpre_KBTO, weight_KICO.astype(dpre_KBTO.dtype)]
  if rate:
    in_specs.append(tiling.words_spec(length, words_KBTW.shape[-1]))
    inputs.append(words_KBTW)
  out_spec = pl.BlockSpec((None, tiling.BLOCK_T, None, head_dim), lambda k, b, j: (b, j, k, 0))
  shape = jax.ShapeDtypeStruct((batch, tiles * tiling.BLOCK_T, heads, head_dim), dpre_KBTO.dtype)
  dk, dv = tiling.call(
      functools.partial(_first_input_grad_kernel, offsets=tuple(-o for o in offsets),
                        length=length, rate=rate),
      "lte_router_first_input_grad", (heads, batch, tiles), in_specs, [out_spec, out_spec],
      [shape, shape], *inputs)
  return dk[:, :length], dv[:, :length]


def first_weight_grad(k_BTKD, v_BTKD, words_KBTW, dy_KBTO, offsets, rate):
  """float32 [K, taps, 2D, O]: the first layer's weight gradient."""
  batch, length, heads, head_dim = k_BTKD.shape
  c_out, taps = dy_KBTO.shape[-1], len(offsets)
  chunks = cdiv(length, tiling.CHUNK)
  in_specs = [tiling.kv_row_spec(length, head_dim, row_axis=2),
              tiling.kv_row_spec(length, head_dim, row_axis=2)]
  inputs = [k_BTKD, v_BTKD]
  if rate:
    in_specs.append(tiling.words_spec(length, words_KBTW.shape[-1], row_axis=2))
    inputs.append(words_KBTW)
  in_specs.append(pl.BlockSpec((None, None, length, c_out), lambda k, i, b, j: (k, b, 0, 0)))
  inputs.append(dy_KBTO)
  partial = pl.pallas_call(
      functools.partial(_first_weight_grad_kernel, offsets=offsets, length=length, rate=rate),
      grid=(heads, taps, batch, chunks),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, None, None, None, 2 * head_dim, c_out),
                             lambda k, i, b, j: (k, i, b, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((heads, taps, batch, chunks, 2 * head_dim, c_out),
                                     jnp.float32),
      compiler_params=triton_compiler_params(tiling.NUM_WARPS, 2),
      interpret=interpret_mode(),
      name="lte_router_first_weight_grad",
  )(*inputs)
  return jnp.sum(partial, axis=(2, 3))


def input_grad(dpre_KBTO, weight_KICO, offsets, prev_pre, seed, rate):
  """d pre_{l-1} [K, B, T, C] in dpre's dtype from d pre_l (layer l > 1)."""
  heads, batch, length, c_out = dpre_KBTO.shape
  taps, channels = weight_KICO.shape[1], weight_KICO.shape[2]
  tiles = cdiv(length, tiling.BLOCK_T)
  in_specs = [tiling.row_spec(length, c_out),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0)),
              tiling.row_spec(length, channels)]
  inputs = [dpre_KBTO, weight_KICO.astype(dpre_KBTO.dtype), prev_pre]
  if rate:
    in_specs.append(tiling.SEED_SPEC)
    inputs.append(seed)
  out = tiling.call(
      functools.partial(_input_grad_kernel, offsets=tuple(-o for o in offsets), length=length,
                        rate=rate),
      "lte_router_input_grad", (heads, batch, tiles), in_specs, tiling.tile_spec(channels),
      jax.ShapeDtypeStruct((heads, batch, tiles * tiling.BLOCK_T, channels), dpre_KBTO.dtype),
      *inputs)
  return out[:, :, :length]


def weight_grad(x_KBTC, dy_KBTO, offsets):
  """float32 [K, taps, C, O]: sum over rows and tokens of x[t + offsets[i]]^T dy[t]."""
  if tiling.CHUNK % tiling.BLOCK_T:
    raise ValueError(f"lte_router[pallas]: CHUNK {tiling.CHUNK} is not a multiple of BLOCK_T"
                     f" {tiling.BLOCK_T}")
  heads, batch, length, channels = x_KBTC.shape
  c_out, taps = dy_KBTO.shape[-1], len(offsets)
  block_c = min(channels, max(MIN_DOT_DIM, tiling.MAX_ACCUMULATOR // c_out))
  chunks = cdiv(length, tiling.CHUNK)
  partial = pl.pallas_call(
      functools.partial(_weight_grad_kernel, offsets=offsets, length=length),
      grid=(heads, taps, channels // block_c, batch, chunks),
      in_specs=[
          pl.BlockSpec((None, None, length, block_c), lambda k, i, c, b, j: (k, b, 0, c)),
          pl.BlockSpec((None, None, length, c_out), lambda k, i, c, b, j: (k, b, 0, 0))],
      out_specs=pl.BlockSpec((None, None, None, None, block_c, c_out),
                             lambda k, i, c, b, j: (k, i, b, j, c, 0)),
      out_shape=jax.ShapeDtypeStruct((heads, taps, batch, chunks, channels, c_out), jnp.float32),
      compiler_params=triton_compiler_params(tiling.NUM_WARPS, 2),
      interpret=interpret_mode(),
      name="lte_router_weight_grad",
  )(x_KBTC, dy_KBTO)
  return jnp.sum(partial, axis=(2, 3))


def dropped_activation(pre_KBTC, seed_words, rate):
  """drop(silu(pre)) as the forward kernels compute it (the SiLU rounded to pre's dtype, then
  the dropout of seed_words = (s0, s1, row offset, 0))."""
  act = jax.nn.silu(pre_KBTC.astype(jnp.float32)).astype(pre_KBTC.dtype)
  if seed_words is None:
    return act
  return reference.dropped(act, seed_words[:2], rate, seed_words[2])
