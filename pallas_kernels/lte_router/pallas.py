"""The LTE router's CNN as Pallas (Triton) kernels: every conv layer fused with its neighbours'
elementwise work, forward and backward, one pass over each activation.

The router (reference.py) is, per KV head, L layers xd_l = drop_l(x_{l-1}), pre_l = conv_l(xd_l)
+ b_l, x_l = silu(pre_l) with x_0 = concat(k, v), then logit = x_L . w_p + b_p. XLA runs each of
these as its own pass over HBM (the dropout's hash in several of them), and builds x_0 heads-first
with a transpose, whose gradient is another. Here:

- the first layer reads k and v where they are ([B, T, Hkv, D]), at each tap's offset (masked
  loads; rows outside [0, T) read zeros: the 'same' padding), its dropout from packed keep bits
  that XLA draws once per call (1 bit an element, `packed_keep_bits`, kept for the backward); its
  input-gradient kernel writes dk and dv in that layout, the dropout applied; its weight-gradient
  kernel sums the key and the value channels apart;
- forward, one kernel per later layer: the conv of xd_l from its rows at each tap's offset, the
  bias, and in every forward kernel's epilogue the next layer's dropped input
  xd_{l+1} = drop(silu(pre_l)) with its mask hashed once per element (counter_hash.py: the same
  bits as XLA's mask), or for the last layer the projection's logit;
- backward, one kernel per later layer for the input gradient: the same convolution of d pre_l
  with the taps transposed and their offsets negated, whose epilogue applies layer l's dropout
  mask and the SiLU derivative at pre_{l-1}, writing d pre_{l-1}; one kernel per layer for the
  weight gradient (x[t + offset_i]^T d pre[t] summed per chunk of tokens, the chunks added by
  XLA). The bias gradients, the projection's and the last layer's d pre are XLA reductions and
  one elementwise pass over the narrowest activation.

The forward keeps pre_l and the first layer's keep bits for the backward (named
ROUTER_ACTIVATION, which the remat policy "attention" saves), so a recomputation runs no
convolution; the backward recomputes xd_l (l > 1) from them in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.lte_router import counter_hash
from pallas_kernels.lte_router.reference import ROUTER_ACTIVATION
from pallas_kernels.pallas_common import (
    MIN_DOT_DIM, cdiv, interpret_mode, is_power_of_two, kernel_dot, triton_compiler_params)

BLOCK_T = 128  # output rows per program of the convolution kernels
CHUNK = 1024  # tokens per program of the weight-gradient kernel
MAX_ACCUMULATOR = 8192  # float32 elements of a weight-gradient program's [C block, O] sum
# The first layer's weight-gradient program sums its key and value channels whole: [2D, O].
FIRST_LAYER_MAX_ACCUMULATOR = 16384
NUM_WARPS = 4


def check_supported(k_BTKD: jax.Array, weights: tuple[jax.Array, ...]) -> None:
  """NotImplementedError for widths, depths and dtypes the kernels do not handle."""
  if len(weights) < 2:
    raise NotImplementedError("lte_router[pallas]: needs at least two conv layers")
  for weight_KICO in weights:
    for name, width in (("input channels", weight_KICO.shape[2]),
                        ("output channels", weight_KICO.shape[3])):
      if width < MIN_DOT_DIM or not is_power_of_two(width):
        raise NotImplementedError(f"lte_router[pallas]: conv {name} {width} must be a power of"
                                  f" two >= {MIN_DOT_DIM}")
  head_dim, c_out = k_BTKD.shape[-1], weights[0].shape[3]
  if (head_dim < MIN_DOT_DIM or 2 * head_dim % 32
      or 2 * head_dim * c_out > FIRST_LAYER_MAX_ACCUMULATOR):
    raise NotImplementedError(f"lte_router[pallas]: head dim {head_dim} with {c_out} first-layer"
                              " outputs")
  if jnp.dtype(k_BTKD.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"lte_router[pallas]: dtype {k_BTKD.dtype}")


def _rows(ref, first_row, offset, length):
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


def _keep(seed_ref, first_row, width, *, length, rate):
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


def _conv_sum(x_ref, w_ref, first_row, offsets, length, transpose_taps=False):
  """float32 [BLOCK_T, O] (or [BLOCK_T, C] with transpose_taps): sum_i x[t + offset_i] W_i."""
  exact = x_ref.dtype == jnp.float32
  acc = None
  for i, offset in enumerate(offsets):
    term = kernel_dot(_rows(x_ref, first_row, offset, length), w_ref[i], exact=exact,
                      trans_b=transpose_taps)
    acc = term if acc is None else acc + term
  return acc


def _silu_grad(pre):
  sig = jax.nn.sigmoid(pre)
  return sig * (1.0 + pre * (1.0 - sig))


def _forward_kernel(*refs, offsets, length, rate, last):
  """Grid (head, row, tile): pre_l of the tile, then xd_{l+1} or the logit."""
  x_ref, w_ref, b_ref = refs[:3]
  first_row = pl.program_id(2) * BLOCK_T
  pre_RO = (_conv_sum(x_ref, w_ref, first_row, offsets, length)
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
    keep_RO = _keep(refs[3], first_row, pre_RO.shape[1], length=length, rate=rate)
    act_RO = jnp.where(keep_RO, act_RO.astype(next_ref.dtype).astype(jnp.float32) / (1.0 - rate),
                       0.0)
  next_ref[...] = act_RO.astype(next_ref.dtype)


def _input_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, row, tile): d pre_{l-1} of the tile, from d pre_l (layer l > 1)."""
  dpre_ref, w_ref, prev_pre_ref = refs[:3]
  out_ref = refs[-1]
  first_row = pl.program_id(2) * BLOCK_T
  dx_RC = _conv_sum(dpre_ref, w_ref, first_row, offsets, length, transpose_taps=True)
  if rate:
    keep_RC = _keep(refs[3], first_row, dx_RC.shape[1], length=length, rate=rate)
    dx_RC = jnp.where(keep_RC, dx_RC / (1.0 - rate), 0.0)
  prev_pre_RC = _rows(prev_pre_ref, first_row, 0, length).astype(jnp.float32)
  out_ref[...] = (dx_RC * _silu_grad(prev_pre_RC)).astype(out_ref.dtype)


