"""The LTE router's CNN as Pallas (Triton) kernels: every conv layer fused with its neighbours'
elementwise work, forward and backward, one pass over each activation.

The router (reference.py) is, per KV head, L layers xd_l = drop_l(x_{l-1}), pre_l = conv_l(xd_l)
+ b_l, x_l = silu(pre_l), then logit = x_L . w_p + b_p. XLA runs each of these as its own pass
over HBM (and the dropout's hash in several of them). Here:

- forward, one kernel that builds the first layer's dropped input xd_1 = drop(concat(k, v)),
  heads first, from k and v in their [B, T, K, D] layout (the transpose, the concatenation and
  the mask in one pass); then one kernel per layer: the conv of xd_l from its rows at each tap's
  offset (masked loads; rows outside [0, T) read zeros: the 'same' padding), the bias, and in
  the epilogue the next layer's dropped input xd_{l+1} = drop(silu(pre_l)) with its mask hashed
  once per element (the counter hash of counter_hash.py: the same bits as XLA's mask), or for
  the last layer the projection's logit;
- backward, one kernel per layer for the input gradient, the same convolution of d pre_l with the
  taps transposed and their offsets negated, whose epilogue applies layer l's dropout mask and
  the SiLU derivative at pre_{l-1}: it writes d pre_{l-1} directly (the first layer's writes dk
  and dv in their [B, T, K, D] layout with the first mask applied), and per program the column
  sums of its rows of d pre_l (the bias gradient's partial sums); and one kernel per layer for
  the weight gradient (x[t + offset_i]^T d pre[t] summed per chunk of tokens, the chunks added by
  XLA). The projection's gradients and the last layer's d pre are XLA reductions and one
  elementwise pass over the narrowest activation.

The forward keeps pre_l and xd_l (l > 1) for the backward (named ROUTER_ACTIVATION, which the
remat policy "attention" saves), so a recomputation runs no convolution and the backward no
dropout mask.
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
NUM_WARPS = 4


def check_supported(k_BTKD: jax.Array, weights: tuple[jax.Array, ...]) -> None:
  """NotImplementedError for widths and dtypes the kernels do not handle."""
  depth = k_BTKD.shape[-1]  # the first layer's kernels read k and v apart
  if depth < MIN_DOT_DIM or not is_power_of_two(depth):
    raise NotImplementedError(f"lte_router[pallas]: head dim {depth} must be a power of two >="
                              f" {MIN_DOT_DIM}")
  for weight_KICO in weights:
    for name, width in (("input channels", weight_KICO.shape[2]),
                        ("output channels", weight_KICO.shape[3])):
      if width < MIN_DOT_DIM or not is_power_of_two(width):
        raise NotImplementedError(f"lte_router[pallas]: conv {name} {width} must be a power of"
                                  f" two >= {MIN_DOT_DIM}")
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


def _keep(seed_ref, first_row, width, *, length, rate, channels=None, first_channel=0):
  """bool [BLOCK_T, width]: counter_hash.keep_mask's bits for the program's rows of (head, row),
  heads-first layout (token (row_offset + b) * T + t, unit head * channels + channel, for the
  channels first_channel + [0, width) of `channels`, default width); seed_ref holds the seed
  words and the row offset."""
  head, row = pl.program_id(0), pl.program_id(1)
  global_row = row.astype(jnp.uint32) + seed_ref[2]
  token_R1 = (global_row * jnp.uint32(length)
              + (first_row + jnp.arange(BLOCK_T, dtype=jnp.int32)).astype(jnp.uint32))[:, None]
  channels = width if channels is None else channels
  unit_1C = (head * channels + first_channel
             + jnp.arange(width, dtype=jnp.int32)).astype(jnp.uint32)[None, :]
  token_hash_R1 = counter_hash.mix32(token_R1 ^ seed_ref[0]) ^ seed_ref[1]
  bits_RC = counter_hash.mix32(token_hash_R1 + unit_1C * counter_hash.GOLDEN)
  return bits_RC >= counter_hash.keep_threshold(rate)


def _conv_sum(x_ref, w_ref, first_row, offsets, length, transpose_taps=False, channels=None):
  """float32 [BLOCK_T, O] (or [BLOCK_T, C] with transpose_taps): sum_i x[t + offset_i] W_i.
  channels: (first, count) of the weights' input channels to use (transpose_taps only)."""
  exact = x_ref.dtype == jnp.float32
  acc = None
  for i, offset in enumerate(offsets):
    w = w_ref[i] if channels is None else w_ref[i, pl.ds(*channels), :]
    term = kernel_dot(_rows(x_ref, first_row, offset, length), w, exact=exact,
                      trans_b=transpose_taps)
    acc = term if acc is None else acc + term
  return acc


