"""Dense reference for native sparse attention as the authors use it (§6, G22).

Three branches over post-RoPE keys/values, mixed by per-head sigmoid gates:

- compressed: keys and values mean-pooled over non-overlapping blocks of `block_size` tokens (a
  partial last block averaged over its real length); query t attends the complete blocks
  c < NC = floor((t + 1) / block_size), and outputs 0 when NC = 0.
- selected: per (query t, KV head), block c's importance is the sum over the group's query heads
  of its compressed-attention probability, for complete earlier blocks c < IC = floor(t /
  block_size); blocks 0, IC - 1 and IC are forced (importance 1 per head, so they always win),
  blocks > IC are invalid. The `block_count` most important valid blocks are selected (fewer when
  fewer are valid; equal importances go to the lower block index, which matters only when
  block_count < 3 makes forced blocks compete). The group's query heads attend every token of the
  selected blocks, causally (j <= t).
- sliding window: the last `window_size` keys, the current one included.

o = g_slc * o_slc + g_cmp * o_cmp + g_swa * o_swa, gates ordered [cmp, slc, swa] on the last axis.

Queries may be the last T_q of the T_k key positions (decoding against a full cache): query i sits
at absolute position t = T_k - T_q + i, which every helper takes as `query_offset`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention.reference import (
    HIGHEST, attention_mask, attention_with_mask, compute_dtype, masked_softmax)


def compress(x_BTKD: jax.Array, block_size: int) -> jax.Array:
  """Mean of x over non-overlapping blocks of `block_size` tokens.

  x_BTKD [B, T, Hkv, D] -> [B, NB, Hkv, D] with NB = ceil(T / block_size), in the compute dtype;
  the last block is averaged over the tokens it really has.
  """
  batch, seq_len, num_heads, dim = x_BTKD.shape
  num_blocks = -(-seq_len // block_size)
  padded_BTKD = jnp.pad(
      x_BTKD.astype(compute_dtype(x_BTKD.dtype)),
      ((0, 0), (0, num_blocks * block_size - seq_len), (0, 0), (0, 0)))
  sums_BNKD = padded_BTKD.reshape(batch, num_blocks, block_size, num_heads, dim).sum(axis=2)
  tokens_N = jnp.minimum(block_size, seq_len - block_size * jnp.arange(num_blocks))
  return sums_BNKD / tokens_N[None, :, None, None].astype(sums_BNKD.dtype)


def compressed_attention(
    q_BTHD: jax.Array,
    k_cmp_BNKD: jax.Array,
    v_cmp_BNKD: jax.Array,
    *,
    block_size: int,
    scale: float,
    query_offset: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Attention of each query over the complete compressed blocks before it.

  q_BTHD [B, T, Hq, D]; k_cmp_BNKD / v_cmp_BNKD [B, NB, Hkv, D] from `compress`. Query i (absolute
  position t = query_offset + i) sees blocks c < floor((t + 1) / block_size).

  Returns (o_cmp [B, T, Hq, Dv], probs [B, T, Hq, NB]), both in the compute dtype; probs are the
  softmax weights exp(s - lse), 0 on blocks not seen; rows that see no block are all 0.
  """
  batch, query_len, num_q_heads, head_dim = q_BTHD.shape
  num_blocks, num_kv_heads = k_cmp_BNKD.shape[1], k_cmp_BNKD.shape[2]
  group = num_q_heads // num_kv_heads
  dtype = compute_dtype(q_BTHD.dtype)
  q_BTKGD = q_BTHD.astype(dtype).reshape(batch, query_len, num_kv_heads, group, head_dim)
  scores_BKGTN = scale * jnp.einsum(
      "btkgd,bnkd->bkgtn", q_BTKGD, k_cmp_BNKD.astype(dtype), precision=HIGHEST)
  complete_blocks_T = (query_offset + jnp.arange(query_len) + 1) // block_size
  visible_TN = jnp.arange(num_blocks)[None, :] < complete_blocks_T[:, None]
  probs_BKGTN = masked_softmax(scores_BKGTN, visible_TN)
  out_BTKGD = jnp.einsum(
      "bkgtn,bnkd->btkgd", probs_BKGTN, v_cmp_BNKD.astype(dtype), precision=HIGHEST)
  out_BTHD = out_BTKGD.reshape(batch, query_len, num_q_heads, v_cmp_BNKD.shape[-1])
  probs_BTHN = jnp.einsum("bkgtn->btkgn", probs_BKGTN).reshape(
      batch, query_len, num_q_heads, num_blocks)
  return out_BTHD, probs_BTHN


