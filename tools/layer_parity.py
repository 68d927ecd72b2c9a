"""Layer-by-layer parity with a reference model that gave its hidden states (tools/compare_torch.py).

Each of our blocks runs on exactly the reference's input to that layer, so an error of one layer
does not reach the next one: a whole-model logits error is traced to the layer (and the token
positions) where it arises. Compared is the block's update, out - in, against the reference's
(the residual stream itself would hide it); the last layer, whose output the reference gives only
after the final norm, is compared after ours.

For NSA blocks it also measures how close each (query, KV head)'s block selection is to a tie:
the margin between the block_count-th and the next block importance (float32, our reference).
Two float32 implementations may order blocks whose importances differ by ~1e-6 differently, and
one changed block moves that query's output by O(1); a large error at positions with a tiny
margin is such a tie, not a kernel error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax.layers.rope import default_positions
from pallas_kernels.nsa import reference as nsa_reference

WORST_POSITIONS = 5


def blocks_in_depth_order(model) -> list:
  """Our blocks, layer 0 first (the stacked groups split into one module per group)."""
  graphdef, stacked = nnx.split(model.groups)
  blocks = []
  for g in range(model.num_groups):
    group = nnx.merge(graphdef, jax.tree.map(lambda x, g=g: x[g], stacked))
    blocks.extend(group.blocks)
  return blocks


def selection_margins(block, h_BTD: jax.Array) -> np.ndarray:
  """[B, T, Hkv] importance of the last selected block minus that of the first unselected one
  (inf where every valid block is selected)."""
  mixer = block.mixer
  nsa = mixer.config
  batch, length = h_BTD.shape[:2]
  q_BTHD, k_BTKD, v_BTKD, _ = mixer._qkv_gates(  # pylint: disable=protected-access
      block.mixer_norm(h_BTD), default_positions(batch, length))
  k_cmp_BNKD = nsa_reference.compress(k_BTKD, nsa.block_size)
  v_cmp_BNKD = nsa_reference.compress(v_BTKD, nsa.block_size)
  _, probs_BTHN = nsa_reference.compressed_attention(
      q_BTHD, k_cmp_BNKD, v_cmp_BNKD, block_size=nsa.block_size, scale=q_BTHD.shape[-1] ** -0.5)
  importance_BTKN = nsa_reference.block_importance(
      probs_BTHN, num_kv_heads=nsa.num_kv_heads, block_size=nsa.block_size,
      position_BT=jnp.arange(length)[None])
  count = nsa.block_count
  if importance_BTKN.shape[-1] <= count:
    return np.full(importance_BTKN.shape[:3], np.inf)
  top_BTKS = jax.lax.top_k(importance_BTKN, count + 1)[0]
  margin_BTK = top_BTKS[..., count - 1] - top_BTKS[..., count]
  return np.asarray(jnp.where(jnp.isfinite(top_BTKS[..., count]), margin_BTK, jnp.inf))


def layer_errors(model, hidden_LBTD: np.ndarray) -> list[dict]:
  """Per layer: the kind, the relative error of the update (max |ours - theirs| / max |theirs|),
  how many positions have a per-position error above 1e-4 of that maximum, the worst positions
  [b, t] and, for NSA layers, the selection margins (smallest, median, at the worst positions)."""
  blocks = blocks_in_depth_order(model)
  if hidden_LBTD.shape[0] != len(blocks) + 1:
    raise ValueError(f"layer_parity: {hidden_LBTD.shape[0]} hidden states for {len(blocks)} layers"
                     " (expected one per layer plus the normed output)")
  run_block = nnx.jit(lambda block, h: block(h, None)[0])
  final_norm = nnx.jit(lambda model, h: model.final_norm(h))
  records = []
  for i, block in enumerate(blocks):
    h_in = jnp.asarray(hidden_LBTD[i])
    out = run_block(block, h_in)
    if i + 1 < len(blocks):
      ours, theirs = np.asarray(out - h_in), hidden_LBTD[i + 1] - hidden_LBTD[i]
    else:
      ours, theirs = np.asarray(final_norm(model, out)), hidden_LBTD[i + 1]
    scale = max(float(np.abs(theirs).max()), 1e-30)
    error_BT = np.abs(ours - theirs).max(axis=-1) / scale
    worst = np.argsort(error_BT, axis=None)[::-1][:WORST_POSITIONS]
    worst_BT = [tuple(int(x) for x in np.unravel_index(w, error_BT.shape)) for w in worst]
    record = {"layer": i, "kind": block.mixer_kind, "update_rel": float(error_BT.max()),
              "positions_over_1e-4": int((error_BT > 1e-4).sum()),
              "worst_positions": [[b, t, float(error_BT[b, t])] for b, t in worst_BT]}
    if block.mixer_kind == "nsa":
      margin_BTK = selection_margins(block, h_in)
      finite = margin_BTK[np.isfinite(margin_BTK)]
      record["margin_min"] = float(finite.min()) if finite.size else None
      record["margin_median"] = float(np.median(finite)) if finite.size else None
      record["margin_at_worst"] = [float(margin_BTK[b, t].min()) for b, t in worst_BT]
    records.append(record)
  return records