def _silu_grad(pre):
  sig = jax.nn.sigmoid(pre)
  return sig * (1.0 + pre * (1.0 - sig))


def _dropped_input_kernel(*refs, length, rate):
  """Grid (head, row, tile): xd_1 = drop(concat(k, v)) of the tile, heads first."""
  k_ref, v_ref, out_ref = refs[0], refs[1], refs[-1]
  first_row = pl.program_id(2) * BLOCK_T
  depth = k_ref.shape[-1]
  for half, source_ref in enumerate((k_ref, v_ref)):
    x_RD = _rows(source_ref, first_row, 0, length)
    if rate:
      keep_RD = _keep(refs[2], first_row, depth, length=length, rate=rate, channels=2 * depth,
                      first_channel=half * depth)
      x_RD = jnp.where(keep_RD, x_RD.astype(jnp.float32) / (1.0 - rate), 0.0)
    out_ref[:, pl.ds(half * depth, depth)] = x_RD.astype(out_ref.dtype)


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


def _input_grad_kernel(*refs, offsets, length, rate, first_layer):
  """Grid (head, row, tile): the column sums of the tile's rows of d pre_l, and d pre_{l-1} of
  the tile, or for the first layer dk and dv (through the first layer's dropout)."""
  dpre_ref, w_ref = refs[:2]
  first_row = pl.program_id(2) * BLOCK_T
  dbias_ref = refs[-1]
  dbias_ref[...] = jnp.sum(_rows(dpre_ref, first_row, 0, length).astype(jnp.float32), axis=0)
  if first_layer:  # refs: dpre, w, [seed,] dk, dv, dbias
    depth = w_ref.shape[1] // 2
    for half, out_ref in enumerate(refs[-3:-1]):
      dx_RD = _conv_sum(dpre_ref, w_ref, first_row, offsets, length, transpose_taps=True,
                        channels=(half * depth, depth))
      if rate:
        keep_RD = _keep(refs[2], first_row, depth, length=length, rate=rate,
                        channels=2 * depth, first_channel=half * depth)
        dx_RD = jnp.where(keep_RD, dx_RD / (1.0 - rate), 0.0)
      out_ref[...] = dx_RD.astype(out_ref.dtype)
    return
  out_ref = refs[-2]  # refs: dpre, w, prev_pre, [seed,] dpre_{l-1}, dbias
  dx_RC = _conv_sum(dpre_ref, w_ref, first_row, offsets, length, transpose_taps=True)
  if rate:
    keep_RC = _keep(refs[3], first_row, dx_RC.shape[1], length=length, rate=rate)
    dx_RC = jnp.where(keep_RC, dx_RC / (1.0 - rate), 0.0)
  prev_pre_RC = _rows(refs[2], first_row, 0, length).astype(jnp.float32)
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


def _row_spec(length, width):
  return pl.BlockSpec((None, None, length, width), lambda k, b, j: (k, b, 0, 0))


def _tile_spec(width):
  return pl.BlockSpec((None, None, BLOCK_T, width), lambda k, b, j: (k, b, j, 0))


def _token_major_row_spec(length, depth):
  """The [T, D] rows of (head, row) of a [B, T, K, D] array."""
  return pl.BlockSpec((None, length, None, depth), lambda k, b, j: (b, 0, k, 0))


def _token_major_tile_spec(depth):
  return pl.BlockSpec((None, BLOCK_T, None, depth), lambda k, b, j: (b, j, k, 0))


_SEED_SPEC = pl.BlockSpec((4,), lambda k, b, j: (0,))  # seed words, row offset, unused


def _call(kernel, name, grid, in_specs, out_specs, out_shape, *inputs):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=triton_compiler_params(NUM_WARPS, 2), interpret=interpret_mode(),
      name=name)(*inputs)


