"""Dense reference for decode attention: one query per (batch row, query head) over cache slots.

Slot n of KV head h in row b is visible iff `n < length_BK[b, h]` and `key_valid[b, (h,) n]`
(each condition only when given). Query head i reads KV head i // (Hq // Hkv) (GQA, G21). A query
with no visible slot outputs zeros. The order of the slots is irrelevant (no causal mask): every
cached key is in the query's past. This is `masked_attention`'s definition with T = 1 and the
visibility given directly, so the decode path of every cache (LTE ring + compacted set, SWA ring,
full cache) shares one ground truth. The cache is stacked over layer groups, [G, B, N, Hkv, D],
and group `group` is read (`pallas_kernels.stacked`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention.reference import attention_probs, attention_with_mask


def visible_slots(num_slots: int, batch: int, num_kv_heads: int, *, length_BK=None,
                  key_valid=None) -> jax.Array:
  """bool [B, Hkv, N]: the slots each (row, KV head) attends to (module docstring)."""
  visible_BKN = jnp.ones((batch, num_kv_heads, num_slots), bool)
  if length_BK is not None:
    visible_BKN = visible_BKN & (jnp.arange(num_slots)[None, None, :] < length_BK[:, :, None])
  if key_valid is not None:
    visible_BKN = visible_BKN & (key_valid[:, None, :] if key_valid.ndim == 2 else key_valid)
  return visible_BKN


def decode_attention(q_BHD: jax.Array, k_GBNKD: jax.Array, v_GBNKD: jax.Array, group: jax.Array,
                     *, scale: float, length_BK: jax.Array | None = None,
                     key_valid: jax.Array | None = None) -> jax.Array:
  """[B, Hq, Dv] in q's dtype; softmax statistics in float32 (float64 for float64 inputs).

  Arguments are assumed valid (the public entry checks them).
  """
  k_BNKD, v_BNKD = k_GBNKD[group], v_GBNKD[group]
  batch, num_slots, num_kv_heads, _ = k_BNKD.shape
  visible_BKN = visible_slots(num_slots, batch, num_kv_heads, length_BK=length_BK,
                              key_valid=key_valid)
  out_B1HD = attention_with_mask(q_BHD[:, None], k_BNKD, v_BNKD, visible_BKN[:, :, None, :],
                                 scale=scale)
  return out_B1HD[:, 0].astype(q_BHD.dtype)


def decode_attention_weights(q_BHD: jax.Array, k_GBNKD: jax.Array, group: jax.Array, *,
                             scale: float, length_BK: jax.Array | None = None,
                             key_valid: jax.Array | None = None) -> jax.Array:
  """[B, Hq, N]: each query head's softmax weights over the slots (0 where invisible), float32
  (float64 for float64 inputs). Arguments are assumed valid (the public entry checks them)."""
  k_BNKD = k_GBNKD[group]
  batch, num_slots, num_kv_heads, _ = k_BNKD.shape
  visible_BKN = visible_slots(num_slots, batch, num_kv_heads, length_BK=length_BK,
                              key_valid=key_valid)
  probs_BKG1N = attention_probs(q_BHD[:, None], k_BNKD, visible_BKN[:, :, None, :], scale=scale)
  return probs_BKG1N.reshape(batch, q_BHD.shape[1], num_slots)