def _weight_grad_kernel(x_ref, dy_ref, dw_ref, *, offsets, length):
  tap, chunk = pl.program_id(1), pl.program_id(4)
  offset = jnp.int32(offsets[0])
  for i in range(1, len(offsets)):  # the tap's offset (a grid index, so not a Python int)
    offset = jnp.where(tap == i, jnp.int32(offsets[i]), offset)
  exact = x_ref.dtype == jnp.float32
  first_tile = chunk * (CHUNK // BLOCK_T)
  tiles = jnp.minimum(CHUNK // BLOCK_T, cdiv(length, BLOCK_T) - first_tile)

  def tile(t, acc_CO):
    first_row = (first_tile + t) * BLOCK_T
    x_RC = _rows(x_ref, first_row, offset, length)
    dy_RO = _rows(dy_ref, first_row, 0, length)
    return acc_CO + kernel_dot(x_RC, dy_RO, exact=exact, trans_a=True)

  dw_ref[...] = lax.fori_loop(0, tiles, tile, jnp.zeros(dw_ref.shape, jnp.float32))


def _first_layer_rows(kv_ref, words_ref, first_row, offset, channel_offset, *, length, rate):
  """The first layer's dropped input at rows first_row + offset + [0, BLOCK_T), channels
  [channel_offset, channel_offset + D) of concat(k, v), from one of k, v ([T, D] of the
  (row, head)) and the packed keep bits ([T, 2D / 32] uint32; None: no dropout)."""
  x_RD = _rows(kv_ref, first_row, offset, length)
  if words_ref is None:
    return x_RD
  return _apply_bits(x_RD, words_ref, first_row + offset, channel_offset, length=length,
                     rate=rate)


def _apply_bits(x_RD, words_ref, start, channel_offset, *, length, rate):
  """x with dropout applied from the packed keep bits of rows start + [0, BLOCK_T)."""
  rows_R1 = jnp.clip(start + jnp.arange(BLOCK_T, dtype=jnp.int32), 0, length - 1)[:, None]
  channel_1D = channel_offset + jnp.arange(x_RD.shape[1], dtype=jnp.int32)[None, :]
  words_RD = words_ref[rows_R1, channel_1D // 32]
  keep_RD = ((words_RD >> (channel_1D % 32).astype(jnp.uint32)) & jnp.uint32(1)) == 1
  return jnp.where(keep_RD, (x_RD.astype(jnp.float32) / (1.0 - rate)).astype(x_RD.dtype),
                   jnp.zeros_like(x_RD))


def _first_forward_kernel(*refs, offsets, length, rate, next_rate):
  """Grid (head, row, tile): the first layer from k and v ([B, T, Hkv, D] blocks of the row and
  head) and its packed keep bits: pre_1 and xd_2."""
  k_ref, v_ref = refs[:2]
  words_ref = refs[2] if rate else None
  w_ref, b_ref = refs[3:5] if rate else refs[2:4]
  seed_ref = refs[-3] if next_rate else None
  pre_ref, next_ref = refs[-2:]
  head_dim = k_ref.shape[-1]
  first_row = pl.program_id(2) * BLOCK_T
  exact = k_ref.dtype == jnp.float32
  pre_RO = b_ref[...].astype(jnp.float32)[None, :]
  for i, offset in enumerate(offsets):
    for kv_ref, channel_offset in ((k_ref, 0), (v_ref, head_dim)):
      x_RD = _first_layer_rows(kv_ref, words_ref, first_row, offset, channel_offset,
                               length=length, rate=rate)
      pre_RO = pre_RO + kernel_dot(x_RD, w_ref[i, pl.ds(channel_offset, head_dim), :],
                                   exact=exact)
  pre_ref[...] = pre_RO.astype(pre_ref.dtype)
  act_RO = jax.nn.silu(pre_RO.astype(pre_ref.dtype).astype(jnp.float32))
  if next_rate:
    keep_RO = _keep(seed_ref, first_row, pre_RO.shape[1], length=length, rate=next_rate)
    act_RO = jnp.where(keep_RO,
                       act_RO.astype(next_ref.dtype).astype(jnp.float32) / (1.0 - next_rate), 0.0)
  next_ref[...] = act_RO.astype(next_ref.dtype)


def _first_input_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, row, tile): dk and dv of the tile ([B, T, Hkv, D] blocks), the first layer's
  input gradient with its dropout applied and split into the key and value channels."""
  dpre_ref, w_ref = refs[:2]
  words_ref = refs[2] if rate else None
  dk_ref, dv_ref = refs[-2:]
  head_dim = dk_ref.shape[-1]
  first_row = pl.program_id(2) * BLOCK_T
  exact = dpre_ref.dtype == jnp.float32
  for out_ref, channel_offset in ((dk_ref, 0), (dv_ref, head_dim)):
    dx_RD = None
    for i, offset in enumerate(offsets):
      term = kernel_dot(_rows(dpre_ref, first_row, offset, length),
                        w_ref[i, pl.ds(channel_offset, head_dim), :], exact=exact, trans_b=True)
      dx_RD = term if dx_RD is None else dx_RD + term
    if words_ref is not None:
      dx_RD = _apply_bits(dx_RD, words_ref, first_row, channel_offset, length=length, rate=rate)
    out_ref[...] = dx_RD.astype(out_ref.dtype)


def _first_weight_grad_kernel(*refs, offsets, length, rate):
  """Grid (head, tap, row, chunk): the first layer's weight gradient of the chunk, the key and
  the value channels as two [D, O] sums."""
  k_ref, v_ref = refs[:2]
  words_ref = refs[2] if rate else None
  dy_ref, dw_ref = refs[-2:]
  tap, chunk = pl.program_id(1), pl.program_id(3)
  offset = jnp.int32(offsets[0])
  for i in range(1, len(offsets)):  # the tap's offset (a grid index, so not a Python int)
    offset = jnp.where(tap == i, jnp.int32(offsets[i]), offset)
  head_dim = k_ref.shape[-1]
  exact = k_ref.dtype == jnp.float32
  first_tile = chunk * (CHUNK // BLOCK_T)
  tiles = jnp.minimum(CHUNK // BLOCK_T, cdiv(length, BLOCK_T) - first_tile)

  def tile(t, sums):
    first_row = (first_tile + t) * BLOCK_T
    dy_RO = _rows(dy_ref, first_row, 0, length)
    return tuple(
        acc_DO + kernel_dot(_first_layer_rows(kv_ref, words_ref, first_row, offset, channel_offset,
                                              length=length, rate=rate),
                            dy_RO, exact=exact, trans_a=True)
        for acc_DO, (kv_ref, channel_offset) in zip(sums, ((k_ref, 0), (v_ref, head_dim))))

  zeros = jnp.zeros((head_dim, dw_ref.shape[-1]), jnp.float32)
  dk_sum, dv_sum = lax.fori_loop(0, tiles, tile, (zeros, zeros))
  dw_ref[pl.ds(0, head_dim), :] = dk_sum
  dw_ref[pl.ds(head_dim, head_dim), :] = dv_sum


def _kv_row_spec(length, head_dim, row_axis=1):
  """[T, D] of (row, head) from a [B, T, Hkv, D] array; grid (head, ...) with the row at
  grid axis row_axis."""
  return pl.BlockSpec((None, length, None, head_dim),
                      lambda *grid: (grid[row_axis], 0, grid[0], 0))


def _words_spec(length, words, row_axis=1):
  """[T, W] of (head, row) from the packed keep bits [Hkv, B, T, W]."""
  return pl.BlockSpec((None, None, length, words), lambda *grid: (grid[0], grid[row_axis], 0, 0))


def _first_forward(k_BTKD, v_BTKD, words_KBTW, weight_KICO, bias_KO, offsets, rate, next_seed,
                   next_rate):
  """(pre_1, xd_2) [K, B, T, O] from k, v and the packed keep bits (None: no dropout)."""
  batch, length, heads, head_dim = k_BTKD.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  tiles = cdiv(length, BLOCK_T)
  dtype = k_BTKD.dtype
  in_specs = [_kv_row_spec(length, head_dim), _kv_row_spec(length, head_dim)]
  inputs = [k_BTKD, v_BTKD]
  if rate:
    in_specs.append(_words_spec(length, words_KBTW.shape[-1]))
    inputs.append(words_KBTW)
  in_specs += [pl.BlockSpec((None, taps, 2 * head_dim, c_out), lambda k, b, j: (k, 0, 0, 0)),
               pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0))]
  inputs += [weight_KICO.astype(dtype), bias_KO]
  if next_rate:
    in_specs.append(_SEED_SPEC)
    inputs.append(next_seed)
  shape = jax.ShapeDtypeStruct((heads, batch, tiles * BLOCK_T, c_out), dtype)
  pre, next_input = _call(
      functools.partial(_first_forward_kernel, offsets=offsets, length=length, rate=rate,
                        next_rate=next_rate),
      "lte_router_first_forward", (heads, batch, tiles), in_specs,
      [_tile_spec(c_out), _tile_spec(c_out)], [shape, shape], *inputs)
  return pre[:, :, :length], next_input[:, :, :length]


def _first_input_grad(dpre_KBTO, weight_KICO, words_KBTW, offsets, rate):
  """(dk, dv) [B, T, K, D] in dpre's dtype: the first layer's input gradient, dropout applied."""
  heads, batch, length, c_out = dpre_KBTO.shape
  taps, channels = weight_KICO.shape[1], weight_KICO.shape[2]
  head_dim = channels // 2
  tiles = cdiv(length, BLOCK_T)
  in_specs = [_row_spec(length, c_out),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0))]
  inputs = [dpre_KBTO, weight_KICO.astype(dpre_KBTO.dtype)]
  if rate:
    in_specs.append(_words_spec(length, words_KBTW.shape[-1]))
    inputs.append(words_KBTW)
  out_spec = pl.BlockSpec((None, BLOCK_T, None, head_dim), lambda k, b, j: (b, j, k, 0))
  shape = jax.ShapeDtypeStruct((batch, tiles * BLOCK_T, heads, head_dim), dpre_KBTO.dtype)
  dk, dv = _call(
      functools.partial(_first_input_grad_kernel, offsets=tuple(-o for o in offsets),
                        length=length, rate=rate),
      "lte_router_first_input_grad", (heads, batch, tiles), in_specs, [out_spec, out_spec],
      [shape, shape], *inputs)
  return dk[:, :length], dv[:, :length]


def _first_weight_grad(k_BTKD, v_BTKD, words_KBTW, dy_KBTO, offsets, rate):
  """float32 [K, taps, 2D, O]: the first layer's weight gradient."""
  batch, length, heads, head_dim = k_BTKD.shape
  c_out, taps = dy_KBTO.shape[-1], len(offsets)
  chunks = cdiv(length, CHUNK)
  in_specs = [_kv_row_spec(length, head_dim, row_axis=2),
              _kv_row_spec(length, head_dim, row_axis=2)]
  inputs = [k_BTKD, v_BTKD]
  if rate:
    in_specs.append(_words_spec(length, words_KBTW.shape[-1], row_axis=2))
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
      compiler_params=triton_compiler_params(NUM_WARPS, 2),
      interpret=interpret_mode(),
      name="lte_router_first_weight_grad",
  )(*inputs)
  return jnp.sum(partial, axis=(2, 3))


def packed_keep_bits(seed_words, shape, rate):
  """uint32 [K, B, T, C / 32]: bit j of word w is counter_hash.keep_mask's bit of channel
  32 w + j (seed_words: s0, s1, the row offset, unused)."""
  keep_KBTC = counter_hash.keep_mask(seed_words[:2], shape, rate, layout="KBTC",
                                     row_offset=seed_words[2])
  keep_KBTWJ = keep_KBTC.reshape(*shape[:3], shape[3] // 32, 32).astype(jnp.uint32)
  return jnp.sum(keep_KBTWJ << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _row_spec(length, width):
  return pl.BlockSpec((None, None, length, width), lambda k, b, j: (k, b, 0, 0))


def _tile_spec(width):
  return pl.BlockSpec((None, None, BLOCK_T, width), lambda k, b, j: (k, b, j, 0))


_SEED_SPEC = pl.BlockSpec((4,), lambda k, b, j: (0,))  # seed words, row offset, unused


def _call(kernel, name, grid, in_specs, out_specs, out_shape, *inputs):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(NUM_WARPS, 2), interpret=interpret_mode(),
      name=name)(*inputs)


def _forward_layer(xd_KBTC, weight_KICO, bias_KO, offsets, seed, rate, projection):
  """(pre_l, xd_{l+1}) or, with projection = (w_p [K, O], b_p [K]), (pre_L, logit [K, B, T])."""
  heads, batch, length, channels = xd_KBTC.shape
  taps, c_out = weight_KICO.shape[1], weight_KICO.shape[3]
  tiles = cdiv(length, BLOCK_T)
  padded = (heads, batch, tiles * BLOCK_T)
  dtype = xd_KBTC.dtype
  in_specs = [_row_spec(length, channels),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0)),
              pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0))]
  inputs = [xd_KBTC, weight_KICO.astype(dtype), bias_KO]
  last = projection is not None
  if last:
    in_specs += [pl.BlockSpec((None, c_out), lambda k, b, j: (k, 0)),
                 pl.BlockSpec((None, 1), lambda k, b, j: (k, 0))]
    inputs += [projection[0], projection[1].astype(jnp.float32)[:, None]]
    second_spec = pl.BlockSpec((None, None, BLOCK_T), lambda k, b, j: (k, b, j))
    second_shape = jax.ShapeDtypeStruct(padded, jnp.float32)
  else:
    if rate:
      in_specs.append(_SEED_SPEC)
      inputs.append(seed)
    second_spec, second_shape = _tile_spec(c_out), jax.ShapeDtypeStruct((*padded, c_out), dtype)
  pre, second = _call(
      functools.partial(_forward_kernel, offsets=offsets, length=length,
                        rate=0.0 if last else rate, last=last),
      "lte_router_forward", (heads, batch, tiles), in_specs, [_tile_spec(c_out), second_spec],
      [jax.ShapeDtypeStruct((*padded, c_out), dtype), second_shape], *inputs)
  return pre[:, :, :length], second[:, :, :length]


