"""`implementation="pallas"` of `decode_matmul`: a few rows' projection with its prologue (RMSNorm
with the residual add before it, or SwiGLU's product) in one Pallas (Triton backend) kernel.

Each program owns block_n output columns and streams its [K, block_n] slice of the weight in
[block_k, block_n] tiles, multiplying them by the prologue's output for the same block_k inputs:
the inputs are a few rows, so every program recomputes the prologue from them (they stay in L2)
rather than a separate kernel writing it first. An RMSNorm first sums the squares of h's row in
one pass over K; with a residual, program 0 also writes h = x + residual for the next add. The
rows are padded to the dot's 16 by masked loads (zeros) and masked stores, so any M <= 16 runs
without a padded copy. Gradients, rarely wanted at decode, come from the reference through a
custom_vjp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_matmul import reference
from pallas_kernels.pallas_common import (MIN_DOT_DIM, check_launch_fields, dot_nn,
                                          interpret_mode, triton_compiler_params)

__all__ = ["DecodeMatmulConfig", "MAX_ROWS", "decode_matmul"]

# The dot's smallest M, and so the most rows one kernel takes (more rows: use a GEMM).
MAX_ROWS = MIN_DOT_DIM


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
  """block_n: output columns per program; block_k: inputs per step of a program's loop (both the
  largest power of two up to these that divides N, K); num_warps, num_stages: Triton launch
  parameters (num_stages pipelines the weight tiles' loads)."""
  block_n: int = 64
  block_k: int = 256
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_launch_fields(self, power_of_two=lambda name: name.startswith("block"))
    if min(self.block_n, self.block_k) < MIN_DOT_DIM:
      raise ValueError(f"DecodeMatmulConfig: block_n and block_k must be >= {MIN_DOT_DIM}, got"
                       f" {self.block_n}, {self.block_k}")


def _block(size: int, largest: int, what: str) -> int:
  """The largest power of two <= `largest` and >= 16 that divides `size`."""
  block = largest
  while block >= MIN_DOT_DIM:
    if size % block == 0:
      return block
    block //= 2
  raise NotImplementedError(
      f"decode_matmul[pallas]: {what} {size} is not a multiple of {MIN_DOT_DIM}")


def _kernel(*refs, swiglu, has_norm, has_residual, rows, block_n, block_k, key_dim, eps):
  refs = list(refs)
  x_ref = refs.pop(0)
  residual_ref = refs.pop(0) if has_residual else None
  norm_ref = refs.pop(0) if has_norm else None
  w_ref, y_ref = refs.pop(0), refs.pop(0)
  h_ref = refs.pop(0) if has_residual else None
  dtype = y_ref.dtype
  program = pl.program_id(0)  # read here: interpret mode cannot lower it inside the loops
  columns = pl.ds(program * block_n, block_n)
  row_ok_R1 = (jnp.arange(MAX_ROWS) < rows)[:, None]
  row_mask = lambda width: jnp.broadcast_to(row_ok_R1, (MAX_ROWS, width))
  # Rows past the input's: loaded as zeros, never stored.
  load = lambda ref, at: plgpu.load(ref.at[pl.ds(0, MAX_ROWS), at], mask=row_mask(block_k),
                                    other=0.0)
  num_steps = key_dim // block_k

  def h_at(start):  # x + residual in x's dtype, as the unfused add rounds it
    h_RC = load(x_ref, pl.ds(start, block_k))
    if has_residual:
      h_RC = (h_RC.astype(jnp.float32)
              + load(residual_ref, pl.ds(start, block_k)).astype(jnp.float32)).astype(dtype)
    return h_RC

  inverse_rms_R1 = None
  if has_norm:
    def sum_squares(step, sum_R1):
      start = step * block_k
      h_RC = h_at(start)
      if has_residual:
        @pl.when(program == 0)
        def _():
          plgpu.store(h_ref.at[pl.ds(0, MAX_ROWS), pl.ds(start, block_k)], h_RC,
                      mask=row_mask(block_k))
      h32_RC = h_RC.astype(jnp.float32)
      return sum_R1 + jnp.sum(h32_RC * h32_RC, axis=1, keepdims=True)

    sum_R1 = jax.lax.fori_loop(0, num_steps, sum_squares, jnp.zeros((MAX_ROWS, 1), jnp.float32))
    inverse_rms_R1 = jax.lax.rsqrt(sum_R1 / key_dim + eps)

  def activations_at(start):  # the prologue's output for inputs [start, start + block_k)
    if swiglu:
      gate_RC = load(x_ref, pl.ds(start, block_k)).astype(jnp.float32)
      up_RC = load(x_ref, pl.ds(key_dim + start, block_k)).astype(jnp.float32)
      silu_RC = (gate_RC * jax.nn.sigmoid(gate_RC)).astype(dtype).astype(jnp.float32)
      return (silu_RC * up_RC).astype(dtype)
    h_RC = h_at(start)
    if not has_norm:
      return h_RC
    norm_1C = norm_ref[pl.ds(start, block_k)].astype(jnp.float32)[None, :]
    return (h_RC.astype(jnp.float32) * inverse_rms_R1 * norm_1C).astype(dtype)

  def project(step, y_RN):
    start = step * block_k
    w_CN = w_ref[pl.ds(start, block_k), columns]
    return y_RN + dot_nn(activations_at(start).astype(w_CN.dtype), w_CN)

  y_RN = jax.lax.fori_loop(0, num_steps, project, jnp.zeros((MAX_ROWS, block_n), jnp.float32))
  plgpu.store(y_ref.at[pl.ds(0, MAX_ROWS), columns], y_RN.astype(dtype),
              mask=row_mask(block_n))


def _forward(x_MX, w_KN, residual_MK, norm_weight_K, eps, swiglu, config):
  rows = x_MX.shape[0]
  key_dim, width = w_KN.shape
  if rows > MAX_ROWS:
    raise NotImplementedError(f"decode_matmul[pallas]: {rows} rows; at most {MAX_ROWS}")
  if w_KN.dtype != x_MX.dtype:
    raise NotImplementedError(
        f"decode_matmul[pallas]: weight dtype {w_KN.dtype} differs from x's {x_MX.dtype}")
  block_n = _block(width, config.block_n, "N")
  block_k = _block(key_dim, config.block_k, "K")
  has_residual, has_norm = residual_MK is not None, norm_weight_K is not None
  operands = [x_MX] + [residual_MK] * has_residual + [norm_weight_K] * has_norm + [w_KN]
  out_shape = [jax.ShapeDtypeStruct((rows, width), x_MX.dtype)]
  if has_residual:
    out_shape.append(jax.ShapeDtypeStruct((rows, key_dim), x_MX.dtype))
  outputs = pl.pallas_call(
      functools.partial(_kernel, swiglu=swiglu, has_norm=has_norm, has_residual=has_residual,
                        rows=rows, block_n=block_n, block_k=block_k, key_dim=key_dim, eps=eps),
      grid=(width // block_n,),
      in_specs=[pl.no_block_spec] * len(operands),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      compiler_params=triton_compiler_params(config.num_warps, config.num_stages),
      interpret=interpret_mode(),
      name="decode_matmul",
  )(*operands)
  return outputs[0], (outputs[1] if has_residual else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def decode_matmul(x_MX, w_KN, residual_MK, norm_weight_K, eps, swiglu, config):
  """(y [M, N], h [M, K] or None): `reference.decode_matmul` (inputs validated by the entry)."""
  return _forward(x_MX, w_KN, residual_MK, norm_weight_K, eps, swiglu, config)


def _decode_matmul_fwd(x_MX, w_KN, residual_MK, norm_weight_K, eps, swiglu, config):
  outputs = _forward(x_MX, w_KN, residual_MK, norm_weight_K, eps, swiglu, config)
  return outputs, (x_MX, w_KN, residual_MK, norm_weight_K)


def _decode_matmul_bwd(eps, swiglu, config, residuals, cotangents):
  del config
  _, vjp = jax.vjp(functools.partial(reference.decode_matmul, eps=eps, swiglu=swiglu),
                   *residuals)
  return vjp(cotangents)


decode_matmul.defvjp(_decode_matmul_fwd, _decode_matmul_bwd)