def block_importance(
    probs_BTHN: jax.Array,
    *,
    num_kv_heads: int,
    block_size: int,
    position_BT: jax.Array,
) -> jax.Array:
  """float [B, T, Hkv, NB]: how much each (query, KV head) wants each key block.

  probs_BTHN: compressed-attention probabilities from `compressed_attention`; position_BT: the
  queries' positions t, broadcastable to [B, T]. Per the module docstring: the sum over the
  group's query heads of the probability of complete earlier blocks c < IC = floor(t /
  block_size), 1 per head for the forced blocks 0, IC - 1 and IC, and -inf for blocks > IC (never
  selected). Carries no gradient.
  """
  batch, query_len, num_q_heads, num_blocks = probs_BTHN.shape
  group = num_q_heads // num_kv_heads
  current_BT1 = jnp.broadcast_to(position_BT, (batch, query_len))[..., None] // block_size
  block_N = jnp.arange(num_blocks)
  forced_BTN = (block_N == 0) | (block_N == current_BT1 - 1) | (block_N == current_BT1)
  earlier_BTN = block_N < current_BT1
  # Selection is piecewise constant in the inputs: no gradient flows through importance.
  probs_BTHN = jax.lax.stop_gradient(probs_BTHN)
  per_head_BTHN = jnp.where(
      forced_BTN[:, :, None], 1.0, jnp.where(earlier_BTN[:, :, None], probs_BTHN, 0.0))
  importance_BTKN = per_head_BTHN.reshape(
      batch, query_len, num_kv_heads, group, num_blocks).sum(axis=3)
  return jnp.where((block_N <= current_BT1)[:, :, None], importance_BTKN, -jnp.inf)


def select_blocks(
    probs_BTHN: jax.Array,
    *,
    num_kv_heads: int,
    block_size: int,
    block_count: int,
    query_offset: int = 0,
) -> jax.Array:
  """Which key blocks each (query, KV head) attends in the selected branch.

  probs_BTHN [B, T, Hq, NB]: compressed-attention probabilities from `compressed_attention`.
  Returns bool [B, T, Hkv, NB]: per the module docstring, the `block_count` most important valid
  blocks (`block_importance`), blocks 0, IC - 1 and IC forced, blocks > IC never selected.
  """
  query_len, num_blocks = probs_BTHN.shape[1], probs_BTHN.shape[3]
  importance_BTKN = block_importance(
      probs_BTHN, num_kv_heads=num_kv_heads, block_size=block_size,
      position_BT=(query_offset + jnp.arange(query_len))[None])
  # top_k puts the lower index first among equal values, which is the documented tie rule.
  top_importance_BTKC, top_block_BTKC = jax.lax.top_k(
      importance_BTKN, min(block_count, num_blocks))
  # With fewer valid blocks than block_count, top_k also returns invalid (-inf) ones: drop them.
  chosen_BTKCN = ((top_block_BTKC[..., None] == jnp.arange(num_blocks))
                  & jnp.isfinite(top_importance_BTKC)[..., None])
  return jnp.any(chosen_BTKCN, axis=-2)


def selected_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    block_mask_BTKN: jax.Array,
    *,
    block_size: int,
    scale: float,
    query_offset: int = 0,
) -> jax.Array:
  """Attention over all tokens of the selected blocks, causal (key j <= query position t).

  q_BTHD [B, T, Hq, D]; k_BSKD, v_BSKD [B, S, Hkv, D|Dv]; block_mask_BTKN bool [B, T, Hkv, NB] from
  `select_blocks`. Returns [B, T, Hq, Dv] in the compute dtype.
  """
  query_len, key_len = q_BTHD.shape[1], k_BSKD.shape[1]
  key_block_S = jnp.arange(key_len) // block_size
  in_selected_block_BKTS = jnp.einsum("btks->bkts", block_mask_BTKN[..., key_block_S])
  query_pos_T = query_offset + jnp.arange(query_len)
  causal_TS = jnp.arange(key_len)[None, :] <= query_pos_T[:, None]
  return attention_with_mask(
      q_BTHD, k_BSKD, v_BSKD, in_selected_block_BKTS & causal_TS, scale=scale)


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
) -> jax.Array:
  """NSA output per the module docstring; [B, T_q, Hq, Dv] in q's dtype.

  Arguments are assumed valid (the public entry checks them). scale defaults to D**-0.5 and is used
  by all three branches.
  """
  query_len, key_len, num_kv_heads = q_BTHD.shape[1], k_BTKD.shape[1], k_BTKD.shape[2]
  query_offset = key_len - query_len
  if scale is None:
    scale = q_BTHD.shape[-1] ** -0.5
  k_cmp_BNKD = compress(k_BTKD, block_size)
  v_cmp_BNKD = compress(v_BTKD, block_size)
  o_cmp_BTHD, probs_BTHN = compressed_attention(
      q_BTHD, k_cmp_BNKD, v_cmp_BNKD, block_size=block_size, scale=scale,
      query_offset=query_offset)
  block_mask_BTKN = select_blocks(
      probs_BTHN, num_kv_heads=num_kv_heads, block_size=block_size, block_count=block_count,
      query_offset=query_offset)
  o_slc_BTHD = selected_attention(
      q_BTHD, k_BTKD, v_BTKD, block_mask_BTKN, block_size=block_size, scale=scale,
      query_offset=query_offset)
  # The SWA branch is exactly masked_attention's definition; its float32 output is used so that the
  # three branches are summed before the single rounding to q's dtype.
  o_swa_BTHD = attention_with_mask(
      q_BTHD, k_BTKD, v_BTKD, attention_mask(query_len, key_len, window_size=window_size),
      scale=scale)
  return gated_sum(gates_BTH3, o_cmp_BTHD, o_slc_BTHD, o_swa_BTHD).astype(q_BTHD.dtype)