def _dropped_input(k_BTKD, v_BTKD, seed, rate):
  """xd_1 [K, B, T, 2D]: concat(k, v) per head, heads first, through the first layer's
  dropout (seed None or rate 0: none)."""
  batch, length, heads, depth = k_BTKD.shape
  tiles = cdiv(length, BLOCK_T)
  in_specs = [_token_major_row_spec(length, depth)] * 2
  inputs = [k_BTKD, v_BTKD]
  rate = 0.0 if seed is None else rate
  if rate:
    in_specs.append(_SEED_SPEC)
    inputs.append(seed)
  out = _call(functools.partial(_dropped_input_kernel, length=length, rate=rate),
              "lte_router_dropped_input", (heads, batch, tiles), in_specs,
              _tile_spec(2 * depth),
              jax.ShapeDtypeStruct((heads, batch, tiles * BLOCK_T, 2 * depth), k_BTKD.dtype),
              *inputs)
  return out[:, :, :length]


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
  """(input gradients, d b_l float32 [K, O]): the input gradients are (d pre_{l-1} [K, B, T, C],)
  in dpre's dtype, or with prev_pre None (the first layer) (dk, dv [B, T, K, C / 2]) through the
  first layer's dropout."""
  heads, batch, length, c_out = dpre_KBTO.shape
  taps, channels = weight_KICO.shape[1], weight_KICO.shape[2]
  tiles = cdiv(length, BLOCK_T)
  dtype = dpre_KBTO.dtype
  in_specs = [_row_spec(length, c_out),
              pl.BlockSpec((None, taps, channels, c_out), lambda k, b, j: (k, 0, 0, 0))]
  inputs = [dpre_KBTO, weight_KICO.astype(dtype)]
  if prev_pre is None:
    depth = channels // 2
    out_specs = [_token_major_tile_spec(depth)] * 2
    out_shape = [jax.ShapeDtypeStruct((batch, tiles * BLOCK_T, heads, depth), dtype)] * 2
  else:
    in_specs.append(_row_spec(length, channels))
    inputs.append(prev_pre)
    out_specs = [_tile_spec(channels)]
    out_shape = [jax.ShapeDtypeStruct((heads, batch, tiles * BLOCK_T, channels), dtype)]
  if rate:
    in_specs.append(_SEED_SPEC)
    inputs.append(seed)
  out_specs.append(pl.BlockSpec((None, None, None, c_out), lambda k, b, j: (k, b, j, 0)))
  out_shape.append(jax.ShapeDtypeStruct((heads, batch, tiles, c_out), jnp.float32))
  *grads, dbias_partial = _call(
      functools.partial(_input_grad_kernel, offsets=tuple(-o for o in offsets), length=length,
                        rate=rate, first_layer=prev_pre is None),
      "lte_router_input_grad", (heads, batch, tiles), in_specs, out_specs, out_shape, *inputs)
  dbias_KO = jnp.sum(dbias_partial, axis=(1, 2))
  if prev_pre is None:
    return (grads[0][:, :length], grads[1][:, :length]), dbias_KO
  return (grads[0][:, :, :length],), dbias_KO


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


def _forward(xd_KBTC, weights, biases, proj_weight_KC, proj_bias_K, seeds, dilations, rate):
  """(logit [K, B, T] float32, residuals: (xd_l, pre_l) per layer)."""
  activations = []
  for layer, (weight, bias, dilation) in enumerate(zip(weights, biases, dilations)):
    last = layer == len(weights) - 1
    pre, second = _forward_layer(
        xd_KBTC, weight, bias, _offsets(weight.shape[1], dilation),
        None if last or seeds is None else seeds[layer + 1], 0.0 if seeds is None else rate,
        (proj_weight_KC, proj_bias_K) if last else None)
    activations.append((xd_KBTC, pre))
    xd_KBTC = second
  return xd_KBTC, activations


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _router_cnn(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, dilations,
                rate):
  return _router_cnn_fwd(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds,
                         dilations, rate)[0]


