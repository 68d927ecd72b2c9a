"""Helpers shared by the Pallas kernels (Triton backend) of every op folder.

Launch: `interpret_mode` (Pallas interpret mode off the GPU, so CPU tests run the kernels' logic)
and `triton_compiler_params` (the class name changed across JAX versions). Shapes: Triton wants
power-of-two block dims, and `tl.dot` operands of at least `MIN_DOT_DIM` along every dim. In-kernel
math: dots with float32 accumulation, the exp2 forms that lower to one PTX instruction, and the
steps of an online softmax (flash attention) forward and backward shared by the attention kernels.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["LOG2_E", "MIN_DOT_DIM", "cdiv", "check_launch_fields", "dkdv_step", "dot_nn", "dot_nt",
           "dot_tn", "dq_step", "exp2", "exp2_affine", "interpret_mode", "is_power_of_two",
           "kernel_dot", "merge_splits", "next_power_of_two", "probabilities", "round_up",
           "softmax_finish", "softmax_start", "softmax_step", "triton_compiler_params",
           "triton_dot"]

# Triton's tl.dot needs >= 16 along every dimension.
MIN_DOT_DIM = 16
LOG2_E = math.log2(math.e)
# pallas.triton.dot since JAX 0.10 (pallas.dot is deprecated there); older versions: pallas.dot.
triton_dot = getattr(pltriton, "dot", None) or pl.dot


# The name the attention kernels' custom VJPs give their forward outputs (output, logsumexp): a
# `jax.checkpoint` whose policy saves this name (`save_kernel_outputs`) keeps them for the
# backward pass instead of running the forward kernels again (ModelConfig.remat = "attention").
KERNEL_OUTPUT = "attention_kernel_output"


def save_kernel_outputs(*outputs):
  """`outputs` named KERNEL_OUTPUT for a remat policy (the identity otherwise)."""
  return tuple(checkpoint_name(x, KERNEL_OUTPUT) for x in outputs)


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


def check_launch_fields(config, *, power_of_two=lambda name: False) -> None:
  """ValueError naming the field of a frozen launch-parameter dataclass that is not a positive
  int, or, where `power_of_two(field name)`, not a power of two."""
  name = type(config).__name__
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}.{field.name} must be a positive int, got {value!r}")
    if power_of_two(field.name) and not is_power_of_two(value):
      raise ValueError(f"{name}.{field.name} must be a power of two, got {value!r}")


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


# Online softmax (flash attention) over tiles of keys, in the log2 domain: scores are
# qk * scale * log2(e) and exp2 replaces exp (what the GPU computes natively). The carry is
# (acc [R, Dv], row max [R], row sum [R]), float32.


def softmax_start(rows: int, value_dim: int):
  """The carry before any key."""
  return (jnp.zeros((rows, value_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_step(carry, qk_RC, v_CV, mask_RC, score_scale: float, interpret: bool):
  """Adds one tile of C keys: qk_RC raw scores q k^T, v_CV their values, mask_RC None when
  every score of the tile is visible; score_scale = scale * log2(e)."""
  acc, row_max, row_sum = carry
  if mask_RC is not None:
    qk_RC = jnp.where(mask_RC, qk_RC, -jnp.inf)
  # The scale is applied to the row maxima and inside exp2's argument (scale > 0, so
  # max(qk) * scale = max(qk * scale)), where exp2_affine makes qk * scale - shift one fused
  # multiply-add per score: written in jnp it stayed a multiply and a subtract.
  new_max = jnp.maximum(row_max, jnp.max(qk_RC, axis=1) * score_scale)
  # A row that has seen no visible key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
  shift = jnp.where(new_max == -jnp.inf, 0.0, new_max) if mask_RC is not None else new_max
  correction = exp2(row_max - shift, interpret)
  p = exp2_affine(qk_RC, score_scale, -shift, interpret)
  row_sum = row_sum * correction + jnp.sum(p, axis=1)
  acc = acc * correction[:, None] + dot_nn(p.astype(v_CV.dtype), v_CV)
  return acc, new_max, row_sum


def softmax_finish(carry):
  """(o [R, Dv] float32, lse2 [R]: the log2 of each row's softmax denominator in the scaled log2
  domain); a row that saw no visible key gets o = 0 (the references' convention) and lse2 = 0."""
  acc, row_max, row_sum = carry
  empty = row_sum == 0.0
  # One reciprocal per row and a multiply per element, not a division per element.
  o = acc * (1.0 / jnp.where(empty, 1.0, row_sum))[:, None]
  return o, jnp.where(empty, 0.0, row_max + jnp.log2(jnp.where(empty, 1.0, row_sum)))


def probabilities(qk_RC, score_scale: float, lse2_R, mask_RC, interpret: bool):
  """Softmax weights exp2(qk * scale - lse2) from the forward's lse2, 0 where mask_RC is False."""
  # qk * scale - lse is one fused multiply-add per score; the mask then selects.
  p = exp2_affine(qk_RC, score_scale, -lse2_R, interpret)
  return p if mask_RC is None else jnp.where(mask_RC, p, 0.0)


def dq_step(dq_RD, p_RC, do_RV, k_CD, v_CV, delta_R):
  """dq += ds k with ds = p (do v^T - delta): one key tile's part of the query gradient (before
  the final multiplication by the scale); delta_R = sum(o * do) per row."""
  ds = p_RC * (dot_nt(do_RV, v_CV) - delta_R[:, None])
  return dq_RD + dot_nn(ds.astype(k_CD.dtype), k_CD)


def dkdv_step(dk_CD, dv_CV, p_RC, q_RD, do_RV, v_CV, delta_R):
  """dv += p^T do, dk += ds^T q: one query tile's part of the key and value gradients (dk before
  the final multiplication by the scale)."""
  dv_CV = dv_CV + dot_tn(p_RC.astype(do_RV.dtype), do_RV)
  ds = p_RC * (dot_nt(do_RV, v_CV) - delta_R[:, None])
  return dk_CD + dot_tn(ds.astype(q_RD.dtype), q_RD), dv_CV


def merge_splits(out_BSHV, max_BSH, sum_BSH, *, base2: bool):
  """Merges the partial softmaxes of a key axis split S ways (XLA, after a split-K kernel): each
  split's unnormalised output, row maximum (finite: a split that saw no key holds a very negative
  one) and row sum, in the exp domain (base2=False) or the exp2 one. Returns (out [B, H, V]
  float32, zero for a row that saw no key; the rows' log-sum-exp [B, H] in the same base, -inf for
  a row that saw no key)."""
  exp, log = (jnp.exp2, jnp.log2) if base2 else (jnp.exp, jnp.log)
  total_max_BH = jnp.max(max_BSH, axis=1)
  weight_BSH = exp(max_BSH - total_max_BH[:, None])
  total_sum_BH = jnp.sum(weight_BSH * sum_BSH, axis=1)
  out_BHV = jnp.sum(weight_BSH[..., None] * out_BSHV, axis=1)
  return (out_BHV / jnp.where(total_sum_BH > 0, total_sum_BH, 1.0)[..., None],
          total_max_BH + log(total_sum_BH))