def gated_sum(gates_BTH3: jax.Array, o_cmp_BTHD: jax.Array, o_slc_BTHD: jax.Array,
              o_swa_BTHD: jax.Array) -> jax.Array:
  """g_slc o_slc + g_cmp o_cmp + g_swa o_swa, gates ordered [cmp, slc, swa] on the last axis;
  in the branches' dtype, promoted with the gates'."""
  g_cmp_BTH1, g_slc_BTH1, g_swa_BTH1 = (gates_BTH3[..., i:i + 1] for i in range(3))
  return g_slc_BTH1 * o_slc_BTHD + g_cmp_BTH1 * o_cmp_BTHD + g_swa_BTH1 * o_swa_BTHD


def decode_attention(
    q_BHD: jax.Array,
    gates_BH3: jax.Array,
    k_GBSKD: jax.Array,
    v_GBSKD: jax.Array,
    k_cmp_GBNKD: jax.Array,
    v_cmp_GBNKD: jax.Array,
    position_B: jax.Array,
    group: jax.Array,
    *,
    block_size: int,
    block_count: int,
    window_size: int,
    scale: float | None = None,
) -> jax.Array:
  """NSA output [B, Hq, Dv] (q's dtype) of one query per row against a cache (decoding).

  Row b's query sits at position t = position_B[b] and sees cache slots 0..t (its own key
  included); slots after t may hold anything finite. k_cmp/v_cmp [B, N, Hkv, D] hold the mean of
  every complete block of the cache (N >= S / block_size), so nothing is pooled again here; the
  branches are the full sequence's at position t. The four caches are stacked over layer groups
  ([G, B, ...]) and group `group` is read.
  """
  k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD = (
      x[group] for x in (k_GBSKD, v_GBSKD, k_cmp_GBNKD, v_cmp_GBNKD))
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  num_kv_heads = k_BSKD.shape[2]

  def one_row(q_HD, gates_H3, k_SKD, v_SKD, k_cmp_NKD, v_cmp_NKD, t):
    q_11HD, k_1SKD, v_1SKD = q_HD[None, None], k_SKD[None], v_SKD[None]
    o_cmp, probs = compressed_attention(q_11HD, k_cmp_NKD[None], v_cmp_NKD[None],
                                        block_size=block_size, scale=scale, query_offset=t)
    block_mask = select_blocks(probs, num_kv_heads=num_kv_heads, block_size=block_size,
                               block_count=block_count, query_offset=t)
    o_slc = selected_attention(q_11HD, k_1SKD, v_1SKD, block_mask, block_size=block_size,
                               scale=scale, query_offset=t)
    key_S = jnp.arange(k_SKD.shape[0])
    in_window_S = (key_S <= t) & (t - key_S < window_size)
    o_swa = attention_with_mask(q_11HD, k_1SKD, v_1SKD, in_window_S[None, None, None, :],
                                scale=scale)
    return gated_sum(gates_H3.astype(o_cmp.dtype)[None, None], o_cmp, o_slc, o_swa)[0, 0]

  out_BHD = jax.vmap(one_row)(q_BHD, gates_BH3, k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD,
                              position_B)
  return out_BHD.astype(q_BHD.dtype)
