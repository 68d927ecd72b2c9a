"""Native sparse attention (compressed + selected + sliding-window branches) as used by NSA and
laNSA layers (§6).

Public entries: `nsa_attention` (training, prefill) and, for decoding against a cache,
`nsa_decode_attention` with the cache updates `compress_prompt` and `append_token` (decode.py).
The branch helpers (`compress`, `compressed_attention`, `select_blocks`, `selected_attention`)
live in `pallas_kernels.nsa.reference`; the kernels in pallas_compressed.py (compressed branch and
block importance), selection.py (top-n, XLA), pallas_selected.py (selected blocks) and
pallas_decode.py; the window branch is masked_attention's.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention_checks import check_positive_int, check_qkv
from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.nsa import pallas, reference
from pallas_kernels.nsa.decode import (
    append_token, cache_length, compress_prompt, compressed_blocks, nsa_decode_attention)
from pallas_kernels.nsa.tiling import NSABlockSizes

__all__ = ["nsa_attention", "nsa_decode_attention", "append_token", "compress_prompt",
           "cache_length", "compressed_blocks", "NSABlockSizes"]

# What implementation=None runs on a GPU: the Pallas kernels; inputs they cannot tile (fewer than
# 16 query heads per KV head, head dims or block sizes that are not powers of two >= 16) go to
# "xla".
GPU_DEFAULT = ("pallas", "xla")


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
    implementation: see `pallas_kernels.dispatch`: "xla" (dense reference) or "pallas" (the
      kernels of pallas.py); None: GPU_DEFAULT on a GPU, "xla" elsewhere.

  Returns:
    [B, T_q, Hq, Dv] in q's dtype (branches are combined in float32, float64 for float64 inputs).
  """
  _check_arguments(q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size, block_count, window_size)
  version = resolve("nsa_attention", implementation,
                    {"xla": reference.nsa_attention, "pallas": pallas.nsa_attention},
                    gpu_default=GPU_DEFAULT)
  return version(
      q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size=block_size, block_count=block_count,
      window_size=window_size, scale=scale)
