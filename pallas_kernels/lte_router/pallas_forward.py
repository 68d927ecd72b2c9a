"""The LTE router's forward kernels: the first layer from k and v in place, then one kernel per
later layer; each writes its pre-activation and the next layer's dropped input (or the logit)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.lte_router import tiling
from pallas_kernels.pallas_common import cdiv, kernel_dot


def _forward_kernel(*refs, offsets, length, rate, last):
  """Grid (head, row, tile): pre_l of the tile, then xd_{l+1} or the logit."""
  x_ref, w_ref, b_ref = refs[:3]
  first_row = pl.program_id(2) * tiling.BLOCK_T
  pre_RO = (tiling.conv_sum(x_ref, w_ref, first_row, offsets, length)
            + b_ref[...].astype(jnp.float32)[None, :])
  pre_ref = refs[-2]
  pre_ref[...] = pre_RO.astype(pre_ref.dtype)
  act_RO = jax.nn.silu(pre_RO.astype(pre_ref.dtype).astype(jnp.float32))
  if last:  # the projection: logit = x_L . w_p + b_p
    wp_ref, bp_ref, logit_ref = refs[3], refs[4], refs[-1]
    act_RO = act_RO.astype(pre_ref.dtype).astype(jnp.float32)
    wp_1O = wp_ref[...].astype(pre_ref.dtype).astype(jnp.float32)[None, :]
    logit_ref[...] = jnp.sum(act_RO * wp_1O, axis=1) + bp_ref[0]
    return
  next_ref = refs[-1]
  if rate:
    keep_RO = tiling.keep(refs[3], first_row, pre_RO.shape[1], length=length, rate=rate)
    act_RO = jnp.where(keep_RO, act_RO.astype(next_ref.dtype).astype(jnp.float32) / (1.0 - rate),
                       0.0)
  next_ref[...] = act_RO.astype(next_ref.dtype)


def _first_forward_kernel(*refs, offsets, length, rate, next_rate):
  """Grid (head, row, tile): the first layer from k and v ([B, T, Hkv, D] blocks of the row and
  head) and its packed keep bits: pre_1 and xd_2."""
  k_ref, v_ref = refs[:2]
  words_ref = refs[2] if rate else None
  w_ref, b_ref = refs[3:5] if rate else refs[2:4]
  seed_ref = refs[-3] if next_rate else None
  pre_ref, next_ref = refs[-2:]
  head_dim = k_ref.shape[-1]
  first_row = pl.program_id(2) * tiling.BLOCK_T
  exact = k_ref.dtype == jnp.float32
  pre_RO = b_ref[...].astype(jnp.float32)[None, :]
  for i, offset in enumerate(offsets):
    for kv_ref, channel_offset in ((k_ref, 0), (v_ref, head_dim)):
      x_RD = tiling.first_layer_rows(kv_ref, words_ref, first_row, offset, channel_offset,
                               length=length, rate=rate)
      pre_RO = pre_RO + kernel_dot(x_RD, w_ref[i, pl.ds(channel_offset, head_dim), :],
                                   exact=exact)
  pre_ref[...] = pre_RO.astype(pre_ref.dtype)
  act_RO = jax.nn.silu(pre_RO.astype(pre_ref.dtype).astype(jnp.float32))
  if next_rate:
    keep_RO = tiling.keep(seed_ref, first_row, pre_RO.shape[1], length=length, rate=next_rate)
    act_RO = jnp.where(keep_RO,
                       act_RO.astype(next_ref.dtype).astype(jnp.float32) / (1.0 - next_rate), 0.0)
  next_ref[...] = act_RO.astype(next_ref.dtype)


def first_forward(k_BTKD, v_BTKD, words_KBTW, weight_KICO, bias_KO, offsets, rate, next_seed,
                   next_rate):
  """(pre_1, xd_2) [K, B, T, O] from k, v and the packed keep bits (None: no dropout)."""
  batch, length, heads, head_dim = k_BTKD.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  tiles = cdiv(length, tiling.BLOCK_T)
  dtype = k_BTKD.dtype
  in_specs = [tiling.kv_row_spec(length, head_dim), tiling.kv_row_spec(length, head_dim)]
  inputs = [k_BTKD, v_BTKD]
  if rate:
    in_specs.append(tiling.words_spec(length, words_KBTW.shape[-1]))
    inputs.append(words_KBTW)
  in_specs += [pl.BlockSpec((None, taps, 2 * head_dim, c_out), lambda k, b, j: (k, 0, 0, 0)),
               pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0))]
  inputs += [weight_KICO.astype(dtype), bias_KO]
  if next_rate:
    in_specs.append(tiling.SEED_SPEC)
    inputs.append(next_seed)
  shape = jax.ShapeDtypeStruct((heads, batch, tiles * tiling.BLOCK_T, c_out), dtype)
  pre, next_input = tiling.call(
      functools.partial(_first_forward_kernel, offsets=offsets, length=length, rate=rate,
                        next_rate=next_rate),
      "lte_router_first_forward", (heads, batch, tiles), in_specs,
      [tiling.tile_spec(c_out), tiling.tile_spec(c_out)], [shape, shape], *inputs)
  return pre[:, :, :length], next_input[:, :, :length]


def forward_layer(xd_KBTC, weight_KICO, bias_KO, offsets, seed, rate, projection):
  """(pre_l, xd_{l+1}) or, with projection = (w_p [K, O], b_p [K]), (pre_L, logit [K, B, T])."""
  heads, batch, length, channels = xd_KBTC.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  tiles = cdiv(length, tiling.BLOCK_T)
  padded = (heads, batch, tiles * tiling.BLOCK_T)
  dtype = xd_KBTC.dtype
  in_specs = [tiling.row_spec(length, channels),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0)),
              pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0))]
  inputs = [xd_KBTC, weight_KICO.astype(dtype), bias_KO]
  last = projection is not None
  if last:
    in_specs += [pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0)),
                 pl.BlockSpec((None, 1), lambda k, b, j: (k, 0))]
    inputs += [projection[0], projection[1].astype(jnp.float32)[:, None]]
    second_spec = pl.BlockSpec((None, None, tiling.BLOCK_T), lambda k, b, j: (k, b, j))
    second_shape = jax.ShapeDtypeStruct(padded, jnp.float32)
  else:
    if rate:
      in_specs.append(tiling.SEED_SPEC)
      inputs.append(seed)
    second_spec = tiling.tile_spec(c_out)
    second_shape = jax.ShapeDtypeStruct((*padded, c_out), dtype)
  pre, second = tiling.call(
      functools.partial(_forward_kernel, offsets=offsets, length=length,
                        rate=0.0 if last else rate, last=last),
      "lte_router_forward", (heads, batch, tiles), in_specs, [tiling.tile_spec(c_out), second_spec],
      [jax.ShapeDtypeStruct((*padded, c_out), dtype), second_shape], *inputs)
  return pre[:, :, :length], second[:, :, :length]
