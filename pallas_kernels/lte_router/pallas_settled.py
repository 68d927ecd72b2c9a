"""The router's logit of one token per row as a single Pallas (Triton) kernel, for decoding.

A decoding step scores the token that has just received its right context (§5.4): the centre of a
span of S = 2 margin + 1 ring tokens, where margin is the CNN's receptive half-width (the sum of
(taps // 2) * dilation over its layers). The training version (pallas.py, or XLA) computes every
layer at every position of the span, ~15 small launches per layer and step. Only a cone of
positions reaches the centre: the last layer at the centre, each earlier layer at the positions
its successor's taps read (5 and 3 of the 13 for the paper's three layers of 3 taps and dilation
2). This kernel computes that cone from the span, one program per (KV head, block of rows): the
taps as small matmuls over the weights of its head, each layer's bias, padding mask and SiLU, and
the projection, with the rounding points of reference.head_conv (each tap's product in the input's
dtype, their sum in float32 rounded to it, then the bias).

The projection's bias is left to the caller, which fuses it into the score's elementwise work.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.pallas_common import (
    MIN_DOT_DIM, interpret_mode, is_power_of_two, kernel_dot, round_up,
    triton_compiler_params)

BLOCK_ROWS = 16  # rows per program: the smallest tile of a Triton dot
NUM_WARPS = 4


def receptive_half_width(taps: tuple[int, ...], dilations: tuple[int, ...]) -> int:
  """How many tokens on each side of a position its router logit reads."""
  return sum((t // 2) * d for t, d in zip(taps, dilations))


def cone(taps: tuple[int, ...], dilations: tuple[int, ...], center: int
         ) -> tuple[tuple[int, ...], ...]:
  """The span positions each layer's input must hold for the last layer's output at `center`:
  entry l lists layer l's input positions (entry 0: the span tokens read), entry L the centre."""
  needed = [(center,)]
  for t, d in zip(reversed(taps), reversed(dilations)):
    half = (t // 2) * d
    needed.append(tuple(sorted({p + i * d - half for p in needed[-1] for i in range(t)})))
  return tuple(reversed(needed))


def check_supported(x_KSBC: jax.Array, weights: tuple[jax.Array, ...]) -> None:
  """NotImplementedError for widths and dtypes the kernel does not handle."""
  for weight_KICO in weights:
    for width in weight_KICO.shape[2:]:
      if width < MIN_DOT_DIM or not is_power_of_two(width):
        raise NotImplementedError(f"lte_router settled logit[pallas]: conv width {width} must be"
                                  f" a power of two >= {MIN_DOT_DIM}")
  if jnp.dtype(x_KSBC.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"lte_router settled logit[pallas]: dtype {x_KSBC.dtype}")


def _kernel(x_ref, real_ref, *refs, taps, dilations, positions):
  # x_ref [S, rows, C0]: the span's masked inputs of this head; real_ref [S, rows]: 1 at real
  # tokens; then per layer a weight [taps, C_in, C_out] and a bias [C_out], the projection's
  # weight [C_L], and the output [rows].
  num_layers = len(taps)
  weight_refs, bias_refs = refs[:num_layers], refs[num_layers:2 * num_layers]
  proj_ref, out_ref = refs[2 * num_layers:]
  dtype = x_ref.dtype
  exact = dtype == jnp.float32
  acts = {p: x_ref[p] for p in positions[0]}
  for layer in range(num_layers):
    half = (taps[layer] // 2) * dilations[layer]
    bias_O = bias_refs[layer][...].astype(dtype)
    outputs = {}
    for p in positions[layer + 1]:
      acc_RO = None
      for i in range(taps[layer]):
        term_RO = kernel_dot(acts[p + i * dilations[layer] - half], weight_refs[layer][i],
                             exact=exact).astype(dtype).astype(jnp.float32)
        acc_RO = term_RO if acc_RO is None else acc_RO + term_RO
      pre_RO = (acc_RO.astype(dtype) + bias_O[None, :]) * real_ref[p][:, None]
      pre_RO = pre_RO.astype(jnp.float32)
      outputs[p] = (pre_RO * jax.nn.sigmoid(pre_RO)).astype(dtype)
    acts = outputs
  (last_RC,) = acts.values()
  out_ref[...] = jnp.sum(last_RC.astype(jnp.float32)
                         * proj_ref[...].astype(dtype).astype(jnp.float32)[None, :], axis=1)


def settled_logit(x_KSBC: jax.Array, real_SB: jax.Array, weights, biases,
                  proj_weight_KC: jax.Array, *, dilations: tuple[int, ...]) -> jax.Array:
  """float32 [K, B]: the projection (without its bias) at the span's centre.

  x_KSBC: [K, S, B, C0] the span's inputs (zeros at padding), heads first then positions;
  real_SB: [S, B] in x's dtype, 1 at real tokens. S = 2 * receptive_half_width + 1.
  """
  heads, span, batch, _ = x_KSBC.shape
  taps = tuple(w.shape[1] for w in weights)
  margin = receptive_half_width(taps, dilations)
  if span != 2 * margin + 1:
    raise ValueError(f"lte_router settled logit: span {span}, expected {2 * margin + 1} (twice"
                     f" the receptive half-width {margin}, plus one)")
  # Each program reads the span's positions one by one (an index, not a tile), so the span needs
  # no padding; the rows are padded to whole blocks (a single prompt decodes as 2 rows).
  rows = round_up(batch, BLOCK_ROWS)
  x_KSBC = jnp.pad(x_KSBC, ((0, 0), (0, 0), (0, rows - batch), (0, 0)))
  real_SB = jnp.pad(real_SB.astype(x_KSBC.dtype), ((0, 0), (0, rows - batch)))
  full = lambda shape: pl.BlockSpec((None,) + shape, lambda k, r: (k,) + (0,) * len(shape))
  logit_KB = pl.pallas_call(
      functools.partial(_kernel, taps=taps, dilations=tuple(dilations),
                        positions=cone(taps, tuple(dilations), margin)),
      grid=(heads, rows // BLOCK_ROWS),
      in_specs=[pl.BlockSpec((None, span, BLOCK_ROWS, x_KSBC.shape[3]),
                             lambda k, r: (k, 0, r, 0)),
                pl.BlockSpec((span, BLOCK_ROWS), lambda k, r: (0, r))]
               + [full(w.shape[1:]) for w in weights] + [full(b.shape[1:]) for b in biases]
               + [full(proj_weight_KC.shape[1:])],
      out_specs=pl.BlockSpec((None, BLOCK_ROWS), lambda k, r: (k, r)),
      out_shape=jax.ShapeDtypeStruct((heads, rows), jnp.float32),
      compiler_params=triton_compiler_params(NUM_WARPS, 1),
      interpret=interpret_mode(),
      name="lte_router_settled",
  )(x_KSBC, real_SB, *(w.astype(x_KSBC.dtype) for w in weights), *biases, proj_weight_KC)
  return logit_KB[:, :batch]
