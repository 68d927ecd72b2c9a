"""(I + A)^-1 for many strictly lower-triangular C x C matrices: one Pallas (Triton) program each.

The chunked gated delta rule needs this inverse for every chunk of every head. Each program keeps
its matrix on chip and runs forward substitution (stable, see the kernel), so the forward reads A
once and writes X = (I + A)^-1 once; XLA's doubling (reference.unit_lower_inverse) is ~10 batched
matmuls over every chunk's matrix, with all intermediates kept for autodiff. The backward is closed
form: dX = -X dA X, so the cotangent of A is -(X^T G X^T) restricted to A's strictly lower support
(two batched matmuls in XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta_rule.pallas_state_pass import interpret, triton_compiler_params

__all__ = ["unit_lower_inverse"]


def _inverse_kernel(a_ref, x_ref, *, size):
  # Forward substitution, one row per step: X[i] = e_i - sum_{j<i} A[i, j] X[j]. Unlike the
  # doubling of reference.unit_lower_inverse (sums of powers of A), whose intermediate powers reach
  # ~1e16 when the keys of a chunk are strongly correlated and cancel to an O(1) inverse (garbage in
  # float32, NaN in the XLA reference), substitution is backward stable. All float32 elementwise
  # work; no matmul precision to choose.
  row_CC = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
  col_CC = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)

  def substitute_row(i, x_CC):
    a_row_1C = a_ref[pl.ds(i, 1), :].astype(jnp.float32)  # A[i, j], zero for j >= i
    combination_1C = jnp.sum(a_row_1C.T * x_CC, axis=0, keepdims=True)
    new_row_CC = jnp.where(col_CC == i, 1.0, 0.0) - combination_1C
    return jnp.where(row_CC == i, new_row_CC, x_CC)

  identity_CC = jnp.where(row_CC == col_CC, 1.0, 0.0)
  x_ref[...] = jax.lax.fori_loop(1, size, substitute_row, identity_CC).astype(x_ref.dtype)


def _forward(a_XCC):
  num, size, _ = a_XCC.shape
  spec = pl.BlockSpec((None, size, size), lambda i: (i, 0, 0))
  return pl.pallas_call(
      functools.partial(_inverse_kernel, size=size),
      grid=(num,),
      in_specs=[spec],
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(a_XCC.shape, jnp.float32),
      compiler_params=triton_compiler_params(num_warps=4, num_stages=1),
      interpret=interpret(),
      name="gdn_unit_lower_inverse",
  )(a_XCC)


@jax.custom_vjp
def _inverse(a_XCC):
  return _forward(a_XCC)


def _inverse_fwd(a_XCC):
  x_XCC = _forward(a_XCC)
  return x_XCC, x_XCC


def _inverse_bwd(x_XCC, dx_XCC):
  # Full float32 products: TF32 (XLA's GPU default) would cost ~3 digits here for every input.
  mm = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
  da_XCC = -mm("xji,xjk,xlk->xil", x_XCC, dx_XCC, x_XCC)
  size = x_XCC.shape[-1]
  strictly_lower_CC = jnp.arange(size)[None, :] < jnp.arange(size)[:, None]
  return (jnp.where(strictly_lower_CC, da_XCC, 0.0),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def unit_lower_inverse(a_NCC: jax.Array) -> jax.Array:
  """(I + A)^-1 in float32 for strictly lower-triangular float32 A `[..., C, C]`.

  C must be a power of two >= 16. Differentiable.
  """
  size = a_NCC.shape[-1]
  if size < 16 or size & (size - 1):
    raise NotImplementedError(f"unit_lower_inverse: C = {size}; needs a power of two >= 16")
  a_XCC = a_NCC.reshape((-1, size, size)).astype(jnp.float32)
  return _inverse(a_XCC).reshape(a_NCC.shape)
