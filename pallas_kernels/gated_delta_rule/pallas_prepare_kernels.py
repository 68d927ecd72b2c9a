"""The kernel bodies of pallas_prepare.py: one chunk of one head per Triton program.

Notation as in pallas_prepare.py (G = in-chunk cumulative log-decay, e = exp(G), Dm_ij =
exp(G_i - G_j) on j <= i, X = (I + A)^-1). `attention_kernel` writes A and the outputs' inputs
kd, qg, p; the chunk inverse (pallas_inverse.py) turns A into X; `wy_kernel` writes w and u.
The backward runs the same split in reverse: `wy_backward_kernel` takes the cotangents of w and
u back through X to A (dv, dbeta and partial dk, dG), and `attention_backward_kernel` adds those of
kd, qg and p, then the l2norm's backward (dq, dk, dg). Vectors `_C` are per token of the chunk;
tiles `_CC` are [C, C] float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.reference import L2NORM_EPS
from pallas_kernels.pallas_common import kernel_dot

__all__ = ["attention_backward_kernel", "attention_kernel", "wy_backward_kernel",
           "wy_kernel"]


def _exact_dot(a, b):
  return kernel_dot(a, b, exact=True)


def _masks(chunk_size):
  row_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
  col_CC = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
  return row_CC, col_CC


def _cumulative(g_C, chunk_size):
  """G_i = sum_{m <= i} g_m, the in-chunk cumulative log-decay."""
  row_CC, col_CC = _masks(chunk_size)
  return jnp.sum(jnp.where(col_CC <= row_CC, g_C[None, :], 0.0), axis=1)


def _decays(g_C, chunk_size, *, exact):
  """gamma_C = exp(G), decay_to_end_C = exp(G_C - G) and decay_CC = exp(G_i - G_j) on j <= i.

  exact (float32 inputs): the exponents are segment sums of g, as in the XLA preparation's float32
  path (no G_i - G_j cancellation), at the cost of a [C, C, C] float32 product. Otherwise the
  differences G_i - G_j, as the XLA preparation's bf16 path and FLA (the cancellation, ~|G| * 6e-8
  in the exponent, is far below the bf16 tolerance).
  """
  row_CC, col_CC = _masks(chunk_size)
  cumulative_C = _cumulative(g_C, chunk_size)
  if exact:
    to_end_C = jnp.sum(jnp.where(col_CC > row_CC, g_C[None, :], 0.0), axis=1)
    # log_ratio[i, j] = sum_{j < m <= i} g_m = [m <= i] @ ([m > j] g_m), a 0/1 matrix product.
    lower_incl_CC = jnp.where(col_CC <= row_CC, 1.0, 0.0)
    log_ratio_CC = _exact_dot(lower_incl_CC, jnp.where(row_CC > col_CC, g_C[:, None], 0.0))
  else:
    to_end_C = jnp.sum(g_C) - cumulative_C
    # Zeroed above the diagonal before exp, where G_i - G_j >= 0 could overflow.
    log_ratio_CC = jnp.where(col_CC <= row_CC, cumulative_C[:, None] - cumulative_C[None, :], 0.0)
  decay_CC = jnp.where(col_CC <= row_CC, jnp.exp(log_ratio_CC), 0.0)
  return jnp.exp(cumulative_C), jnp.exp(to_end_C), decay_CC


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
  gamma_C, decay_to_end_C, decay_CC = _decays(g_ref[...].astype(jnp.float32), chunk_size,
                                                exact=exact)
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
  gamma_C = jnp.exp(_cumulative(g_ref[...].astype(jnp.float32), chunk_size))
  t_CC = x_ref[...].astype(jnp.float32) * beta_C[None, :]
  w_ref[...] = kernel_dot(t_CC * gamma_C[None, :], k_CK, exact=exact).astype(store_dtype)
  u_ref[...] = kernel_dot(t_CC, v_CV, exact=exact).astype(store_dtype)


def _l2norm_backward(x_raw_CD, dx_normed_CD, scale, use_qk_l2norm):
  """Gradient w.r.t. the raw x of x_normed = scale * x * rsqrt(sum x^2 + eps)."""
  if not use_qk_l2norm:
    return dx_normed_CD * scale
  x_CD = x_raw_CD.astype(jnp.float32)
  inv_norm_C1 = jax.lax.rsqrt(jnp.sum(x_CD * x_CD, axis=1, keepdims=True) + L2NORM_EPS)
  projection_C1 = jnp.sum(dx_normed_CD * x_CD, axis=1, keepdims=True)
  return scale * inv_norm_C1 * (dx_normed_CD - x_CD * (inv_norm_C1 * inv_norm_C1 * projection_C1))


def wy_backward_kernel(k_ref, v_ref, g_ref, beta_ref, x_ref, dw_ref, du_ref, dv_ref, dk_ref,
                       dbeta_ref, dcum_ref, *, use_qk_l2norm, chunk_size, exact):
  """Cotangents dw, du back through w = T diag(e) k, u = T v, T = X diag(beta), X = (I + A)^-1
  and A = B (strict_lower(Dm) ⊙ k k^T):

    dT = dw (diag(e) k)^T + du v^T;  dv = T^T du;  dk = diag(e) T^T dw;  de_j = beta_j (dw k^T ⊙ X)
    summed over i;  dX = dT diag(beta);  dbeta_j = sum_i (dT ⊙ X)_ij;  dA = -X^T dX X^T (on A's
    support);  dS = B dA ⊙ Dm (S = k k^T): dk += (dS + dS^T) k, dbeta_i += sum_j (dA ⊙ Dm ⊙ S)_ij;
    every factor Dm_ij = exp(G_i - G_j) with weight r_ij = (dS ⊙ S)_ij adds r to dG_i and -r to
    dG_j, and e adds e ⊙ de.

  Writes dv and dbeta (final), dk w.r.t. the normalised k (float32, partial) and dG (float32,
  w.r.t. the cumulative log-decay G, partial). Each output is stored as soon as it is final, so
  its registers are free for what follows (at K = 256 the other order spills).
  """
  store_dtype = dw_ref.dtype
  k_CK = _load_normalized(k_ref, 1.0, use_qk_l2norm, store_dtype)
  beta_C = beta_ref[...].astype(jnp.float32)
  gamma_C, _, decay_CC = _decays(g_ref[...].astype(jnp.float32), chunk_size, exact=exact)
  row_CC, col_CC = _masks(chunk_size)
  x_CC = x_ref[...].astype(jnp.float32)
  t_CC = x_CC * beta_C[None, :]
  # u first, so that v and du are dead before the [C, K] tiles of w's terms load.
  du_CV = du_ref[...]
  dxu_CC = kernel_dot(du_CV, v_ref[...].astype(store_dtype), exact=exact, trans_b=True)
  dv_ref[...] = kernel_dot(t_CC, du_CV, exact=exact, trans_a=True).astype(dv_ref.dtype)
  dw_CK = dw_ref[...]
  dxw_CC = kernel_dot(dw_CK, k_CK, exact=exact, trans_b=True)
  dk_CK = kernel_dot(t_CC * gamma_C[None, :], dw_CK, exact=exact, trans_a=True)
  colsum_w_C = jnp.sum(dxw_CC * x_CC, axis=0)
  dx_CC = (dxw_CC * gamma_C[None, :] + dxu_CC) * beta_C[None, :]
  # The inverse's closed-form backward. bf16 inputs: bf16 operands, as FLA's. Measured on an
  # H100 at B4 T4096 H64 (2026-11-23), this kernel took 13.0 ms with IEEE float32 dots of the
  # transposed [C, C] tiles (Triton's FMA path), 4.0 ms with TF32 and 2.6 ms with bf16 dots.
  x_t_CC = x_CC.T
  da_CC = -kernel_dot(kernel_dot(x_t_CC, dx_CC, exact=exact), x_t_CC, exact=exact)
  da_decay_CC = jnp.where(col_CC < row_CC, da_CC, 0.0) * decay_CC
  kk_CC = kernel_dot(k_CK, k_CK, exact=exact, trans_b=True)
  dbeta_a_C = jnp.sum(da_decay_CC * kk_CC, axis=1)
  dbeta_ref[...] = gamma_C * colsum_w_C + jnp.sum(dxu_CC * x_CC, axis=0) + dbeta_a_C
  ds_CC = beta_C[:, None] * da_decay_CC
  dk_ref[...] = dk_CK + kernel_dot(ds_CC + ds_CC.T, k_CK, exact=exact)
  dcum_ref[...] = (gamma_C * beta_C * colsum_w_C + beta_C * dbeta_a_C
                   - jnp.sum(ds_CC * kk_CC, axis=0))


def attention_backward_kernel(q_ref, k_ref, g_ref, dkd_ref, dqg_ref, dp_ref, dk_wy_ref,
                              dcum_wy_ref, dq_ref, dk_ref, dg_ref, *, scale, use_qk_l2norm,
                              chunk_size, exact):
  """Adds the cotangents of p = (q k^T) ⊙ Dm, qg = diag(e) q and kd = diag(exp(G_C - G)) k to
  wy_backward_kernel's dk and dG, then dg_m = sum_{i >= m} dG_i (G_i = sum_{m <= i} g_m) and the
  l2norm and scale backward from the raw q and k:

    dq = (dp ⊙ Dm) k + diag(e) dqg;  dk += (dp ⊙ Dm)^T q + diag(exp(G_C - G)) dkd;
    dG += e ⊙ rowsum(dqg ⊙ q) + (rowsum - colsum)(dp ⊙ Dm ⊙ q k^T) - r + [i = C] sum(r),
    r = exp(G_C - G) ⊙ rowsum(dkd ⊙ k).

  dq is stored before dk is formed (2026-11-23, H100, K = 256: holding both spilled, 2.75 against
  1.51 ms).
  """
  store_dtype = dkd_ref.dtype
  q_CK = _load_normalized(q_ref, scale, use_qk_l2norm, store_dtype)
  k_CK = _load_normalized(k_ref, 1.0, use_qk_l2norm, store_dtype)
  gamma_C, decay_to_end_C, decay_CC = _decays(g_ref[...].astype(jnp.float32), chunk_size,
                                              exact=exact)
  row_CC, col_CC = _masks(chunk_size)
  dqk_CC = dp_ref[...].astype(jnp.float32) * decay_CC
  dlog_ratio_CC = dqk_CC * kernel_dot(q_CK, k_CK, exact=exact, trans_b=True)
  dqg_CK = dqg_ref[...].astype(jnp.float32)
  dq_CK = kernel_dot(dqk_CC, k_CK, exact=exact) + gamma_C[:, None] * dqg_CK
  dgamma_C = jnp.sum(dqg_CK * q_CK.astype(jnp.float32), axis=1)
  dq_ref[...] = _l2norm_backward(q_ref[...], dq_CK, scale, use_qk_l2norm).astype(dq_ref.dtype)
  dkd_CK = dkd_ref[...].astype(jnp.float32)
  dk_CK = (dk_wy_ref[...] + kernel_dot(dqk_CC, q_CK, exact=exact, trans_a=True)
           + decay_to_end_C[:, None] * dkd_CK)
  dk_ref[...] = _l2norm_backward(k_ref[...], dk_CK, 1.0, use_qk_l2norm).astype(dk_ref.dtype)
  dlog_to_end_C = decay_to_end_C * jnp.sum(dkd_CK * k_CK.astype(jnp.float32), axis=1)
  last_C = jax.lax.broadcasted_iota(jnp.int32, (chunk_size,), 0) == chunk_size - 1
  dcum_C = (dcum_wy_ref[...] + gamma_C * dgamma_C + jnp.sum(dlog_ratio_CC, axis=1)
            - jnp.sum(dlog_ratio_CC, axis=0) - dlog_to_end_C
            + jnp.where(last_C, jnp.sum(dlog_to_end_C), 0.0))
  dg_ref[...] = jnp.sum(jnp.where(row_CC >= col_CC, dcum_C[:, None], 0.0), axis=0)
