"""(I + A)^-1 for many strictly lower-triangular C x C matrices: one Pallas (Triton) program each.

The chunked gated delta rule needs this inverse for every chunk of every head. Each program keeps
its matrix on chip and inverts it blockwise (16 x 16 diagonal blocks by forward substitution, then
the blocks below the diagonal by 16 x 16 dots; see the kernel), so the forward reads A once and
writes X = (I + A)^-1 once; XLA would run the same blockwise scheme
(reference.unit_lower_inverse) as a loop of small batched ops over every chunk's matrix. The
backward is closed form: dX = -X dA X, so the cotangent of A is -(X^T G X^T) restricted to A's
strictly lower support (two batched matmuls in XLA).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.pallas_common import interpret_mode, triton_compiler_params

__all__ = ["inverse_forward", "unit_lower_inverse"]


BLOCK = 16  # rows of the diagonal blocks inverted by substitution (Triton's smallest dot tile)


def _inverse_kernel(a_ref, x_ref, *, size, exact):
  # Blockwise, as FLA's solve_tril and reference.unit_lower_inverse: the C/16 diagonal 16 x 16
  # blocks by forward substitution, all in the same 15-step loop (independent work per step), then
  # the blocks below the diagonal from X_rc = -X_rr sum_{c<=m<r} A_rm X_mc (16 x 16 dots). Measured
  # on an H100 before this: substitution over the whole 64 x 64 matrix (63 steps, each a
  # cross-warp reduction over 4096 entries) dominated the GDN preparation.
  # Substitution is backward stable; the merge's products are those of principal blocks of the
  # true inverse (bounded by it), unlike a power series (see reference._substitution_inverse).
  # All float32; the dots at full precision ("ieee") when exact, else TF32 (the bf16 inputs'
  # preparation: Triton's IEEE dots run on the FMA units, several times slower).
  num_blocks = size // BLOCK
  row_BB = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  col_BB = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  identity_BB = jnp.where(row_BB == col_BB, 1.0, 0.0)
  block = lambda r, c: a_ref[pl.ds(r * BLOCK, BLOCK), pl.ds(c * BLOCK, BLOCK)].astype(jnp.float32)

  def substitute_row(i, diagonal_inverses):
    updated = []
    for b, x_BB in enumerate(diagonal_inverses):
      # Row i of block b of A: A[i, j], zero for j >= i.
      a_row_1B = a_ref[pl.ds(b * BLOCK + i, 1), pl.ds(b * BLOCK, BLOCK)].astype(jnp.float32)
      combination_1B = jnp.sum(a_row_1B.T * x_BB, axis=0, keepdims=True)
      new_row_BB = jnp.where(col_BB == i, 1.0, 0.0) - combination_1B
      updated.append(jnp.where(row_BB == i, new_row_BB, x_BB))
    return tuple(updated)

  diagonal = jax.lax.fori_loop(1, BLOCK, substitute_row, (identity_BB,) * num_blocks)
  precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
  block_dot = lambda a, b: jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)
  x = {(r, r): diagonal[r] for r in range(num_blocks)}
  for r in range(1, num_blocks):
    for c in range(r - 1, -1, -1):
      total_BB = block_dot(block(r, c), x[c, c])
      for m in range(c + 1, r):
        total_BB += block_dot(block(r, m), x[m, c])
      x[r, c] = -block_dot(x[r, r], total_BB)
  zeros_BB = jnp.zeros((BLOCK, BLOCK), jnp.float32)
  for r in range(num_blocks):
    for c in range(num_blocks):
      x_ref[pl.ds(r * BLOCK, BLOCK), pl.ds(c * BLOCK, BLOCK)] = x.get((r, c), zeros_BB).astype(
          x_ref.dtype)


def inverse_forward(a_XCC, num_warps: int = 1, exact: bool = True):
  """The forward alone (no gradient): X in float32. exact=False (the preparation of bf16 inputs):
  TF32 dots and X stored in bf16, as FLA stores it (its consumers round X to bf16 for their dots
  anyway, so this halves its memory traffic at no cost in precision)."""
  # One warp: the tiles are 16 x 16. Measured on an H100 (B1 T16384 H8, 2048 matrices): 0.18 ms
  # with 1 warp, 0.25 with 2, 0.49 with 4 (more warps only split 256 entries finer and add
  # cross-warp reductions to every substitution step).
  num, size, _ = a_XCC.shape
  spec = pl.BlockSpec((None, size, size), lambda i: (i, 0, 0))
  return pl.pallas_call(
      functools.partial(_inverse_kernel, size=size, exact=exact),
      grid=(num,),
      in_specs=[spec],
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(a_XCC.shape, jnp.float32 if exact else jnp.bfloat16),
      compiler_params=triton_compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret_mode(),
      name="gdn_unit_lower_inverse",
  )(a_XCC)


@jax.custom_vjp
def _inverse(a_XCC):
  return inverse_forward(a_XCC)


def _inverse_fwd(a_XCC):
  x_XCC = inverse_forward(a_XCC)
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
