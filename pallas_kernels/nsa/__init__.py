"""Native sparse attention (compressed + selected + sliding-window branches) as used by NSA and
laNSA layers (§6).

Public entry: `nsa_attention`. The branch helpers (`compress`, `compressed_attention`,
`select_blocks`, `selected_attention`) live in `pallas_kernels.nsa.reference`.
"""

from __future__ import annotations

import functools
import numbers

import jax

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.nsa import reference

__all__ = ["nsa_attention"]


def _check_arguments(q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size, block_count, window_size):
  for name, array in (("q_BTHD", q_BTHD), ("k_BTKD", k_BTKD), ("v_BTKD", v_BTKD),
                      ("gates_BTH3", gates_BTH3)):
    if array.ndim != 4:
      raise ValueError(f"nsa_attention: {name} must be 4-D, got shape {array.shape}")
  batch, query_len, num_q_heads, head_dim = q_BTHD.shape
  _, key_len, num_kv_heads, key_dim = k_BTKD.shape
  if k_BTKD.shape[0] != batch:
    raise ValueError(f"nsa_attention: k_BTKD batch {k_BTKD.shape[0]} != q_BTHD batch {batch}")
  if v_BTKD.shape[:3] != k_BTKD.shape[:3]:
    raise ValueError(
        f"nsa_attention: v_BTKD shape {v_BTKD.shape} must match k_BTKD {k_BTKD.shape} on"
        " [B, T, Hkv]")
  if key_dim != head_dim:
    raise ValueError(f"nsa_attention: k_BTKD head dim {key_dim} != q_BTHD head dim {head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"nsa_attention: query heads ({num_q_heads}, q_BTHD) must be a multiple of KV heads"
        f" ({num_kv_heads}, k_BTKD)")
  if query_len > key_len:
    raise ValueError(
        f"nsa_attention: q_BTHD has T_q={query_len} queries but k_BTKD only T_k={key_len} keys;"
        " queries are the last T_q positions, so T_q <= T_k")
  if gates_BTH3.shape != (batch, query_len, num_q_heads, 3):
    raise ValueError(
        f"nsa_attention: gates_BTH3 must have shape [B, T_q, Hq, 3] ="
        f" {(batch, query_len, num_q_heads, 3)}, got {gates_BTH3.shape}")
  for name, value in (("block_size", block_size), ("block_count", block_count),
                      ("window_size", window_size)):
    if not isinstance(value, numbers.Integral) or value <= 0:
      raise ValueError(f"nsa_attention: {name} must be a positive int, got {value!r}")


# Jitted so that eager callers (tests, notebooks) compile once per shape, not once per op; under an
# outer jit this is free. Validation runs at trace time.
@functools.partial(
    jax.jit,
    static_argnames=("block_size", "block_count", "window_size", "scale", "implementation"))
def nsa_attention(
    q_BTHD: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    gates_BTH3: jax.Array,
    *,
    block_size: int,
    block_count: int,
    window_size: int,
    scale: float | None = None,
    implementation: Implementation = None,
) -> jax.Array:
  """NSA: gated sum of compressed, selected-block and sliding-window attention.

  Args:
    q_BTHD: [B, T_q, Hq, D] queries (after RoPE), the last T_q of the T_k positions (T_q == T_k in
      training; T_q < T_k when decoding against the full cache).
    k_BTKD, v_BTKD: [B, T_k, Hkv, D] keys (after RoPE) and [B, T_k, Hkv, Dv] values; query head h
      reads KV head h // (Hq // Hkv).
    gates_BTH3: [B, T_q, Hq, 3] already-sigmoided gates ordered [cmp, slc, swa].
    block_size: tokens per compression / selection block (64 in the paper's models).
    block_count: selected blocks per (query, KV head), forced ones included (16).
    window_size: keys in the sliding window, the current one included (512).
    scale: score multiplier of every branch, default D**-0.5.
    implementation: see `pallas_kernels.dispatch.resolve`; only "xla" exists.

  Returns:
    [B, T_q, Hq, Dv] in q's dtype (branches are combined in float32, float64 for float64 inputs).
  """
  _check_arguments(q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size, block_count, window_size)
  version = resolve("nsa_attention", implementation, {"xla": reference.nsa_attention})
  return version(
      q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size=block_size, block_count=block_count,
      window_size=window_size, scale=scale)