def _input_grad(dpre_KBTO, weight_KICO, offsets, prev_pre, seed, rate):
  """d pre_{l-1} [K, B, T, C] in dpre's dtype from d pre_l (layer l > 1)."""
  heads, batch, length, c_out = dpre_KBTO.shape
  taps, channels = weight_KICO.shape[1], weight_KICO.shape[2]
  tiles = cdiv(length, BLOCK_T)
  in_specs = [_row_spec(length, c_out),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0)),
              _row_spec(length, channels)]
  inputs = [dpre_KBTO, weight_KICO.astype(dpre_KBTO.dtype), prev_pre]
  if rate:
    in_specs.append(_SEED_SPEC)
    inputs.append(seed)
  out = _call(
      functools.partial(_input_grad_kernel, offsets=tuple(-o for o in offsets), length=length,
                        rate=rate),
      "lte_router_input_grad", (heads, batch, tiles), in_specs, _tile_spec(channels),
      jax.ShapeDtypeStruct((heads, batch, tiles * BLOCK_T, channels), dpre_KBTO.dtype), *inputs)
  return out[:, :, :length]


def _weight_grad(x_KBTC, dy_KBTO, offsets):
  """float32 [K, taps, C, O]: sum over rows and tokens of x[t + offsets[i]]^T dy[t]."""
  if CHUNK % BLOCK_T:
    raise ValueError(f"lte_router[pallas]: CHUNK {CHUNK} is not a multiple of BLOCK_T {BLOCK_T}")
  heads, batch, length, channels = x_KBTC.shape
  c_out, taps = dy_KBTO.shape[-1], len(offsets)
  block_c = min(channels, max(MIN_DOT_DIM, MAX_ACCUMULATOR // c_out))
  chunks = cdiv(length, CHUNK)
  partial = pl.pallas_call(
      functools.partial(_weight_grad_kernel, offsets=offsets, length=length),
      grid=(heads, taps, channels // block_c, batch, chunks),
      in_specs=[
          pl.BlockSpec((None, None, length, block_c), lambda k, i, c, b, j: (k, b, 0, c)),
          pl.BlockSpec((None, None, length, c_out), lambda k, i, c, b, j: (k, b, 0, 0))],
      out_specs=pl.BlockSpec((None, None, None, None, block_c, c_out),
                             lambda k, i, c, b, j: (k, i, b, j, c, 0)),
      out_shape=jax.ShapeDtypeStruct((heads, taps, batch, chunks, channels, c_out), jnp.float32),
      compiler_params=triton_compiler_params(NUM_WARPS, 2),
      interpret=interpret_mode(),
      name="lte_router_weight_grad",
  )(x_KBTC, dy_KBTO)
  return jnp.sum(partial, axis=(2, 3))


def _offsets(taps: int, dilation: int) -> tuple[int, ...]:
  half = (taps // 2) * dilation
  return tuple(i * dilation - half for i in range(taps))


def _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K, seeds,
             dilations, rate):
  """(logit [K, B, T] float32, the pre-activations of the layers)."""
  rate_of = lambda layer: 0.0 if seeds is None else rate
  seed_of = lambda layer: None if seeds is None else seeds[layer]
  pre, xd = _first_forward(k_BTKD, v_BTKD, words_KBTW, weights[0], biases[0],
                           _offsets(weights[0].shape[1], dilations[0]), rate_of(0), seed_of(1),
                           rate_of(1))
  pres = [pre]
  for layer in range(1, len(weights)):
    last = layer == len(weights) - 1
    pre, xd = _forward_layer(
        xd, weights[layer], biases[layer], _offsets(weights[layer].shape[1], dilations[layer]),
        None if last else seed_of(layer + 1), 0.0 if last else rate_of(layer + 1),
        (proj_weight_KC, proj_bias_K) if last else None)
    pres.append(pre)
  return xd, pres


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _router_cnn(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K, seeds,
                dilations, rate):
  return _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K,
                  seeds, dilations, rate)[0]


def _router_cnn_fwd(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC, proj_bias_K,
                    seeds, dilations, rate):
  logit_KBT, pres = _forward(k_BTKD, v_BTKD, words_KBTW, weights, biases, proj_weight_KC,
                             proj_bias_K, seeds, dilations, rate)
  # Kept: the pre-activations. The later layers' dropped inputs are recomputed from them in the
  # backward (one XLA pass each): keeping them too measured slower in the training step, whose
  # layer loop copies every kept activation in and out of its stacked buffers.
  pres = tuple(checkpoint_name(pre, ROUTER_ACTIVATION) for pre in pres)
  return logit_KBT, (k_BTKD, v_BTKD, words_KBTW, pres, weights, biases, proj_weight_KC,
                     proj_bias_K, seeds)


def _dropped_activation(pre_KBTC, seed_words, rate):
  """drop(silu(pre)) as the forward kernels compute it (rounded to pre's dtype before the
  dropout's scaling, the mask of seed_words = (s0, s1, row offset, 0))."""
  act = jax.nn.silu(pre_KBTC.astype(jnp.float32)).astype(pre_KBTC.dtype)
  if seed_words is None or not rate:
    return act
  keep = counter_hash.keep_mask(seed_words[:2], pre_KBTC.shape, rate, layout="KBTC",
                                row_offset=seed_words[2])
  return jnp.where(keep, act.astype(jnp.float32) / (1.0 - rate), 0.0).astype(pre_KBTC.dtype)


def _router_cnn_bwd(dilations, rate, residuals, dlogit_KBT):
  (k_BTKD, v_BTKD, words_KBTW, pres, weights, biases, proj_weight_KC, proj_bias_K,
   seeds) = residuals
  dtype = pres[0].dtype
  pre_last = pres[-1].astype(jnp.float32)
  act_last = jax.nn.silu(pre_last).astype(dtype).astype(jnp.float32)
  dproj_weight = jnp.einsum("kbt,kbto->ko", dlogit_KBT, act_last)
  dproj_bias = jnp.sum(dlogit_KBT, axis=(1, 2))
  wp = proj_weight_KC.astype(dtype).astype(jnp.float32)
  dpre = ((dlogit_KBT[..., None] * wp[:, None, None, :]) * _silu_grad(pre_last)).astype(dtype)
  dweights, dbiases = [], []
  layer_rate = 0.0 if seeds is None else rate
  for layer in reversed(range(len(weights))):
    offsets = _offsets(weights[layer].shape[1], dilations[layer])
    dbiases.append(jnp.sum(dpre.astype(jnp.float32), axis=(1, 2)).astype(biases[layer].dtype))
    if layer == 0:
      dweights.append(_first_weight_grad(k_BTKD, v_BTKD, words_KBTW, dpre, offsets,
                                         layer_rate).astype(weights[0].dtype))
      dk_BTKD, dv_BTKD = _first_input_grad(dpre, weights[0], words_KBTW, offsets, layer_rate)
      break
    xd = _dropped_activation(pres[layer - 1], None if seeds is None else seeds[layer], rate)
    dweights.append(_weight_grad(xd, dpre, offsets).astype(weights[layer].dtype))
    dpre = _input_grad(dpre, weights[layer], offsets, pres[layer - 1],
                       None if seeds is None else seeds[layer], layer_rate)
  zero_grad = lambda x: None if x is None else jnp.zeros(x.shape, jax.dtypes.float0)
  return (dk_BTKD.astype(k_BTKD.dtype), dv_BTKD.astype(v_BTKD.dtype), zero_grad(words_KBTW),
          tuple(reversed(dweights)), tuple(reversed(dbiases)),
          dproj_weight.astype(proj_weight_KC.dtype), dproj_bias.astype(proj_bias_K.dtype),
          zero_grad(seeds))


_router_cnn.defvjp(_router_cnn_fwd, _router_cnn_bwd)


def router_logits(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, *,
                  dilations, rate, row_offset=0):
  """logit [B, T, K] float32 of the router's CNN over concat(k, v).

  seeds: uint32 [L, 2], each layer's dropout seed words, or None: no dropout. row_offset: the
  global index of row 0 (see counter_hash.keep_mask)."""
  check_supported(k_BTKD, weights)
  words_KBTW = None
  if seeds is not None:  # per layer: the seed words, the row offset, padding to 4 words
    offsets_L1 = jnp.broadcast_to(jnp.asarray(row_offset).astype(jnp.uint32), (seeds.shape[0], 1))
    seeds = jnp.concatenate([seeds.astype(jnp.uint32), offsets_L1, jnp.zeros_like(offsets_L1)],
                            axis=1)
    batch, length, heads, head_dim = k_BTKD.shape
    # The first layer's keep bits, drawn once and kept for the backward (1 bit an element).
    words_KBTW = checkpoint_name(
        packed_keep_bits(seeds[0], (heads, batch, length, 2 * head_dim), rate), ROUTER_ACTIVATION)
  logit_KBT = _router_cnn(k_BTKD, v_BTKD, words_KBTW, tuple(weights), tuple(biases),
                          proj_weight_KC, proj_bias_K, seeds, tuple(dilations), float(rate))
  # Kept by the remat policy too: the scores' backward (the sigmoid) reads the logits, which a
  # recomputation would otherwise get by running every forward kernel again.
  return jnp.transpose(checkpoint_name(logit_KBT, ROUTER_ACTIVATION), (1, 2, 0))