def _router_cnn_fwd(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds,
                    dilations, rate):
  # xd_1 is not named: a remat policy that saves the router's activations recomputes it from k
  # and v (one pass) rather than keeping the widest of them.
  xd_KBTC = _dropped_input(k_BTKD, v_BTKD, None if seeds is None else seeds[0], rate)
  logit_KBT, activations = _forward(xd_KBTC, weights, biases, proj_weight_KC, proj_bias_K, seeds,
                                    dilations, rate)
  # Kept: the pre-activations and the later layers' dropped inputs, which the forward kernels
  # write anyway (each layer's second output). The backward recomputed those inputs in XLA until
  # 2026-11-30 (a SiLU, the dropout's hash and a select per element); reading them made the
  # lalte-0.4b step 0.992x (H200, 8 sequences). Keeping them had measured slower only while the
  # step scanned its layer groups and copied every kept activation through their stacked
  # buffers (2026-11-29); the step runs them unrolled now.
  kept = tuple((checkpoint_name(xd, ROUTER_ACTIVATION) if layer else None,
                checkpoint_name(pre, ROUTER_ACTIVATION))
               for layer, (xd, pre) in enumerate(activations))
  return logit_KBT, (xd_KBTC, kept, weights, biases, proj_weight_KC, proj_bias_K, seeds)


def _router_cnn_bwd(dilations, rate, residuals, dlogit_KBT):
  xd_KBTC, kept, weights, biases, proj_weight_KC, proj_bias_K, seeds = residuals
  activations = [(xd_KBTC, kept[0][1])] + list(kept[1:])
  dtype = activations[0][0].dtype
  pre_last = activations[-1][1].astype(jnp.float32)
  act_last = jax.nn.silu(pre_last).astype(dtype).astype(jnp.float32)
  dproj_weight = jnp.einsum("kbt,kbto->ko", dlogit_KBT, act_last)
  dproj_bias = jnp.sum(dlogit_KBT, axis=(1, 2))
  wp = proj_weight_KC.astype(dtype).astype(jnp.float32)
  dpre = ((dlogit_KBT[..., None] * wp[:, None, None, :]) * _silu_grad(pre_last)).astype(dtype)
  dweights, dbiases = [], []
  for layer in reversed(range(len(weights))):
    xd, _ = activations[layer]
    offsets = _offsets(weights[layer].shape[1], dilations[layer])
    dweights.append(_weight_grad(xd, dpre, offsets).astype(weights[layer].dtype))
    prev_pre = None if layer == 0 else activations[layer - 1][1]
    input_grads, dbias = _input_grad(dpre, weights[layer], offsets, prev_pre,
                                     None if seeds is None else seeds[layer],
                                     0.0 if seeds is None else rate)
    dbiases.append(dbias.astype(biases[layer].dtype))
    dpre = input_grads[0]
  dk_BTKD, dv_BTKD = input_grads  # the first layer's
  seeds_grad = None if seeds is None else jnp.zeros(seeds.shape, jax.dtypes.float0)
  return (dk_BTKD, dv_BTKD, tuple(reversed(dweights)), tuple(reversed(dbiases)),
          dproj_weight.astype(proj_weight_KC.dtype), dproj_bias.astype(proj_bias_K.dtype),
          seeds_grad)


_router_cnn.defvjp(_router_cnn_fwd, _router_cnn_bwd)


def router_logits(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, *,
                  dilations, rate, row_offset=0):
  """logit [K, B, T] float32 of the router's CNN over concat(k, v) per head ([B, T, K, D]
  each).

  seeds: uint32 [L, 2], each layer's dropout seed words, or None: no dropout. row_offset: the
  global index of row 0 (see counter_hash.keep_mask)."""
  check_supported(k_BTKD, weights)
  if seeds is not None:  # per layer: the seed words, the row offset, padding to 4 words
    offsets_L1 = jnp.broadcast_to(jnp.asarray(row_offset).astype(jnp.uint32), (seeds.shape[0], 1))
    seeds = jnp.concatenate([seeds.astype(jnp.uint32), offsets_L1, jnp.zeros_like(offsets_L1)],
                            axis=1)
  logit_KBT = _router_cnn(k_BTKD, v_BTKD, tuple(weights), tuple(biases), proj_weight_KC,
                          proj_bias_K, seeds, tuple(dilations), float(rate))
  # Kept by the remat policy too: the scores' backward (the sigmoid) reads the logits, which a
  # recomputation would otherwise get by running every forward kernel again.
  return checkpoint_name(logit_KBT, ROUTER_ACTIVATION)
