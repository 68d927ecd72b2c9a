"""`implementation="pallas"` of `chunk_gated_delta_rule`: the chunked WY form around Pallas kernels.

Split (REFERENCE_SPEC §2 notation, per batch row and head, chunks of C tokens):
  (a) per chunk, in parallel (`prepare_scan_inputs`: XLA batched matmuls, the inverse in one
      Pallas program per chunk, pallas_inverse.py): l2norm, cumulative log-decay, A,
      T = (I + A)^-1, w = T diag(beta exp(G)) k, u = T diag(beta) v, kd = diag(exp(G_C - G)) k,
      a = exp(G_C); and the output's inputs qg = q exp(G), p = q k^T ⊙ M (M[i,j] = exp(G_i - G_j),
      j <= i). `fused_prepare=True` runs (a) as one fused Pallas kernel per chunk instead
      (pallas_prepare.py, hand-written backward kernel); it measured slower on one H100 (K=V=128:
      prep fwd 2.56 vs 1.71 ms, fwd+bwd 13.5 vs ~4 ms; its 63 serial substitution steps per
      chunk dominate) and its backward needs more shared memory than Hopper has at K=256, so it
      is opt-in for K, V <= 128 until its inverse is blockwise;
  (b) the sequential pass over chunks with the outputs fused in (Pallas, pallas_state_pass.py):
      v_new = u - w h, o = qg h + p v_new, h <- a h + kd^T v_new, keeping each program's state
      slice on chip (the per-chunk states never reach memory unless a gradient needs them).
The gradient composes autodiff of (a) with the hand-written backwards of the Pallas pieces
(`chunk_scan` and the inverse are custom_vjps). `prepare_scan_inputs` is also the reference the
fused preparation kernels are tested against.

Precision: float32 inputs use float32 everywhere at full precision (the float32 tolerance); bf16
inputs keep float32 states, accumulation and inverse but feed the matmuls bf16 operands and store
w, u, kd, v_new and the per-chunk states in bf16, as FLA does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.pallas_prepare import (
    PrepareConfig,
    next_power_of_two,
    prepare_chunks,
    uses_exact_matmuls,
)
from pallas_kernels.gated_delta_rule.pallas_state_pass import (
    StatePassConfig,
    chunk_scan,
    default_state_config,
)
from pallas_kernels.gated_delta_rule.pallas_inverse import unit_lower_inverse
from pallas_kernels.gated_delta_rule.reference import _prepare_inputs, compute_dtype

__all__ = ["chunk_decays", "chunk_gated_delta_rule_pallas", "chunk_layout", "next_power_of_two",
           "prepare_scan_inputs", "uses_exact_matmuls", "wy_transform"]


def _matmul(spec, a, b, *, exact):
  """einsum with float32 results: full float32 when exact, else bf16 operands (tensor cores)."""
  if exact:
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
  return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)


def _check_supported(q, k, v, g, beta, initial_state, chunk_size):
  if chunk_size < 16 or chunk_size & (chunk_size - 1):
    raise NotImplementedError(
        f"chunk_gated_delta_rule(implementation='pallas'): chunk_size = {chunk_size}; the Triton"
        " kernels need a power of two >= 16")
  for name, size in (("K", q.shape[-1]), ("V", v.shape[-1])):
    # Checked before any kernel runs (eagerly, the preparation would compile first), so the
    # dispatcher's fallback to "xla" sees this error and not a Triton resource failure.
    if next_power_of_two(size) > 256:
      raise NotImplementedError(
          f"chunk_gated_delta_rule(implementation='pallas'): {name} = {next_power_of_two(size)}"
          " > 256 (padded); the preparation's [C, 256] tiles are the largest that fit on chip"
          " (use implementation='xla')")
  dtype = compute_dtype(q, k, v, g, beta, initial_state)
  if dtype != jnp.float32:
    raise NotImplementedError(
        f"chunk_gated_delta_rule(implementation='pallas'): compute dtype {dtype}; Triton kernels"
        " have no float64 matmuls (use implementation='xla')")


def prepare_scan_inputs(q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm,
                        chunk_size: int):
  """Step (a), all chunks at once (XLA, with the Pallas inverse); the default preparation and the
  reference of pallas_prepare.prepare_chunks (tests).

  Returns (w, u, kd, qg, p, chunk_decay, padded initial state), the arguments of `chunk_scan`
  before its static ones; see pallas_state_pass.py for their layouts. Its three parts are
  separate functions so that compare_fla.py can time each.
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
  p_BHNCC = _matmul("bhnik,bhnjk->bhnij", q_BHNCK, k_BHNCK, exact=exact) * decay_BHNCC
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
  kk_BHNCC = _matmul("bhnik,bhnjk->bhnij", k_BHNCK, k_BHNCK, exact=exact)
  a_BHNCC = beta_BHNC[..., :, None] * jnp.where(strictly_lower_CC, decay_BHNCC, 0.0) * kk_BHNCC
  t_BHNCC = unit_lower_inverse(a_BHNCC) * beta_BHNC[..., None, :]
  w_BHNCK = _matmul("bhnij,bhnjk->bhnik", t_BHNCC * gamma_BHNC[..., None, :], k_BHNCK,
                    exact=exact)
  u_BHNCV = _matmul("bhnij,bhnjv->bhniv", t_BHNCC, v_BHNCV, exact=exact)
  return w_BHNCK, u_BHNCV


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                                  use_qk_l2norm, chunk_size: int,
                                  state_config: StatePassConfig | None = None,
                                  fused_prepare: bool = False,
                                  prepare_config: PrepareConfig | None = None):
  """Same contract as `chunk_gated_delta_rule` (inputs validated there)."""
  _check_supported(q, k, v, g, beta, initial_state, chunk_size)
  exact = uses_exact_matmuls(q, k, v)
  store_dtype = "float32" if exact else "bfloat16"
  batch, seq_len, heads, key_dim = q.shape
  value_dim = v.shape[3]
  if not fused_prepare:
    *scan_inputs, state_BHKV = prepare_scan_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size)
    return _scan(scan_inputs, state_BHKV, chunk_size, store_dtype, exact, state_config,
                 output_final_state, seq_len, key_dim, value_dim, v.dtype)
  if max(next_power_of_two(key_dim), next_power_of_two(value_dim)) > 128:
    raise NotImplementedError(
        "chunk_gated_delta_rule(implementation='pallas', fused_prepare=True): K, V padded to"
        f" {next_power_of_two(key_dim)}, {next_power_of_two(value_dim)}; the fused preparation's"
        " backward needs > 227 KiB of shared memory above 128 (use fused_prepare=False)")
  w, u, kd, qg, p, chunk_decay = prepare_chunks(
      q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
      config=prepare_config)
  padded_k, padded_v = w.shape[-1], u.shape[-1]
  if initial_state is None:
    state_BHKV = jnp.zeros((batch, heads, padded_k, padded_v), jnp.float32)
  else:
    state_BHKV = jnp.pad(initial_state.astype(jnp.float32),
                         [(0, 0), (0, 0), (0, padded_k - key_dim), (0, padded_v - value_dim)])
  return _scan((w, u, kd, qg, p, chunk_decay), state_BHKV, chunk_size, store_dtype, exact,
               state_config, output_final_state, seq_len, key_dim, value_dim, v.dtype)


def _scan(scan_inputs, state_BHKV, chunk_size, store_dtype, exact, state_config,
          output_final_state, seq_len, key_dim, value_dim, dtype):
  """Step (b) and the slicing back to the caller's T, K, V."""
  o_BTHV, final_state_BHKV = chunk_scan(
      *scan_inputs, state_BHKV, chunk_size, store_dtype, exact,
      default_state_config(state_BHKV.shape[2]) if state_config is None else state_config)
  o_BTHV = o_BTHV[:, :seq_len, :, :value_dim].astype(dtype)
  if not output_final_state:
    return o_BTHV, None
  return o_BTHV, final_state_BHKV[:, :, :key_dim, :value_dim]
