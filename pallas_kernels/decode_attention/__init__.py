"""Decode attention: one query per (batch row, query head) over a KV cache's slots.

Public entry: `decode_attention`. It serves every decode cache: the LTE cache (ring + compacted
out-of-window set, per-(row, KV head) lengths and ring blanks, §5.3 step 4), the SWA
ring and the full-attention cache. See `reference` for the exact definition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import pallas, reference
from pallas_kernels.decode_attention.pallas import DecodeBlockSizes
from pallas_kernels.dispatch import Implementation, resolve

__all__ = ["decode_attention", "DecodeBlockSizes"]


def _check_arguments(q_BHD, k_BNKD, v_BNKD, length_BK, key_valid):
  if q_BHD.ndim != 3:
    raise ValueError(f"decode_attention: q_BHD must be 3-D [B, Hq, D], got shape {q_BHD.shape}")
  for name, array in (("k_BNKD", k_BNKD), ("v_BNKD", v_BNKD)):
    if array.ndim != 4:
      raise ValueError(f"decode_attention: {name} must be 4-D [B, N, Hkv, D], got {array.shape}")
  batch, num_q_heads, head_dim = q_BHD.shape
  _, num_slots, num_kv_heads, key_dim = k_BNKD.shape
  if k_BNKD.shape[0] != batch:
    raise ValueError(f"decode_attention: k_BNKD batch {k_BNKD.shape[0]} != q_BHD batch {batch}")
  if v_BNKD.shape[:3] != k_BNKD.shape[:3]:
    raise ValueError(f"decode_attention: v_BNKD shape {v_BNKD.shape} must match k_BNKD"
                     f" {k_BNKD.shape} on [B, N, Hkv]")
  if key_dim != head_dim:
    raise ValueError(f"decode_attention: k_BNKD head dim {key_dim} != q_BHD head dim {head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(f"decode_attention: query heads ({num_q_heads}) must be a multiple of KV"
                     f" heads ({num_kv_heads})")
  if length_BK is not None:
    if length_BK.shape != (batch, num_kv_heads):
      raise ValueError(f"decode_attention: length_BK must have shape [B, Hkv] ="
                       f" {(batch, num_kv_heads)}, got {length_BK.shape}")
    if not jnp.issubdtype(length_BK.dtype, jnp.integer):
      raise ValueError(f"decode_attention: length_BK must be integer, got {length_BK.dtype}")
  if key_valid is not None:
    if key_valid.shape not in ((batch, num_slots), (batch, num_kv_heads, num_slots)):
      raise ValueError(f"decode_attention: key_valid must have shape [B, N] = {(batch, num_slots)}"
                       f" or [B, Hkv, N] = {(batch, num_kv_heads, num_slots)}, got"
                       f" {key_valid.shape}")
    if key_valid.dtype != bool:
      raise ValueError(f"decode_attention: key_valid must be bool, got {key_valid.dtype}")


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
    implementation: see `pallas_kernels.dispatch.resolve`; "xla" or "pallas".
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
                    {"xla": reference.decode_attention, "pallas": pallas_version})
  return version(q_BHD, k_BNKD, v_BNKD, scale=scale, length_BK=length_BK, key_valid=key_valid)
