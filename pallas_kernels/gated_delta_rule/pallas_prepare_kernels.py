"""The kernel bodies of pallas_prepare.py: one chunk of one head per Triton program.

Notation as in pallas_prepare.py (G = in-chunk cumulative log-decay, e = exp(G), Dm_ij =
exp(G_i - G_j) on j <= i, X = (I + A)^-1). `forward_kernel` writes w, u, kd, qg, p (and X for the
backward); `backward_kernel` recomputes everything else from the raw chunk and X and writes dq,
dk, dv, dg, dbeta. Vectors `_C` are per token of the chunk; tiles `_CC` are [C, C] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.pallas_state_pass import kernel_dot
from pallas_kernels.gated_delta_rule.reference import L2NORM_EPS

__all__ = ["backward_kernel", "forward_kernel"]


def _exact_dot(a, b):
  return kernel_dot(a, b, exact=True)


def _masks(chunk_size):
  row_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
  col_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
  return row_CC, col_CC


def _decays(g_C, chunk_size):
  """Segment sums of the log-decay, as in the XLA reference (no G_i - G_j cancellation).

  Returns gamma_C = exp(G), decay_to_end_C = exp(G_C - G), decay_CC = exp(G_i - G_j) on j <= i.
  """
  row_CC, col_CC = _masks(chunk_size)
  cum_C = jnp.sum(jnp.where(col_CC <= row_CC, g_C[None, :], 0.0), axis=1)
  to_end_C = jnp.sum(jnp.where(col_CC > row_CC, g_C[None, :], 0.0), axis=1)
  # log_ratio[i, j] = sum_{j < m <= i} g_m = [m <= i] @ ([m > j] g_m), a 0/1 matrix product.
  lower_incl_CC = jnp.where(col_CC <= row_CC, 1.0, 0.0)
  log_ratio_CC = _exact_dot(lower_incl_CC, jnp.where(row_CC > col_CC, g_C[:, None], 0.0))
  decay_CC = jnp.where(col_CC <= row_CC, jnp.exp(log_ratio_CC), 0.0)
  return jnp.exp(cum_C), jnp.exp(to_end_C), decay_CC


def _normalized(x_CD, scale, use_qk_l2norm):
  x_CD = x_CD.astype(jnp.float32)
  if use_qk_l2norm:
    x_CD = x_CD * jax.lax.rsqrt(jnp.sum(x_CD * x_CD, axis=1, keepdims=True) + L2NORM_EPS)
  return x_CD if scale == 1.0 else x_CD * scale


def _unit_lower_inverse(a_CC, chunk_size):
  """(I + A)^-1 by forward substitution on chip: X[i] = e_i - sum_{j<i} A[i, j] X[j].

  Backward stable for the nearly singular A of correlated keys (see pallas.py's tests), unlike a
  power series; C - 1 sequential steps of [C, C] float32 elementwise work.
  """
  row_CC, col_CC = _masks(chunk_size)
  # Row i of A is read as column i of A^T: a reduction along axis 1 lands indexed by j along
  # axis 0, where the combination needs it (no per-step layout change).
  a_t_CC = a_CC.T

  def substitute_row(i, x_CC):
    a_row_C = jnp.sum(jnp.where(col_CC == i, a_t_CC, 0.0), axis=1)  # A[i, j], zero for j >= i
    combination_1C = jnp.sum(a_row_C[:, None] * x_CC, axis=0, keepdims=True)
    new_row_CC = jnp.where(col_CC == i, 1.0, 0.0) - combination_1C
    return jnp.where(row_CC == i, new_row_CC, x_CC)

  identity_CC = jnp.where(row_CC == col_CC, 1.0, 0.0)
  return jax.lax.fori_loop(1, chunk_size, substitute_row, identity_CC)


def _load_chunk(q_ref, k_ref, v_ref, g_ref, beta_ref, *, scale, use_qk_l2norm, store_dtype):
  # q, k, v are rounded to the store dtype once, as the reference does after normalising.
  q_CK = _normalized(q_ref[...], scale, use_qk_l2norm).astype(store_dtype)
  k_CK = _normalized(k_ref[...], 1.0, use_qk_l2norm).astype(store_dtype)
  v_CV = v_ref[...].astype(store_dtype)
  return q_CK, k_CK, v_CV, g_ref[...].astype(jnp.float32), beta_ref[...].astype(jnp.float32)


def forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, qg_ref, p_ref,
                    *x_ref, scale, use_qk_l2norm, chunk_size, exact):
  q_CK, k_CK, v_CV, g_C, beta_C = _load_chunk(
      q_ref, k_ref, v_ref, g_ref, beta_ref, scale=scale, use_qk_l2norm=use_qk_l2norm,
      store_dtype=w_ref.dtype)
  gamma_C, decay_to_end_C, decay_CC = _decays(g_C, chunk_size)
  row_CC, col_CC = _masks(chunk_size)
  kk_CC = kernel_dot(k_CK, k_CK, exact=exact, trans_b=True)
  a_CC = jnp.where(col_CC < row_CC, beta_C[:, None] * decay_CC * kk_CC, 0.0)
  x_CC = _unit_lower_inverse(a_CC, chunk_size)
  if x_ref:
    x_ref[0][...] = x_CC
  t_CC = x_CC * beta_C[None, :]
  w_ref[...] = kernel_dot(t_CC * gamma_C[None, :], k_CK, exact=exact).astype(w_ref.dtype)
  u_ref[...] = kernel_dot(t_CC, v_CV, exact=exact).astype(u_ref.dtype)
  kd_ref[...] = (decay_to_end_C[:, None] * k_CK.astype(jnp.float32)).astype(kd_ref.dtype)
  qg_ref[...] = (gamma_C[:, None] * q_CK.astype(jnp.float32)).astype(qg_ref.dtype)
  p_ref[...] = (kernel_dot(q_CK, k_CK, exact=exact, trans_b=True) * decay_CC).astype(p_ref.dtype)


def _l2norm_backward(x_raw_CD, dx_normed_CD, scale, use_qk_l2norm):
  """Gradient w.r.t. raw x of x_normed = scale * x * rsqrt(sum x^2 + eps)."""
  if not use_qk_l2norm:
    return dx_normed_CD * scale
  x_CD = x_raw_CD.astype(jnp.float32)
  inv_norm_C1 = jax.lax.rsqrt(jnp.sum(x_CD * x_CD, axis=1, keepdims=True) + L2NORM_EPS)
  projection_C1 = jnp.sum(dx_normed_CD * x_CD, axis=1, keepdims=True)
  inv_norm_cubed_C1 = inv_norm_C1 * inv_norm_C1 * inv_norm_C1
  return scale * (inv_norm_C1 * dx_normed_CD - x_CD * inv_norm_cubed_C1 * projection_C1)


def backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, x_ref, dw_ref, du_ref, dkd_ref,
                     dqg_ref, dp_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, scale,
                     use_qk_l2norm, chunk_size, exact):
  """Gradients of one chunk (checked term by term against jax.vjp of the XLA reference).

  With T = X diag(beta), Tg = X diag(beta e), S = k k^T and the cotangents dw, du, dkd, dqg, dp:
    dX = (dw k^T) diag(beta e) + (du v^T) diag(beta);  dk += Tg^T dw;  dv = T^T du
    dbeta_j += e_j sum_i (dw k^T ⊙ X)_ij + sum_i (du v^T ⊙ X)_ij
    de_j += beta_j sum_i (dw k^T ⊙ X)_ij
    dA = strict_lower(-X^T dX X^T);  dS = B dA ⊙ Dm;  dk += (dS + dS^T) k;
    dbeta_i += sum_j (dA ⊙ Dm ⊙ S)_ij
    p: dq += (dp ⊙ Dm) k;  dk += (dp ⊙ Dm)^T q;   qg: dq += diag(e) dqg, de_i += dqg_i . q_i
    kd: dk += diag(exp(G_C - G)) dkd
  Decays: every factor f = exp(G_i - G_j) with cotangent-weighted value r adds r to dG_i and -r to
  dG_j (from A: B dA ⊙ Dm ⊙ S, from p: dp ⊙ Dm ⊙ q k^T, from kd: j = token, i = C), e adds
  e ⊙ de; then dg_m = sum_{i >= m} dG_i, since G_i = sum_{m <= i} g_m. The chunk decay exp(G_C)
  is differentiated by XLA. Finally the l2norm and scale backward, from the raw q and k.
  """
  q_CK, k_CK, v_CV, g_C, beta_C = _load_chunk(
      q_ref, k_ref, v_ref, g_ref, beta_ref, scale=scale, use_qk_l2norm=use_qk_l2norm,
      store_dtype=dw_ref.dtype)
  gamma_C, decay_to_end_C, decay_CC = _decays(g_C, chunk_size)
  row_CC, col_CC = _masks(chunk_size)
  x_CC = x_ref[...]
  # Cotangents are loaded where used: few [C, K] float32 tiles live at once (K = 256: 64 KiB each).
  dw_CK = dw_ref[...].astype(jnp.float32)
  du_CV = du_ref[...].astype(jnp.float32)

  # w = X diag(beta e) k and u = X diag(beta) v.
  beta_gamma_C = beta_C * gamma_C
  dxw_CC = kernel_dot(dw_CK, k_CK, exact=exact, trans_b=True)
  dxu_CC = kernel_dot(du_CV, v_CV, exact=exact, trans_b=True)
  colsum_w_C = jnp.sum(dxw_CC * x_CC, axis=0)
  colsum_u_C = jnp.sum(dxu_CC * x_CC, axis=0)
  dbeta_C = gamma_C * colsum_w_C + colsum_u_C
  dgamma_C = beta_C * colsum_w_C
  dk_CK = kernel_dot(x_CC * beta_gamma_C[None, :], dw_CK, exact=exact, trans_a=True)
  dv_CV = kernel_dot(x_CC * beta_C[None, :], du_CV, exact=exact, trans_a=True)
  dx_CC = dxw_CC * beta_gamma_C[None, :] + dxu_CC * beta_C[None, :]

  # X = (I + A)^-1: dA = -X^T dX X^T on A's strictly lower support (full float32, as the
  # reference's inverse backward).
  da_CC = -_exact_dot(_exact_dot(x_CC.T, dx_CC), x_CC.T)
  da_CC = jnp.where(col_CC < row_CC, da_CC, 0.0)
  # A = B (strict_lower(Dm) ⊙ k k^T).
  kk_CC = kernel_dot(k_CK, k_CK, exact=exact, trans_b=True)
  da_decay_kk_CC = da_CC * decay_CC * kk_CC
  dbeta_C = dbeta_C + jnp.sum(da_decay_kk_CC, axis=1)
  dlog_ratio_CC = beta_C[:, None] * da_decay_kk_CC
  dkk_CC = beta_C[:, None] * da_CC * decay_CC
  dk_CK = dk_CK + kernel_dot(dkk_CC + dkk_CC.T, k_CK, exact=exact)

  # p = (q k^T) ⊙ Dm.
  qk_CC = kernel_dot(q_CK, k_CK, exact=exact, trans_b=True)
  dqk_CC = dp_ref[...].astype(jnp.float32) * decay_CC
  dlog_ratio_CC = dlog_ratio_CC + dqk_CC * qk_CC
  dq_CK = kernel_dot(dqk_CC, k_CK, exact=exact)
  dk_CK = dk_CK + kernel_dot(dqk_CC, q_CK, exact=exact, trans_a=True)

  # qg = diag(e) q and kd = diag(exp(G_C - G)) k.
  dqg_CK = dqg_ref[...].astype(jnp.float32)
  dq_CK = dq_CK + gamma_C[:, None] * dqg_CK
  dgamma_C = dgamma_C + jnp.sum(dqg_CK * q_CK.astype(jnp.float32), axis=1)
  dkd_CK = dkd_ref[...].astype(jnp.float32)
  dk_CK = dk_CK + decay_to_end_C[:, None] * dkd_CK
  dlog_to_end_C = decay_to_end_C * jnp.sum(dkd_CK * k_CK.astype(jnp.float32), axis=1)

  dcum_C = (gamma_C * dgamma_C + jnp.sum(dlog_ratio_CC, axis=1) - jnp.sum(dlog_ratio_CC, axis=0)
            - dlog_to_end_C)
  last_C = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) == chunk_size - 1
  dcum_C = dcum_C + jnp.where(last_C, jnp.sum(dlog_to_end_C), 0.0)
  dg_ref[...] = jnp.sum(jnp.where(row_CC >= col_CC, dcum_C[:, None], 0.0), axis=0)
  dbeta_ref[...] = dbeta_C

  dq_ref[...] = _l2norm_backward(q_ref[...], dq_CK, scale, use_qk_l2norm).astype(dq_ref.dtype)
  dk_ref[...] = _l2norm_backward(k_ref[...], dk_CK, 1.0, use_qk_l2norm).astype(dk_ref.dtype)
  dv_ref[...] = dv_CV.astype(dv_ref.dtype)
