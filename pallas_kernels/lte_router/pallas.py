"""The whole LTE router, forward and backward, each as one Pallas (Triton) kernel.

XLA runs the router (reference.py) as a chain of passes over HBM per conv layer: the dropout's
select, a batched matmul writing every tap's output, their shifted sum, the bias and the SiLU;
and its backward transposes each, with weight gradients that contract all B x T tokens in a few
long matmuls. Here a program holds a window of WINDOW consecutive tokens of one (row, KV head)
and runs every layer on it in registers: the tokens it owns plus the router's reach on either
side (its margin M, 6 for the paper's three kernel-3 dilation-2 layers), so no layer's output
leaves the chip.

A conv tap reads the layer's input `offset` rows away. Triton cannot move values between the rows
of a register tile, so a shift is a matmul with a 0/1 matrix, S[r, c] = (c == r + offset): exact
(one product per output) and cheap on tensor cores next to the layer's own matmuls. Rows shifted
in from beyond the window are zeros, so a layer's output is right only where its receptive field
lies inside the window: M rows in from each side after the last layer. The forward kernel owns
WINDOW - 2M tokens per program; the backward kernel, whose gradients reach M further, owns
WINDOW - 4M, recomputes the forward on its window and writes the key and value gradients of its
own tokens. Its weight and bias gradients sum its own tokens only (each token once over the
grid): a program walks a chunk of consecutive windows and accumulates them into its own slot,
which XLA sums over the slots (`_chunking`: about two programs per SM).

The dropout masks come from the counter hash (pallas_kernels/counter_hash.py), drawn once per
layer and window from the elements' indices: the same bits as the XLA version draws. Tokens
outside [0, T) are zero padding at every layer, as 'same' zero padding is.

Off the GPU (interpret mode) the inputs get a front and back margin of zeros, since interpret mode
cannot read a block that starts before a buffer; on the GPU the out-of-range rows are masked loads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import counter_hash
from pallas_kernels.pallas_common import (MIN_DOT_DIM, cdiv, interpret_mode, is_power_of_two,
                                          save_kernel_outputs, triton_compiler_params)

WINDOW = 128          # tokens a program holds (its own plus the margins)
NUM_WARPS_FORWARD = 4
NUM_WARPS_BACKWARD = 8
PROGRAMS_PER_SM = 2   # the backward's chunking aims at this many programs per SM ...
NUM_SMS = 132         # ... of an H100 / H200 (more programs cost more weight-gradient slots)


@dataclasses.dataclass(frozen=True)
class RouterShape:
  """The router's static structure: taps and dilation per conv layer, the channel widths (the
  input 2D, then each layer's output)."""
  taps: tuple[int, ...]
  dilations: tuple[int, ...]
  widths: tuple[int, ...]

  @property
  def margin(self) -> int:
    return sum((k // 2) * d for k, d in zip(self.taps, self.dilations))

  def offsets(self, layer: int) -> list[int]:
    """Row offsets of the layer's taps: out[t] reads in[t + offset]."""
    half = self.taps[layer] // 2
    return [(i - half) * self.dilations[layer] for i in range(self.taps[layer])]


def unsupported(shape: RouterShape) -> str | None:
  """Why the kernels do not tile this router, or None when they do."""
  if any(width < MIN_DOT_DIM or not is_power_of_two(width) for width in shape.widths):
    return f"channel widths {shape.widths} must be powers of two >= {MIN_DOT_DIM}"
  if WINDOW - 4 * shape.margin < WINDOW // 2:
    return (f"the router's reach {shape.margin} leaves a {WINDOW}-token window too few tokens"
            " of its own")
  return None


def router_shape(conv_weights, dilations) -> RouterShape:
  return RouterShape(taps=tuple(w.shape[1] for w in conv_weights), dilations=tuple(dilations),
                     widths=(conv_weights[0].shape[2],) + tuple(w.shape[3] for w in conv_weights))


def _dot(a, b, contract):
  """a . b over `contract` ((a's dim,), (b's dim,)), float32 accumulation; float32 operands at
  full precision (the shift matrices must move values exactly)."""
  exact = a.dtype == jnp.float32
  return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32,
                         precision=lax.Precision.HIGHEST if exact else None)


def _shift(y_RO, offset: int):
  """out[r] = y[r + offset] (zeros past the window's ends), float32."""
  if offset == 0:
    return y_RO.astype(jnp.float32)
  rows = y_RO.shape[0]
  target_R1 = lax.broadcasted_iota(jnp.int32, (rows, rows), 0) + offset
  source_1R = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
  return _dot((source_1R == target_R1).astype(y_RO.dtype), y_RO, ((1,), (0,)))


def _keep(token_R1, unit_1C, seed_ref, layer, rate):
  bits = counter_hash.element_bits(token_R1, unit_1C, seed_ref[layer, 0], seed_ref[layer, 1])
  return bits >= counter_hash.keep_threshold(rate)


def _apply_dropout(x_RC, keep_RC, rate):
  """Inverted dropout (the backward applies the same to the gradient), in x's dtype."""
  if keep_RC is None:
    return x_RC
  return jnp.where(keep_RC, (x_RC.astype(jnp.float32) * (1.0 / (1.0 - rate))).astype(x_RC.dtype),
                   0).astype(x_RC.dtype)


@dataclasses.dataclass
class _Window:
  """One window's forward values: per layer its dropped input (a list of channel parts: keys and
  values for the first layer), the parts' dropout masks and its pre-activation (the compute
  dtype); the last layer's output and the score logits."""
  inputs: list
  keeps: list
  pre: list
  last_RC: jax.Array
  logit_R: jax.Array
  in_range_R1: jax.Array


def _window_forward(k_ref, v_ref, layer_refs, proj_w_ref, proj_b_ref, seed_ref, row, kv, first,
                    *, shape: RouterShape, length: int, rate: float, front: int) -> _Window:
  """The router over tokens [first, first + WINDOW) of (row, kv)."""
  head_dim = shape.widths[0] // 2
  token_R = first + lax.broadcasted_iota(jnp.int32, (WINDOW,), 0)
  in_range_R1 = ((token_R >= 0) & (token_R < length))[:, None]
  load_mask = jnp.broadcast_to(in_range_R1, (WINDOW, head_dim))
  parts = [plgpu.load(ref.at[row, pl.ds(first + front, WINDOW), kv, :], mask=load_mask, other=0)
           for ref in (k_ref, v_ref)]
  dtype = parts[0].dtype
  hashed_R1 = (row * length + token_R).astype(jnp.uint32)[:, None]
  # The parts' first channel: unit kv * C + channel of the layer's input (keys, then values).
  part_starts = [0, head_dim]
  inputs, keeps, pres = [], [], []
  h_RC = None
  for layer, offsets in enumerate(shape.offsets(l) for l in range(len(shape.taps))):
    width, c_out = shape.widths[layer], shape.widths[layer + 1]
    if layer > 0:
      parts, part_starts = [h_RC], [0]
    layer_keeps = []
    for p, (part, start) in enumerate(zip(parts, part_starts)):
      keep = None
      if rate > 0.0:
        unit_1C = (kv * width + start + lax.broadcasted_iota(jnp.int32, (1, part.shape[1]), 1)
                   ).astype(jnp.uint32)
        keep = _keep(hashed_R1, unit_1C, seed_ref, layer, rate)
      layer_keeps.append(keep)
      parts[p] = _apply_dropout(part, keep, rate)
    w_ref, b_ref = layer_refs[2 * layer], layer_refs[2 * layer + 1]
    conv_RO = jnp.zeros((WINDOW, c_out), jnp.float32)
    for i, offset in enumerate(offsets):
      y_RO = functools.reduce(jnp.add, [
          _dot(part, w_ref[kv, i, pl.ds(start, part.shape[1]), :], ((1,), (0,)))
          for part, start in zip(parts, part_starts)])
      # Each tap's output in the compute dtype, summed in float32 (as reference.py does).
      conv_RO = conv_RO + _shift(y_RO.astype(dtype), offset)
    pre_RO = conv_RO.astype(dtype) + b_ref[kv, :][None, :]
    pre_f = pre_RO.astype(jnp.float32)
    h_RC = jnp.where(in_range_R1, pre_f * jax.nn.sigmoid(pre_f), 0.0).astype(dtype)
    inputs.append(list(parts))
    keeps.append(layer_keeps)
    pres.append(pre_RO)
  proj_1C = proj_w_ref[kv, :][None, :].astype(jnp.float32)
  logit_R = jnp.sum(h_RC.astype(jnp.float32) * proj_1C, axis=1) + jnp.sum(proj_b_ref[kv, :])
  return _Window(inputs, keeps, pres, h_RC, logit_R, in_range_R1)


def _forward_kernel(seed_ref, k_ref, v_ref, *refs, shape, length, rate, front):
  layer_refs, (proj_w_ref, proj_b_ref, score_ref) = refs[:-3], refs[-3:]
  row, kv, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  margin = shape.margin
  owned = WINDOW - 2 * margin
  first = block * owned - margin
  window = _window_forward(k_ref, v_ref, layer_refs, proj_w_ref, proj_b_ref, seed_ref, row, kv,
                           first, shape=shape, length=length, rate=rate, front=front)
  row_R = lax.broadcasted_iota(jnp.int32, (WINDOW,), 0)
  mine_R = (row_R >= margin) & (row_R < margin + owned) & (first + row_R < length)
  plgpu.store(score_ref.at[row, pl.ds(first + front, WINDOW), kv],
              jax.nn.sigmoid(window.logit_R) - 0.5, mask=mine_R)


def _backward_kernel(seed_ref, k_ref, v_ref, dlogit_ref, *refs, shape, length, rate, front,
                     blocks_per_chunk):
  num_layers = len(shape.taps)
  layer_refs = refs[:2 * num_layers]
  proj_w_ref, proj_b_ref, dk_ref, dv_ref = refs[2 * num_layers:2 * num_layers + 4]
  grad_refs = refs[2 * num_layers + 4:]  # per layer dW, db; then d proj_w
  row, kv, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  margin = shape.margin
  owned = WINDOW - 4 * margin
  head_dim = shape.widths[0] // 2
  row_R = lax.broadcasted_iota(jnp.int32, (WINDOW,), 0)

  for ref in grad_refs:  # this program's slot of each weight gradient (power-of-two tiles)
    if ref.ndim == 6:
      for tap in range(ref.shape[3]):
        ref[row, chunk, kv, tap] = jnp.zeros(ref.shape[4:], jnp.float32)
    else:
      ref[row, chunk, kv] = jnp.zeros(ref.shape[3:], jnp.float32)

  def block_step(i, carry):
    first = (chunk * blocks_per_chunk + i) * owned - 2 * margin
    w = _window_forward(k_ref, v_ref, layer_refs, proj_w_ref, proj_b_ref, seed_ref, row, kv,
                        first, shape=shape, length=length, rate=rate, front=front)
    token_R = first + row_R

    def mine(rows_R):  # rows whose tokens this window owns (each token once over the grid)
      return (rows_R >= 2 * margin) & (rows_R < 2 * margin + owned) & (first + rows_R < length)

    # The logits are right on rows [margin, WINDOW - margin) only.
    valid_R = (row_R >= margin) & (row_R < WINDOW - margin) & (token_R >= 0) & (token_R < length)
    dlogit_R = plgpu.load(dlogit_ref.at[row, pl.ds(first + front, WINDOW), kv], mask=valid_R,
                          other=0.0)
    mine_R1 = mine(row_R)[:, None]
    proj_1C = proj_w_ref[kv, :][None, :].astype(jnp.float32)
    grad_refs[-1][row, chunk, kv] += jnp.sum(jnp.where(mine_R1, w.last_RC.astype(jnp.float32) * dlogit_R[:, None],
                                     0.0), axis=0)
    dh_RC = dlogit_R[:, None] * proj_1C
    for layer in reversed(range(num_layers)):
      w_ref = layer_refs[2 * layer]
      dw_ref, db_ref = grad_refs[2 * layer], grad_refs[2 * layer + 1]
      pre_f = w.pre[layer].astype(jnp.float32)
      sig = jax.nn.sigmoid(pre_f)
      dpre_RO = jnp.where(w.in_range_R1, dh_RC * sig * (1.0 + pre_f * (1.0 - sig)), 0.0)
      db_ref[row, chunk, kv] += jnp.sum(jnp.where(mine_R1, dpre_RO, 0.0), axis=0)
      dpre_RO = dpre_RO.astype(w.pre[layer].dtype)
      parts = w.inputs[layer]
      starts = [0, head_dim] if layer == 0 else [0]
      dparts = [jnp.zeros(part.shape, jnp.float32) for part in parts]
      for tap, offset in enumerate(shape.offsets(layer)):
        # g[r] = dpre[r - offset]: the outputs that read row r through this tap.
        g_RO = _shift(dpre_RO, -offset).astype(dpre_RO.dtype)
        g_mine_RO = jnp.where(mine(row_R - offset)[:, None], g_RO, 0)
        for p, (part, start) in enumerate(zip(parts, starts)):
          width = part.shape[1]
          w_CO = w_ref[kv, tap, pl.ds(start, width), :]
          dparts[p] = dparts[p] + _dot(g_RO, w_CO, ((1,), (1,)))
          dw_ref[row, chunk, kv, tap, pl.ds(start, width), :] += _dot(part, g_mine_RO,
                                                                      ((0,), (0,)))
      dparts = [_apply_dropout(d, keep, rate) for d, keep in zip(dparts, w.keeps[layer])]
      if layer > 0:
        dh_RC = dparts[0].astype(jnp.float32)
    store_mask = jnp.broadcast_to(mine_R1, (WINDOW, head_dim))
    for ref, grad in zip((dk_ref, dv_ref), dparts):
      plgpu.store(ref.at[row, pl.ds(first + front, WINDOW), kv, :], grad.astype(ref.dtype),
                  mask=store_mask)
    return carry

  lax.fori_loop(0, blocks_per_chunk, block_step, 0)


def _margins(shape: RouterShape, spread: int) -> tuple[int, int]:
  """(front, back) zero rows around T: none on the GPU (masked loads), enough off it."""
  return (spread * shape.margin, WINDOW) if interpret_mode() else (0, 0)


def _pad_tokens(x, front, back):
  if front == 0 and back == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (front, back)
  return jnp.pad(x, widths)


def _layer_args(conv_weights, conv_biases):
  return [a for pair in zip(conv_weights, conv_biases) for a in pair]


def _forward(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, shape,
             rate):
  batch, length, heads, _ = k_BTKD.shape
  front, back = _margins(shape, 1)
  owned = WINDOW - 2 * shape.margin
  kernel = functools.partial(_forward_kernel, shape=shape, length=length, rate=rate, front=front)
  score = pl.pallas_call(
      kernel,
      grid=(batch, heads, cdiv(length, owned)),
      out_shape=jax.ShapeDtypeStruct((batch, front + length + back, heads), jnp.float32),
      compiler_params=triton_compiler_params(NUM_WARPS_FORWARD, 1),
      interpret=interpret_mode(),
      name="lte_router_fwd",
  )(seed, _pad_tokens(k_BTKD, front, back), _pad_tokens(v_BTKD, front, back),
    *_layer_args(conv_weights, conv_biases), proj_weight, proj_bias[:, None])
  return score[:, front:front + length]


def _chunking(batch: int, heads: int, blocks: int) -> tuple[int, int]:
  """(chunks per (row, head), windows per chunk)."""
  chunks = max(1, min(blocks, cdiv(PROGRAMS_PER_SM * NUM_SMS, batch * heads)))
  per_chunk = cdiv(blocks, chunks)
  return cdiv(blocks, per_chunk), per_chunk


def _backward(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, dlogit_BTK,
              shape, rate):
  batch, length, heads, head_dim = k_BTKD.shape
  front, back = _margins(shape, 2)
  owned = WINDOW - 4 * shape.margin
  chunks, per_chunk = _chunking(batch, heads, cdiv(length, owned))
  back = back + chunks * per_chunk * owned - length if front else 0
  padded = front + length + back
  grad_shapes = []
  for w, b in zip(conv_weights, conv_biases):
    grad_shapes += [jax.ShapeDtypeStruct((batch, chunks) + w.shape, jnp.float32),
                    jax.ShapeDtypeStruct((batch, chunks) + b.shape, jnp.float32)]
  grad_shapes.append(jax.ShapeDtypeStruct((batch, chunks) + proj_weight.shape, jnp.float32))
  kernel = functools.partial(_backward_kernel, shape=shape, length=length, rate=rate,
                             front=front, blocks_per_chunk=per_chunk)
  dk, dv, *grads = pl.pallas_call(
      kernel,
      grid=(batch, heads, chunks),
      out_shape=[jax.ShapeDtypeStruct((batch, padded, heads, head_dim), k_BTKD.dtype),
                 jax.ShapeDtypeStruct((batch, padded, heads, head_dim), v_BTKD.dtype),
                 *grad_shapes],
      compiler_params=triton_compiler_params(NUM_WARPS_BACKWARD, 1),
      interpret=interpret_mode(),
      name="lte_router_bwd",
  )(seed, _pad_tokens(k_BTKD, front, back), _pad_tokens(v_BTKD, front, back),
    _pad_tokens(dlogit_BTK, front, back), *_layer_args(conv_weights, conv_biases), proj_weight,
    proj_bias[:, None])
  grads = [g.sum(axis=(0, 1)) for g in grads]
  return dk[:, front:front + length], dv[:, front:front + length], grads


def _seeds_or_zeros(seeds_L2, num_layers):
  return (jnp.zeros((num_layers, 2), jnp.uint32) if seeds_L2 is None
          else seeds_L2.astype(jnp.uint32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _scores(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, shape, rate):
  return _forward(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, shape,
                  rate)


def _scores_fwd(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, shape,
                rate):
  score_BTK, = save_kernel_outputs(_forward(k_BTKD, v_BTKD, conv_weights, conv_biases,
                                            proj_weight, proj_bias, seed, shape, rate))
  return score_BTK, (k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed,
                     score_BTK)


def _scores_bwd(shape, rate, residuals, dscore_BTK):
  k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seed, score_BTK = residuals
  # score = sigmoid(logit) - 0.5, so d score / d logit = (0.5 + score)(0.5 - score).
  dlogit_BTK = dscore_BTK * (0.5 + score_BTK) * (0.5 - score_BTK)
  dk, dv, grads = _backward(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias,
                            seed, dlogit_BTK, shape, rate)
  num_layers = len(conv_weights)
  d_weights = tuple(g.astype(w.dtype) for g, w in zip(grads[0:2 * num_layers:2], conv_weights))
  d_biases = tuple(g.astype(b.dtype) for g, b in zip(grads[1:2 * num_layers:2], conv_biases))
  d_proj_weight = grads[-1].astype(proj_weight.dtype)
  d_proj_bias = jnp.sum(dlogit_BTK, axis=(0, 1)).astype(proj_bias.dtype)
  return (dk, dv, d_weights, d_biases, d_proj_weight, d_proj_bias,
          np.zeros(seed.shape, jax.dtypes.float0))


_scores.defvjp(_scores_fwd, _scores_bwd)


def router_scores(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight, proj_bias, seeds_L2,
                  *, dilations, rate, mask_BT=None):
  """The router's scores [B, T, Hkv] float32 (reference.router_scores' arguments)."""
  if mask_BT is not None:
    raise NotImplementedError("lte_router pallas: padding masks (prefill) are not tiled")
  dtype = k_BTKD.dtype
  shape = router_shape(conv_weights, dilations)
  reason = unsupported(shape)
  if reason is not None:
    raise NotImplementedError(f"lte_router pallas: {reason}")
  if seeds_L2 is None:
    rate = 0.0
  return _scores(k_BTKD, v_BTKD, tuple(w.astype(dtype) for w in conv_weights),
                 tuple(b.astype(dtype) for b in conv_biases), proj_weight.astype(dtype),
                 proj_bias.astype(jnp.float32), _seeds_or_zeros(seeds_L2, len(conv_weights)),
                 shape, float(rate))
