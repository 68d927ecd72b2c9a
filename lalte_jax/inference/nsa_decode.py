"""NSA attention of one new query per row against a preallocated cache (§6).

`nsa_attention` places its queries at the last positions of the key tensor; in a preallocated
cache each row's query sits at its own position t_b (rows have different prompt lengths), so this
runs the same branch definitions from `pallas_kernels.nsa.reference` per row with
`query_offset = t_b`. Cache slots after t_b hold stale or zero keys; every branch ignores them:
the compressed branch reads only complete blocks (all <= t_b), the selected branch is causal and
the sliding window ends at t_b.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lalte_jax.config import NSAConfig
from pallas_kernels.masked_attention.reference import attention_with_mask
from pallas_kernels.nsa import reference as nsa_reference


def _one_row(q_1HD, k_SKD, v_SKD, gates_1H3, t, nsa: NSAConfig, scale: float):
  """NSA output [1, Hq, Dv] (float32) of the query at position t of one row."""
  q_11HD, k_1SKD, v_1SKD = q_1HD[None], k_SKD[None], v_SKD[None]
  num_kv_heads = k_SKD.shape[1]
  k_cmp = nsa_reference.compress(k_1SKD, nsa.block_size)
  v_cmp = nsa_reference.compress(v_1SKD, nsa.block_size)
  o_cmp, probs = nsa_reference.compressed_attention(
      q_11HD, k_cmp, v_cmp, block_size=nsa.block_size, scale=scale, query_offset=t)
  block_mask = nsa_reference.select_blocks(
      probs, num_kv_heads=num_kv_heads, block_size=nsa.block_size, block_count=nsa.block_count,
      query_offset=t)
  o_slc = nsa_reference.selected_attention(
      q_11HD, k_1SKD, v_1SKD, block_mask, block_size=nsa.block_size, scale=scale,
      query_offset=t)
  key_S = jnp.arange(k_SKD.shape[0])
  in_window_S = (key_S <= t) & (t - key_S < nsa.window_size)
  o_swa = attention_with_mask(q_11HD, k_1SKD, v_1SKD, in_window_S[None, None, None, :],
                              scale=scale)
  gates = gates_1H3[None].astype(o_cmp.dtype)
  out = gates[..., 1:2] * o_slc + gates[..., 0:1] * o_cmp + gates[..., 2:3] * o_swa
  return out[0]


def nsa_decode_attention(q_B1HD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                         gates_B1H3: jax.Array, query_pos_B: jax.Array, nsa: NSAConfig
                         ) -> jax.Array:
  """[B, 1, Hq, Dv] in q's dtype; query_pos_B [B] int32 is each row's query (real) position, whose
  key and value are already in the cache."""
  scale = q_B1HD.shape[-1] ** -0.5
  out = jax.vmap(lambda q, k, v, g, t: _one_row(q, k, v, g, t, nsa, scale))(
      q_B1HD, k_BSKD, v_BSKD, gates_B1H3, query_pos_B)
  return out.astype(q_B1HD.dtype)
