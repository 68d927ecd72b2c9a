"""The preparation of the chunked gated delta rule (step (a) of pallas.py) as XLA batched matmuls
around the Pallas chunk inverse (pallas_inverse.py), all chunks at once: the readable reference
of the preparation kernels (pallas_prepare.py), whose outputs and gradients the tests compare with
it, and their timing baseline in tools/compare_fla.py (which times its three parts one by one).

Per batch row, head and chunk of C tokens (§2; G = in-chunk cumulative log-decay):
l2norm, the decays, A = diag(beta) (k k^T ⊙ exp(G_i - G_j)) strictly below the diagonal,
T = (I + A)^-1 diag(beta), w = T diag(exp(G)) k, u = T v, kd = diag(exp(G_C - G)) k,
qg = diag(exp(G)) q, p = (q k^T) ⊙ exp(G_i - G_j) (j <= i) and the chunk decay exp(G_C).
Its gradient is XLA's autodiff with the inverse's closed-form backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.pallas_inverse import unit_lower_inverse
from pallas_kernels.gated_delta_rule.reference import _prepare_inputs
from pallas_kernels.pallas_common import next_power_of_two

__all__ = ["chunk_decays", "chunk_layout", "prepare_scan_inputs", "uses_exact_matmuls",
           "wy_transform", "xla_matmul"]


def xla_matmul(exact):
  """einsum(spec, a, b) in XLA with float32 results: full float32 when exact, else bf16 operands
  (tensor cores)."""
  if exact:
    return functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  return lambda spec, a, b: jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                       preferred_element_type=jnp.float32)


def uses_exact_matmuls(q, k, v) -> bool:
  """float32 q, k, v: full-precision float32 matmuls and storage; otherwise bf16 operands."""
  return all(jnp.dtype(x.dtype) == jnp.float32 for x in (q, k, v))


def prepare_scan_inputs(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm,
                        chunk_size: int):
  """Step (a), all chunks at once (module docstring).

  Returns (w, u, kd, qg, p, chunk_decay, padded initial state), the arguments of `chunk_scan`
  before its static ones; see pallas_state_pass.py for their layouts.
  """
  exact = uses_exact_matmuls(q, k, v)
  q_BHNCK, k_BHNCK, v_BHNCV, g_BHNC, beta_BHNC, state_BHKV = chunk_layout(
      q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
      chunk_size=chunk_size)
  decay_BHNCC, gamma_BHNC, decay_to_end_BHNC = chunk_decays(g_BHNC, exact=exact)
  w_BHNCK, u_BHNCV = wy_transform(k_BHNCK, v_BHNCV, beta_BHNC, decay_BHNCC, gamma_BHNC,
                                  exact=exact)
  kd_BHNCK = decay_to_end_BHNC[..., None] * k_BHNCK
  # The decayed causal attention within each chunk and the decayed queries (the outputs' inputs).
  p_BHNCC = xla_matmul(exact)("bhnik,bhnjk->bhnij", q_BHNCK, k_BHNCK) * decay_BHNCC
  qg_BHNCK = gamma_BHNC[..., None] * q_BHNCK

  batch, heads, num_chunks = g_BHNC.shape[:3]
  store_dtype = q_BHNCK.dtype
  flat = lambda x: x.reshape(batch, heads, num_chunks * chunk_size, x.shape[-1]).astype(
      store_dtype)
  return (flat(w_BHNCK), flat(u_BHNCV), flat(kd_BHNCK), flat(qg_BHNCK), flat(p_BHNCC),
          gamma_BHNC[..., -1], state_BHKV)


def chunk_layout(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm, chunk_size: int):
  """Normalised, padded, head-major chunks: q, k `[B,H,N,C,Kp]`, v `[B,H,N,C,Vp]` in the store
  dtype, g, beta `[B,H,N,C]` float32, and the initial state padded to `[B,H,Kp,Vp]`."""
  store_dtype = jnp.float32 if uses_exact_matmuls(q, k, v) else jnp.bfloat16
  q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV = _prepare_inputs(
      q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
  # bf16 path: normalised q, k (and v) go back to bf16 at once (as FLA's l2norm output does), so
  # the padding, the head-major copies and every matmul operand move half the bytes; the decays,
  # A, T and all accumulations stay float32. Measured on an H200 at B8 T4096 H8 K=V=256 with float32
  # copies: this preparation took 1.45 ms of the 2.43 ms forward.
  q_BTHK, k_BTHK, v_BTHV = (x.astype(store_dtype) for x in (q_BTHK, k_BTHK, v_BTHV))
  batch, seq_len, heads, key_dim = q_BTHK.shape
  value_dim = v_BTHV.shape[-1]
  # Zero-padding K and V is exact: zero key components never touch the state, zero value columns
  # give zero outputs; both are sliced off at the end.
  padded_k = next_power_of_two(key_dim)
  padded_v = next_power_of_two(value_dim)
  num_chunks = -(-seq_len // chunk_size)
  pad_t = num_chunks * chunk_size - seq_len

  # Padding tokens: g = 0, beta = 0, k = 0 leave the state unchanged (as in the reference).
  def to_chunks(x, width=None):
    pads = [(0, 0), (0, pad_t)] + [(0, 0)] * (x.ndim - 2)
    if width is not None:
      pads[-1] = (0, width - x.shape[-1])
    x = jnp.pad(x, pads)
    return x.reshape((batch, num_chunks, chunk_size) + x.shape[2:])

  # [B,N,C,H,D] -> [B,H,N,C,D]: the scan reads each head's chunks contiguously.
  head_major = lambda x: jnp.transpose(x, (0, 3, 1, 2, 4))
  state_BHKV = jnp.pad(state_BHKV, [(0, 0), (0, 0), (0, padded_k - key_dim),
                                    (0, padded_v - value_dim)])
  return (head_major(to_chunks(q_BTHK, padded_k)), head_major(to_chunks(k_BTHK, padded_k)),
          head_major(to_chunks(v_BTHV, padded_v)), jnp.transpose(to_chunks(g_BTH), (0, 3, 1, 2)),
          jnp.transpose(to_chunks(beta_BTH), (0, 3, 1, 2)), state_BHKV)


def chunk_decays(g_BHNC, *, exact: bool):
  """Within-chunk decays from the log-decays g `[B,H,N,C]`: decay[i, j] = exp(sum_{j<m<=i} g_m)
  for j <= i (0 above the diagonal), gamma_i = exp(sum_{m<=i} g_m) and exp(sum_{m>i} g_m).

  exact (float32 inputs): the exponents are segment sums of g, as in the reference, so a chunk
  whose cumulative log-decay is large (strong decay) loses nothing to cancellation; they take a
  [C, C] cumulative sum per chunk. Otherwise (bf16 inputs) they are differences G_i - G_j of the
  chunk's cumulative sums, as FLA computes them: XLA then fuses the [C, C] decays into their
  consumers instead of writing them, and the cancellation (~|G| * 6e-8 in the exponent) is far
  below the bf16 tolerance. Measured on an H100 at B1 T16384 H8: the segment sums took 0.19 ms
  as a separate program.
  """
  chunk_size = g_BHNC.shape[-1]
  row_C1 = jnp.arange(chunk_size)[:, None]
  col_1C = jnp.arange(chunk_size)[None, :]
  cumulative_BHNC = jnp.cumsum(g_BHNC, axis=-1)
  gamma_BHNC = jnp.exp(cumulative_BHNC)
  if exact:
    # log_ratio[i, j] = sum_{j<m<=i} g_m (why: see the reference).
    log_ratio_BHNCC = jnp.cumsum(jnp.where(col_1C < row_C1, g_BHNC[..., :, None], 0.0), axis=-2)
    decay_to_end_BHNC = jnp.exp(log_ratio_BHNCC[..., -1, :])
  else:
    # Zeroed above the diagonal before exp: there G_i - G_j >= 0 could overflow, and an inf in
    # the unselected branch of the where below would turn its gradient into NaN.
    log_ratio_BHNCC = jnp.where(col_1C <= row_C1,
                                cumulative_BHNC[..., :, None] - cumulative_BHNC[..., None, :], 0.0)
    decay_to_end_BHNC = jnp.exp(cumulative_BHNC[..., -1:] - cumulative_BHNC)
  decay_BHNCC = jnp.where(col_1C <= row_C1, jnp.exp(log_ratio_BHNCC), 0.0)
  return decay_BHNCC, gamma_BHNC, decay_to_end_BHNC


def wy_transform(k_BHNCK, v_BHNCV, beta_BHNC, decay_BHNCC, gamma_BHNC, *, exact: bool):
  """w = T diag(gamma) k and u = T v with T = (I + A)^-1 diag(beta),
  A = diag(beta) (k k^T ⊙ decay) strictly below the diagonal."""
  chunk_size = beta_BHNC.shape[-1]
  strictly_lower_CC = jnp.arange(chunk_size)[None, :] < jnp.arange(chunk_size)[:, None]
  matmul = xla_matmul(exact)
  kk_BHNCC = matmul("bhnik,bhnjk->bhnij", k_BHNCK, k_BHNCK)
  a_BHNCC = beta_BHNC[..., :, None] * jnp.where(strictly_lower_CC, decay_BHNCC, 0.0) * kk_BHNCC
  t_BHNCC = unit_lower_inverse(a_BHNCC) * beta_BHNC[..., None, :]
  w_BHNCK = matmul("bhnij,bhnjk->bhnik", t_BHNCC * gamma_BHNC[..., None, :], k_BHNCK)
  u_BHNCV = matmul("bhnij,bhnjv->bhniv", t_BHNCC, v_BHNCV)
  return w_BHNCK, u_BHNCV
