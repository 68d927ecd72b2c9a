"""`implementation="xla"` of NSA decoding: one query per batch row against a layer group's caches,
reading only what the three branches use.

    o_cmp, probs = the compressed cache, read block by block        (stacked.streamed_*)
    selection = top block_count of the importance from the probs    (as the reference)
    o_slc = attention over the selected blocks, gathered
    o_swa = attention over the window, gathered
    o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa

The dense `reference.decode_attention` reads every slot of the cache; here a step reads the
compressed cache (1 / block_size of the keys), block_count blocks and the window, so its
temporaries do not grow with the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention.reference import attention_with_mask, masked_softmax
from pallas_kernels.nsa import reference, selection
from pallas_kernels.stacked import streamed_attention, streamed_scores


def _gather_slots(x_GBSKD, group, slot_BKM):
  """x[group, b, slot_BKM[b, h, m], h] as [B, M, Hkv, D]: each KV head's own slots."""
  batch, num_kv_heads = slot_BKM.shape[:2]
  row_B11 = jnp.arange(batch)[:, None, None]
  head_1K1 = jnp.arange(num_kv_heads)[None, :, None]
  return jnp.swapaxes(x_GBSKD[group, row_B11, slot_BKM, head_1K1], 1, 2)


def decode_attention(q_BHD, gates_BH3, k_GBSKD, v_GBSKD, k_cmp_GBNKD, v_cmp_GBNKD, position_B,
                     group, *, block_size: int, block_count: int, window_size: int,
                     scale: float | None = None):
  """Same contract as `reference.decode_attention`."""
  if scale is None:
    scale = q_BHD.shape[-1] ** -0.5
  batch, num_q_heads, _ = q_BHD.shape
  num_kv_heads, num_blocks = k_GBSKD.shape[3], k_cmp_GBNKD.shape[2]
  group_size = num_q_heads // num_kv_heads
  q_B1HD = q_BHD[:, None]

  # Compressed branch: blocks c < floor((t + 1) / block_size) are complete and visible.
  complete_B = (position_B + 1) // block_size
  visible_BN = jnp.arange(num_blocks)[None, :] < complete_B[:, None]
  o_cmp_BHD = streamed_attention(
      q_BHD, k_cmp_GBNKD, v_cmp_GBNKD, group, scale=scale,
      length_BK=jnp.broadcast_to(complete_B[:, None], (batch, num_kv_heads)))
  scores_BKGN = streamed_scores(q_BHD, k_cmp_GBNKD, group, scale=scale).reshape(
      batch, num_kv_heads, group_size, num_blocks)
  probs_BHN = masked_softmax(scores_BKGN, visible_BN[:, None, None]).reshape(
      batch, num_q_heads, num_blocks)

  # Selected branch: every token of the chosen blocks, causally (slot <= t).
  importance_B1KN = reference.block_importance(
      probs_BHN[:, None], num_kv_heads=num_kv_heads, block_size=block_size,
      position_BT=position_B[:, None])
  indices_B1KC, counts_B1K = selection.select_top_blocks(importance_B1KN, block_count)
  indices_BKC, counts_BK = indices_B1KC[:, 0], counts_B1K[:, 0]
  slot_BKCS = jnp.maximum(indices_BKC, 0)[..., None] * block_size + jnp.arange(block_size)
  chosen_BKCS = ((jnp.arange(indices_BKC.shape[-1]) < counts_BK[..., None])[..., None]
                 & (slot_BKCS <= position_B[:, None, None, None]))
  slot_BKM = slot_BKCS.reshape(batch, num_kv_heads, -1)
  o_slc_B1HD = attention_with_mask(
      q_B1HD, _gather_slots(k_GBSKD, group, slot_BKM), _gather_slots(v_GBSKD, group, slot_BKM),
      chosen_BKCS.reshape(batch, num_kv_heads, 1, -1), scale=scale)

  # Window branch: slots t - window_size + 1 .. t.
  slot_BW = position_B[:, None] - window_size + 1 + jnp.arange(window_size)
  window_BKW = jnp.broadcast_to(jnp.maximum(slot_BW, 0)[:, None], (batch, num_kv_heads,
                                                                  window_size))
  o_swa_B1HD = attention_with_mask(
      q_B1HD, _gather_slots(k_GBSKD, group, window_BKW), _gather_slots(v_GBSKD, group, window_BKW),
      (slot_BW >= 0)[:, None, None, :], scale=scale)

  return reference.gated_sum(gates_BH3.astype(o_cmp_BHD.dtype), o_cmp_BHD, o_slc_B1HD[:, 0],
                             o_swa_B1HD[:, 0]).astype(q_BHD.dtype)
