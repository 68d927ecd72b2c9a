"""`implementation="pallas"` of `chunk_gated_delta_rule`: the chunked WY form around Pallas kernels.

Split (§2 notation, per batch row and head, chunks of C tokens):
  (a) per chunk, in parallel, Pallas kernels (pallas_prepare.py, with the blockwise chunk inverse
      of pallas_inverse.py): l2norm, cumulative log-decay, A, T = (I + A)^-1,
      w = T diag(beta exp(G)) k, u = T diag(beta) v, kd = diag(exp(G_C - G)) k, a = exp(G_C); and
      the output's inputs qg = q exp(G), p = q k^T ⊙ M (M[i,j] = exp(G_i - G_j), j <= i); no
      head-major copies, A and X the only [C, C] tensors in memory. Measured (a) alone on one
      H100 (2026-11-23), forward + backward, against the same step as XLA batched matmuls
      (xla_prepare.py, now the kernels' test reference) in ms: B4 T4096 H64 K=V=128 8.85 /
      6.15, B8 T4096 H8 K=V=256 3.72 / 3.59, K=V=128 2.48 / 1.78, B1 T16384 H8 1.79 / 1.08
      (forward alone 3.46 / 2.15 at B4 H64);
  (b) the sequential pass over chunks with the outputs fused in (Pallas, pallas_state_pass.py):
      v_new = u - w h, o = qg h + p v_new, h <- a h + kd^T v_new, keeping each program's state
      slice on chip (the per-chunk states never reach memory unless a gradient needs them).
The gradient composes the hand-written backwards of the Pallas pieces (`prepare_chunks` and
`chunk_scan` are custom_vjps).

Precision: float32 inputs use float32 everywhere at full precision (the float32 tolerance); bf16
inputs keep float32 states and accumulation, compute the inverse in float32 with TF32 dots, feed
the other matmuls bf16 operands and store X, w, u, kd, v_new and the per-chunk states in bf16, as
FLA does.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gated_delta_rule.pallas_prepare import PrepareConfig, prepare_chunks
from pallas_kernels.gated_delta_rule.pallas_state_pass import (
    StatePassConfig,
    chunk_scan,
    default_state_config,
)
from pallas_kernels.gated_delta_rule.reference import compute_dtype
from pallas_kernels.gated_delta_rule.xla_prepare import uses_exact_matmuls
from pallas_kernels.pallas_common import next_power_of_two

__all__ = ["chunk_gated_delta_rule_pallas"]


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


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                                  use_qk_l2norm, chunk_size: int,
                                  state_config: StatePassConfig | None = None,
                                  prepare_config: PrepareConfig | None = None):
  """Same contract as `chunk_gated_delta_rule` (inputs validated there)."""
  _check_supported(q, k, v, g, beta, initial_state, chunk_size)
  exact = uses_exact_matmuls(q, k, v)
  store_dtype = "float32" if exact else "bfloat16"
  batch, seq_len, heads, key_dim = q.shape
  value_dim = v.shape[3]
  w, u, kd, qg, p, chunk_decay = prepare_chunks(
      q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, prepare_config)
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
