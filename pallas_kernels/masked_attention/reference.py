"""Dense reference for masked softmax attention: the one definition that full attention, SWA, sink
attention and the LTE layer share (§3.1, §4.2, G1, G21).

Queries are the last T of the S key positions: query i sits at absolute position p_i = S - T + i
(T == S in training, T < S when decoding against a cache). Key j is visible to query i iff

    j <= p_i                                                       (causal)
    and (window_size is None or p_i - j < window_size              (window, current key included)
         or j < num_sinks or kept_BSK[b, j, h_kv])                 (sinks, LTE-selected keys)
    and key_valid_BS[b, j]                                         (left padding, when given)

Query head h reads KV head h // (Hq // Hkv). A query with no visible key outputs zeros.

Everything here builds the full [T, S] score matrix; it is the ground truth, not the fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(dtype) -> jnp.dtype:
  """float32 for bf16/f16/f32 inputs, float64 for float64 ones: statistics never go below f32."""
  return jnp.promote_types(dtype, jnp.float32)


def attention_mask(
    query_len: int,
    key_len: int,
    *,
    window_size: int | None = None,
    num_sinks: int = 0,
    kept_BSK: jax.Array | None = None,
    key_valid_BS: jax.Array | None = None,
) -> jax.Array:
  """Boolean visibility mask, shape [B or 1, Hkv or 1, T, S] (broadcastable to [B, Hkv, T, S]).

  mask[b, h_kv, i, j] is True iff key j is visible to query i (absolute position key_len -
  query_len + i) for KV head h_kv, per the module docstring. The batch axis is 1 unless kept_BSK or
  key_valid_BS is given; the head axis is 1 unless kept_BSK is given. `num_sinks` and `kept_BSK`
  only matter when a window is set (without one, every causal key is visible already).
  """
  query_pos_T = jnp.arange(query_len) + (key_len - query_len)
  key_pos_S = jnp.arange(key_len)
  distance_TS = query_pos_T[:, None] - key_pos_S[None, :]
  mask_BKTS = (distance_TS >= 0)[None, None]
  if window_size is not None:
    near_or_sink_TS = (distance_TS < window_size) | (key_pos_S < num_sinks)[None, :]
    reachable_BKTS = near_or_sink_TS[None, None]
    if kept_BSK is not None:
      reachable_BKTS = reachable_BKTS | jnp.transpose(kept_BSK, (0, 2, 1))[:, :, None, :]
    mask_BKTS = mask_BKTS & reachable_BKTS
  if key_valid_BS is not None:
    mask_BKTS = mask_BKTS & key_valid_BS[:, None, None, :]
  return mask_BKTS


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to `mask` (broadcastable to scores).

  Masked entries get probability 0; a row with no visible entry is all zeros (not NaN), and so are
  its gradients.
  """
  masked_scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(masked_scores, axis=-1, keepdims=True)
  # An empty row has max -inf; shifting it by 0 instead keeps exp(-inf) = 0 rather than NaN. The
  # shift cancels in the ratio, so it carries no gradient.
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  weights = jnp.exp(masked_scores - row_max)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  return weights / jnp.where(total > 0, total, 1.0)


def attention_probs(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    mask_BKTS: jax.Array,
    *,
    scale: float,
) -> jax.Array:
  """softmax(scale * q k^T) restricted to the mask, with GQA: [B, Hkv, G, T, S] in the compute
  dtype (G = Hq // Hkv; query head h is (h // G, h % G)).

  q_BTHD [B, T, Hq, D]; k_BSKD [B, S, Hkv, D]; mask_BKTS bool, broadcastable to [B, Hkv, T, S].
  """
  batch, query_len, num_q_heads, head_dim = q_BTHD.shape
  num_kv_heads = k_BSKD.shape[2]
  group = num_q_heads // num_kv_heads
  dtype = compute_dtype(q_BTHD.dtype)
  # Consecutive query heads share a KV head (G21): split Hq into (Hkv, G).
  q_BTKGD = q_BTHD.reshape(batch, query_len, num_kv_heads, group, head_dim)
  # Scale the float32 scores, not the (possibly bf16) queries, so that scaling adds no rounding.
  scores_BKGTS = scale * jnp.einsum(
      "btkgd,bskd->bkgts", q_BTKGD, k_BSKD, precision=HIGHEST, preferred_element_type=dtype)
  return masked_softmax(scores_BKGTS, mask_BKTS[:, :, None])


def attention_with_mask(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    mask_BKTS: jax.Array,
    *,
    scale: float,
) -> jax.Array:
  """softmax(scale * q k^T restricted to the mask) v with GQA, in the compute dtype.

  q_BTHD [B, T, Hq, D]; k_BSKD [B, S, Hkv, D]; v_BSKD [B, S, Hkv, Dv]; mask_BKTS bool,
  broadcastable to [B, Hkv, T, S]. Returns [B, T, Hq, Dv] in float32 (float64 for float64 inputs);
  callers cast, so that sums of several branches (NSA) round only once.
  """
  batch, query_len, num_q_heads = q_BTHD.shape[:3]
  probs_BKGTS = attention_probs(q_BTHD, k_BSKD, mask_BKTS, scale=scale)
  out_BTKGD = jnp.einsum(
      "bkgts,bskd->btkgd", probs_BKGTS, v_BSKD.astype(probs_BKGTS.dtype), precision=HIGHEST)
  return out_BTKGD.reshape(batch, query_len, num_q_heads, v_BSKD.shape[-1])


def masked_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    num_sinks: int = 0,
    kept_BSK: jax.Array | None = None,
    key_valid_BS: jax.Array | None = None,
) -> jax.Array:
  """Masked attention per the module docstring; returns [B, T, Hq, Dv] in q's dtype.

  Arguments are assumed valid (the public entry checks them). scale defaults to D**-0.5.
  """
  query_len, key_len = q_BTHD.shape[1], k_BSKD.shape[1]
  if scale is None:
    scale = q_BTHD.shape[-1] ** -0.5
  mask_BKTS = attention_mask(
      query_len, key_len, window_size=window_size, num_sinks=num_sinks, kept_BSK=kept_BSK,
      key_valid_BS=key_valid_BS)
  out_BTHD = attention_with_mask(q_BTHD, k_BSKD, v_BSKD, mask_BKTS, scale=scale)
  return out_BTHD.astype(q_BTHD.dtype)
