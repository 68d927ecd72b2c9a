"""Decode attention: one query per (batch row, query head) over a KV cache's slots.

Public entries: `decode_attention`, which serves every decode cache: the LTE cache (ring +
compacted out-of-window set, per-(row, KV head) lengths and ring blanks, §5.3 step 4), the SWA
ring and the full-attention cache; and `decode_attention_weights`, the same query's softmax
weights over the slots (what TOVA eviction ranks tokens by, §7.1). See `reference` for the exact
definitions.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention_checks import check_mask, check_qkv
from pallas_kernels.decode_attention import pallas, reference
from pallas_kernels.decode_attention.pallas import DecodeBlockSizes
from pallas_kernels.dispatch import Implementation, resolve

__all__ = ["decode_attention", "decode_attention_weights", "DecodeBlockSizes"]

# What implementation=None runs on a GPU: the split-K kernel (bandwidth-bound, reads each slot
# once for all G query heads); head dims it cannot tile go to "xla".
GPU_DEFAULT = ("pallas", "xla")


def _check_arguments(q_BHD, k_BNKD, v_BNKD, length_BK, key_valid, op="decode_attention"):
  check_qkv(op, q_BHD, k_BNKD, v_BNKD, names=("q_BHD", "k_BNKD", "v_BNKD"), one_query=True)
  batch, num_slots, num_kv_heads = k_BNKD.shape[:3]
  check_mask(op, "length_BK", length_BK, {"[B, Hkv]": (batch, num_kv_heads)}, integer=True)
  check_mask(op, "key_valid", key_valid, {"[B, N]": (batch, num_slots),
                                          "[B, Hkv, N]": (batch, num_kv_heads, num_slots)})


@functools.partial(jax.jit, static_argnames=("scale", "implementation", "block_sizes"))
def decode_attention(
    q_BHD: jax.Array,
    k_BNKD: jax.Array,
    v_BNKD: jax.Array,
    *,
    scale: float | None = None,
    length_BK: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    implementation: Implementation = None,
    block_sizes: DecodeBlockSizes | None = None,
) -> jax.Array:
  """Softmax attention of one query per (row, query head) over the visible cache slots.

  Args:
    q_BHD: [B, Hq, D] the new token's queries (after RoPE).
    k_BNKD, v_BNKD: [B, N, Hkv, D] / [B, N, Hkv, Dv] cache slots; Hq % Hkv == 0 and query head i
      reads KV head i // (Hq // Hkv). Slot order does not matter (no causal mask).
    scale: score multiplier, default D**-0.5.
    length_BK: int [B, Hkv]; only slots n < length[b, h] are visible (None: all N).
    key_valid: bool [B, N] (shared by the KV heads) or [B, Hkv, N]; False slots are invisible.
    implementation: see `pallas_kernels.dispatch`; "xla" or "pallas" (None: GPU_DEFAULT on a GPU).
    block_sizes: tiling of the "pallas" version (None: its defaults).

  Returns:
    [B, Hq, Dv] in q's dtype; zeros for a query that sees no slot.
  """
  _check_arguments(q_BHD, k_BNKD, v_BNKD, length_BK, key_valid)
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  pallas_version = functools.partial(pallas.decode_attention,
                                     block_sizes=block_sizes or DecodeBlockSizes())
  version = resolve("decode_attention", implementation,
                    {"xla": reference.decode_attention, "pallas": pallas_version},
                    gpu_default=GPU_DEFAULT)
  return version(q_BHD, k_BNKD, v_BNKD, scale=scale, length_BK=length_BK, key_valid=key_valid)


@functools.partial(jax.jit, static_argnames=("scale", "implementation"))
def decode_attention_weights(
    q_BHD: jax.Array,
    k_BNKD: jax.Array,
    *,
    scale: float | None = None,
    length_BK: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    implementation: Implementation = None,
) -> jax.Array:
  """The softmax weights of `decode_attention` (same arguments without the values).

  Returns [B, Hq, N] float32 (float64 for float64 inputs), 0 on invisible slots. One version:
  "xla" (None picks it on every backend).
  """
  _check_arguments(q_BHD, k_BNKD, k_BNKD, length_BK, key_valid, op="decode_attention_weights")
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  version = resolve("decode_attention_weights", implementation,
                    {"xla": reference.decode_attention_weights}, gpu_default=("xla",))
  return version(q_BHD, k_BNKD, scale=scale, length_BK=length_BK, key_valid=key_valid)
