"""Native sparse attention (compressed + selected + sliding-window branches) as used by NSA and
laNSA layers (§6).

Public entry: `nsa_attention`. The branch helpers (`compress`, `compressed_attention`,
`select_blocks`, `selected_attention`) live in `pallas_kernels.nsa.reference`.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention_checks import check_positive_int, check_qkv
from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.nsa import reference

__all__ = ["nsa_attention"]

# What implementation=None runs on a GPU: only the reference exists so far.
GPU_DEFAULT = ("xla",)


def _check_arguments(q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size, block_count, window_size):
  op = "nsa_attention"
  check_qkv(op, q_BTHD, k_BTKD, v_BTKD, names=("q_BTHD", "k_BTKD", "v_BTKD"))
  batch, query_len, num_q_heads = q_BTHD.shape[:3]
  if gates_BTH3.shape != (batch, query_len, num_q_heads, 3):
    raise ValueError(
        f"{op}: gates_BTH3 must have shape [B, T_q, Hq, 3] ="
        f" {(batch, query_len, num_q_heads, 3)}, got {gates_BTH3.shape}")
  for name, value in (("block_size", block_size), ("block_count", block_count),
                      ("window_size", window_size)):
    check_positive_int(op, name, value)


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
  version = resolve("nsa_attention", implementation, {"xla": reference.nsa_attention},
                    gpu_default=GPU_DEFAULT)
  return version(
      q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size=block_size, block_count=block_count,
      window_size=window_size, scale=scale)
