"""Decode attention: one query per (batch row, query head) over a KV cache's slots.

Public entries: `decode_attention`, which serves every decode cache: the LTE cache (ring +
compacted out-of-window set, per-(row, KV head) lengths and ring blanks, §5.3 step 4), the SWA
ring and the full-attention cache; and `decode_attention_weights`, the same query's softmax
weights over the slots (what TOVA eviction ranks tokens by, §7.1). See `reference` for the exact
definitions. Both take a decode cache stacked over layer groups with the group to read
(`group=`, `pallas_kernels.stacked`), or one plain cache.

Versions: "xla" reads the group's slots block by block (`stacked.streamed_attention`, an online
softmax; `streamed_scores` for the weights), "pallas" is the split-K kernel of pallas.py;
`reference` (dense, the ground truth of the tests) takes the same arguments.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention_checks import check_mask, check_qkv
from pallas_kernels.decode_attention import pallas, reference
from pallas_kernels.decode_attention.pallas import DecodeBlockSizes
from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.masked_attention.reference import masked_softmax
from pallas_kernels.stacked import as_stacked, per_group, streamed_attention, streamed_scores

__all__ = ["decode_attention", "decode_attention_weights", "DecodeBlockSizes"]

# What implementation=None runs on a GPU: the split-K kernel (bandwidth-bound, reads each slot
# once for all G query heads); head dims it cannot tile go to "xla".
GPU_DEFAULT = ("pallas", "xla")


def _check_arguments(q_BHD, k_BNKD, v_BNKD, length_BK, key_valid, group, op="decode_attention"):
  k_BNKD = per_group(op, "k_BNKD", k_BNKD, group, 4)
  v_BNKD = per_group(op, "v_BNKD", v_BNKD, group, 4)
  check_qkv(op, q_BHD, k_BNKD, v_BNKD, names=("q_BHD", "k_BNKD", "v_BNKD"), one_query=True)
  batch, num_slots, num_kv_heads = k_BNKD.shape[:3]
  check_mask(op, "length_BK", length_BK, {"[B, Hkv]": (batch, num_kv_heads)}, integer=True)
  check_mask(op, "key_valid", key_valid, {"[B, N]": (batch, num_slots),
                                          "[B, Hkv, N]": (batch, num_kv_heads, num_slots)})


def _streamed_attention(q_BHD, k_GBNKD, v_GBNKD, group, *, scale, length_BK, key_valid):
  """The "xla" version: the group's slots read block by block, online softmax."""
  return streamed_attention(q_BHD, k_GBNKD, v_GBNKD, group, scale=scale, length_BK=length_BK,
                            key_valid=key_valid).astype(q_BHD.dtype)


def _streamed_weights(q_BHD, k_GBNKD, group, *, scale, length_BK, key_valid):
  """The "xla" version of the weights: scores read block by block, then the masked softmax."""
  scores_BHN = streamed_scores(q_BHD, k_GBNKD, group, scale=scale)
  batch, num_q_heads, num_slots = scores_BHN.shape
  num_kv_heads = k_GBNKD.shape[3]
  visible_BK1N = reference.visible_slots(num_slots, batch, num_kv_heads, length_BK=length_BK,
                                         key_valid=key_valid)[:, :, None, :]
  weights = masked_softmax(
      scores_BHN.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, num_slots),
      visible_BK1N)
  return weights.reshape(batch, num_q_heads, num_slots)


@functools.partial(jax.jit, static_argnames=("scale", "implementation", "block_sizes"))
def decode_attention(
    q_BHD: jax.Array,
    k_BNKD: jax.Array,
    v_BNKD: jax.Array,
    *,
    scale: float | None = None,
    length_BK: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    group: jax.Array | None = None,
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
    group: int32 [] layer group to read when k and v are stacked over the model's layer groups,
      [G, B, N, Hkv, D]: only that group's slots are read, in place (None: plain k and v).
    implementation: see `pallas_kernels.dispatch`; "xla" or "pallas" (None: GPU_DEFAULT on a GPU).
    block_sizes: tiling of the "pallas" version (None: its defaults).

  Returns:
    [B, Hq, Dv] in q's dtype; zeros for a query that sees no slot.
  """
  _check_arguments(q_BHD, k_BNKD, v_BNKD, length_BK, key_valid, group)
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  pallas_version = functools.partial(pallas.decode_attention,
                                     block_sizes=block_sizes or DecodeBlockSizes())
  version = resolve("decode_attention", implementation,
                    {"xla": _streamed_attention, "pallas": pallas_version},
                    gpu_default=GPU_DEFAULT)
  (k_GBNKD, index), (v_GBNKD, _) = as_stacked(k_BNKD, group), as_stacked(v_BNKD, group)
  return version(q_BHD, k_GBNKD, v_GBNKD, index, scale=scale, length_BK=length_BK,
                 key_valid=key_valid)


@functools.partial(jax.jit, static_argnames=("scale", "implementation"))
def decode_attention_weights(
    q_BHD: jax.Array,
    k_BNKD: jax.Array,
    *,
    scale: float | None = None,
    length_BK: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    group: jax.Array | None = None,
    implementation: Implementation = None,
) -> jax.Array:
  """The softmax weights of `decode_attention` (same arguments without the values).

  Returns [B, Hq, N] float32 (float64 for float64 inputs), 0 on invisible slots. One version:
  "xla" (None picks it on every backend).
  """
  _check_arguments(q_BHD, k_BNKD, k_BNKD, length_BK, key_valid, group,
                   op="decode_attention_weights")
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  version = resolve("decode_attention_weights", implementation,
                    {"xla": _streamed_weights}, gpu_default=("xla",))
  k_GBNKD, index = as_stacked(k_BNKD, group)
  return version(q_BHD, k_GBNKD, index, scale=scale, length_BK=length_BK, key_valid=key_valid)
