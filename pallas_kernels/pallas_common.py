"""Helpers shared by the Pallas kernels (Triton backend) of every op folder.

Launch: `interpret_mode` (Pallas interpret mode off the GPU, so CPU tests run the kernels' logic)
and `triton_compiler_params` (the class name changed across JAX versions). Shapes: Triton wants
power-of-two block dims, and `tl.dot` operands of at least `MIN_DOT_DIM` along every dim. In-kernel
math: dots with float32 accumulation and the exp2 forms that lower to one PTX instruction.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["LOG2_E", "MIN_DOT_DIM", "cdiv", "dot_nn", "dot_nt", "dot_tn", "exp2", "exp2_affine",
           "interpret_mode", "is_power_of_two", "kernel_dot", "next_power_of_two", "round_up",
           "triton_compiler_params", "triton_dot"]

# Triton's tl.dot needs >= 16 along every dimension.
MIN_DOT_DIM = 16
LOG2_E = math.log2(math.e)
# pallas.triton.dot since JAX 0.10 (pallas.dot is deprecated there); older versions: pallas.dot.
triton_dot = getattr(pltriton, "dot", None) or pl.dot


def interpret_mode() -> bool:
  """Interpret mode off the GPU, so CPU tests run the same kernel logic."""
  return jax.default_backend() != "gpu"


def triton_compiler_params(num_warps: int, num_stages: int):
  """Triton launch parameters. jax 0.10.2 and 0.11.2 both export CompilerParams; older releases
  named it TritonCompilerParams."""
  params_class = getattr(pltriton, "CompilerParams", None) or getattr(
      pltriton, "TritonCompilerParams")
  return params_class(num_warps=num_warps, num_stages=num_stages)


def is_power_of_two(value: int) -> bool:
  return value > 0 and value & (value - 1) == 0


def next_power_of_two(size: int, minimum: int = MIN_DOT_DIM) -> int:
  """The Triton kernels want power-of-two block dims of at least 16 (tensor-core dot operands)."""
  return max(minimum, 1 << (size - 1).bit_length())


def cdiv(a, b):
  """Ceiling division of non-negative ints or int32 arrays (Triton's division truncates)."""
  return (a + b - 1) // b


def round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def kernel_dot(a, b, *, exact: bool, trans_a: bool = False, trans_b: bool = False):
  """a @ b inside a kernel with float32 accumulation.

  exact: float32 operands at full (IEEE) precision, for float32 inputs; otherwise the operands are
  rounded to bf16 for the tensor cores (the bf16 tolerance covers that; FLA does the same).
  """
  if trans_a:
    a = a.T
  if trans_b:
    b = b.T
  if exact:
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32)


def dot_nt(a, b):
  """a @ b.T with float32 accumulation (operands in their own dtype)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
  """a @ b with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):
  """a.T @ b with float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def exp2(x, interpret: bool):
  """2**x of float32 values as one PTX `ex2.approx.ftz.f32` (a single MUFU.EX2) on the GPU.

  jnp.exp2 lowers, in Pallas-Triton, to libdevice's `__nv_exp2f`, several instructions per
  element (ncu: replacing it made the SWA-1024 forward ~6% faster). Relative error ~2**-22;
  results under 2**-126 flush to 0, which a softmax cannot tell apart from 0; exp2(-inf) = 0.
  Interpret mode keeps jnp.exp2.
  """
  if interpret or x.dtype != jnp.float32:
    return jnp.exp2(x)
  [result] = _inline_asm("ex2.approx.ftz.f32 $0, $1;", x)
  return result


def exp2_affine(x_RC, scale: float, offset_R, interpret: bool):
  """2 ** (x * scale + offset[:, None]) of float32 scores: softmax numerators from raw scores.

  On the GPU one fused multiply-add and one MUFU.EX2 per element, in PTX. Written as
  `x * scale + offset` in jnp, Pallas-Triton emits a separate multiply and add that are not
  contracted (ncu: FMUL and FADD 2.2 each per score, no FFMA).
  """
  if interpret or x_RC.dtype != jnp.float32:
    return jnp.exp2(x_RC * scale + offset_R[:, None])
  [result] = _inline_asm(
      "{ .reg .f32 t; fma.rn.ftz.f32 t, $1, $2, $3; ex2.approx.ftz.f32 $0, t; }", x_RC,
      jnp.full(x_RC.shape, scale, jnp.float32), jnp.broadcast_to(offset_R[:, None], x_RC.shape))
  return result


def _inline_asm(asm: str, *args):
  """Elementwise PTX over float32 arrays of one shape: one result per element."""
  constraints = "=f," + ",".join("f" for _ in args)
  return pltriton.elementwise_inline_asm(
      asm, args=list(args), constraints=constraints, pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
