"""The kernel bodies of pallas_prepare.py: one chunk of one head per Triton program.

Notation as in pallas_prepare.py (G = in-chunk cumulative log-decay, e = exp(G), Dm_ij =
exp(G_i - G_j) on j <= i, X = (I + A)^-1). `attention_kernel` writes A and the outputs' inputs
kd, qg, p; the chunk inverse (pallas_inverse.py) turns A into X; `wy_kernel` writes w and u.
Vectors `_C` are per token of the chunk; tiles `_CC` are [C, C] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.pallas_state_pass import kernel_dot
from pallas_kernels.gated_delta_rule.reference import L2NORM_EPS

__all__ = ["attention_kernel", "wy_kernel"]


def _exact_dot(a, b):
  return kernel_dot(a, b, exact=True)


def _masks(chunk_size):
  row_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
  col_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
  return row_CC, col_CC


def _gamma(g_C, chunk_size):
  """exp(G): the decay from the chunk's start through each token."""
  row_CC, col_CC = _masks(chunk_size)
  return jnp.exp(jnp.sum(jnp.where(col_CC <= row_CC, g_C[None, :], 0.0), axis=1))


def _decays(g_C, chunk_size):
  """Segment sums of the log-decay, as the XLA preparation's float32 path (no G_i - G_j
  cancellation; for bf16 inputs the difference from its G_i - G_j is far below the tolerance).

  Returns gamma_C = exp(G), decay_to_end_C = exp(G_C - G), decay_CC = exp(G_i - G_j) on j <= i.
  """
  row_CC, col_CC = _masks(chunk_size)
  to_end_C = jnp.sum(jnp.where(col_CC > row_CC, g_C[None, :], 0.0), axis=1)
  # log_ratio[i, j] = sum_{j < m <= i} g_m = [m <= i] @ ([m > j] g_m), a 0/1 matrix product.
  lower_incl_CC = jnp.where(col_CC <= row_CC, 1.0, 0.0)
  log_ratio_CC = _exact_dot(lower_incl_CC, jnp.where(row_CC > col_CC, g_C[:, None], 0.0))
  decay_CC = jnp.where(col_CC <= row_CC, jnp.exp(log_ratio_CC), 0.0)
  return _gamma(g_C, chunk_size), jnp.exp(to_end_C), decay_CC


def _normalized(x_CD, scale, use_qk_l2norm):
  x_CD = x_CD.astype(jnp.float32)
  if use_qk_l2norm:
    x_CD = x_CD * jax.lax.rsqrt(jnp.sum(x_CD * x_CD, axis=1, keepdims=True) + L2NORM_EPS)
  return x_CD if scale == 1.0 else x_CD * scale


def _load_normalized(x_ref, scale, use_qk_l2norm, store_dtype):
  # q and k are rounded to the store dtype once, as the reference does after normalising.
  return _normalized(x_ref[...], scale, use_qk_l2norm).astype(store_dtype)


def attention_kernel(q_ref, k_ref, g_ref, beta_ref, a_ref, kd_ref, qg_ref, p_ref, *, scale,
                     use_qk_l2norm, chunk_size, exact):
  """A = B (strict_lower(Dm) ⊙ k k^T) (float32, for the inverse), kd, qg and p."""
  store_dtype = kd_ref.dtype
  q_CK = _load_normalized(q_ref, scale, use_qk_l2norm, store_dtype)
  k_CK = _load_normalized(k_ref, 1.0, use_qk_l2norm, store_dtype)
  beta_C = beta_ref[...].astype(jnp.float32)
  gamma_C, decay_to_end_C, decay_CC = _decays(g_ref[...].astype(jnp.float32), chunk_size)
  row_CC, col_CC = _masks(chunk_size)
  kk_CC = kernel_dot(k_CK, k_CK, exact=exact, trans_b=True)
  a_ref[...] = jnp.where(col_CC < row_CC, beta_C[:, None] * decay_CC * kk_CC, 0.0)
  kd_ref[...] = (decay_to_end_C[:, None] * k_CK.astype(jnp.float32)).astype(store_dtype)
  qg_ref[...] = (gamma_C[:, None] * q_CK.astype(jnp.float32)).astype(store_dtype)
  p_ref[...] = (kernel_dot(q_CK, k_CK, exact=exact, trans_b=True) * decay_CC).astype(store_dtype)


def wy_kernel(k_ref, v_ref, g_ref, beta_ref, x_ref, w_ref, u_ref, *, use_qk_l2norm, chunk_size,
              exact):
  """w = X diag(beta e) k and u = X diag(beta) v from the chunk's inverse X."""
  store_dtype = w_ref.dtype
  k_CK = _load_normalized(k_ref, 1.0, use_qk_l2norm, store_dtype)
  v_CV = v_ref[...].astype(store_dtype)
  beta_C = beta_ref[...].astype(jnp.float32)
  gamma_C = _gamma(g_ref[...].astype(jnp.float32), chunk_size)
  t_CC = x_ref[...] * beta_C[None, :]
  w_ref[...] = kernel_dot(t_CC * gamma_C[None, :], k_CK, exact=exact).astype(store_dtype)
  u_ref[...] = kernel_dot(t_CC, v_CV, exact=exact).astype(store_dtype)
