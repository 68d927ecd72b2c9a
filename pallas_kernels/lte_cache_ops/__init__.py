"""LTE cache data movement: prefill compaction and the fused decode evict/insert step.

Public entries: `compact_top_scores` (§5.2 step 5) and `evict_and_insert` (§5.3
step 3). See `reference` for the exact definitions; pallas_kernels never sees the cache dataclass,
only its arrays.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.lte_cache_ops import pallas, pallas_compaction, reference
from pallas_kernels.stacked import as_stacked, per_group

__all__ = ["compact_top_scores", "evict_and_insert"]

# What implementation=None runs on a GPU. The prefill compaction stays on "xla": the Pallas kernel
# measured slower at the model shapes (tools/bench_decode_attention.py; 135.8 vs 129.9 us at B8
# T4096, 431.1 vs 192.0 us at B2 T16384 on one H100). The decode step's evict/insert runs in place
# in Pallas (one small program per (row, KV head) instead of XLA's copies of the cache).
COMPACTION_GPU_DEFAULT = ("xla",)
EVICT_INSERT_GPU_DEFAULT = ("pallas", "xla")


@functools.partial(jax.jit, static_argnames=("num_candidates", "cap", "implementation"))
def compact_top_scores(k_BTKD: jax.Array, v_BTKD: jax.Array, score_BTK: jax.Array, *,
                       num_candidates: int, cap: int, implementation: Implementation = None):
  """Per (row, KV head): the top-min(cap, n) of the first n tokens by score, kept if > 0.

  Args:
    k_BTKD, v_BTKD: [B, T, K, D] the prompt's keys (after RoPE) and values.
    score_BTK: [B, T, K] scores (float32; sinks +inf, padding -inf).
    num_candidates: n, 1 <= n <= T: tokens [0, n) are out of the window.
    cap: b >= 1, the OOW capacity.
    implementation: "xla" (lax.top_k + sort + gathers) or "pallas" (one program per (row, KV
      head): a bitwise threshold search and a prefix-count scatter of the kept rows; scores must
      not be NaN). None: COMPACTION_GPU_DEFAULT on a GPU, "xla" elsewhere.

  Returns:
    oow_k, oow_v [B, cap, K, D], oow_score [B, cap, K] float32 in position order (invalid
    entries zero / -inf), past_len [B, K] int32, kept_BTK bool [B, T, K].
  """
  batch, length, num_kv_heads = score_BTK.shape
  if k_BTKD.shape[:3] != (batch, length, num_kv_heads) or v_BTKD.shape[:3] != k_BTKD.shape[:3]:
    raise ValueError(f"compact_top_scores: k_BTKD {k_BTKD.shape}, v_BTKD {v_BTKD.shape} and"
                     f" score_BTK {score_BTK.shape} must agree on [B, T, K]")
  if not 1 <= num_candidates <= length:
    raise ValueError(f"compact_top_scores: num_candidates must be in [1, T={length}], got"
                     f" {num_candidates}")
  if cap < 1:
    raise ValueError(f"compact_top_scores: cap must be >= 1, got {cap}")
  version = resolve("compact_top_scores", implementation,
                    {"xla": reference.compact_top_scores,
                     "pallas": pallas_compaction.compact_top_scores},
                    gpu_default=COMPACTION_GPU_DEFAULT)
  return version(k_BTKD, v_BTKD, score_BTK, num_candidates, cap)


@functools.partial(jax.jit, static_argnames=("window_keys", "implementation"))
def evict_and_insert(k_BSKD: jax.Array, v_BSKD: jax.Array, score_BSK: jax.Array,
                     past_len_BK: jax.Array, ptr: jax.Array, new_k_BKD: jax.Array,
                     new_v_BKD: jax.Array, new_score_BK: jax.Array, *, window_keys: int,
                     group: jax.Array | None = None, implementation: Implementation = None):
  """One decode step's cache movement: evict ring slot `ptr` into the OOW set, insert the new token.

  Args:
    k_BSKD, v_BSKD: [B, W + b, K, D] the cache (ring [0, W), OOW set [W, W + b)).
    score_BSK: [B, W + b, K] float32 scores.
    past_len_BK: [B, K] int32 valid OOW entries.
    ptr: [] int32 ring slot of the leaving token, where the new token goes.
    new_k_BKD, new_v_BKD: [B, K, D] the new token; new_score_BK: [B, K] its score.
    window_keys: W.
    group: int32 [] layer group to update when the four cache arrays are stacked over the model's
      layer groups ([G, ...] each): only that group's moved rows change (None: plain arrays).
    implementation: "xla" (scatters of the moved rows) or "pallas" (one program per (row, KV head),
      the buffers aliased to the outputs); both update a donated cache in place. None:
      EVICT_INSERT_GPU_DEFAULT on a GPU, "xla" elsewhere.

  Returns:
    (k, v, score, past_len) after the step; same shapes and dtypes as given.
  """
  op = "evict_and_insert"
  k, v = per_group(op, "k_BSKD", k_BSKD, group, 4), per_group(op, "v_BSKD", v_BSKD, group, 4)
  score = per_group(op, "score_BSK", score_BSK, group, 3)
  past_len = per_group(op, "past_len_BK", past_len_BK, group, 2)
  batch, slots, num_kv_heads, _ = k.shape
  if not 0 < window_keys < slots:
    raise ValueError(f"{op}: window_keys must be in (0, {slots}), got {window_keys}")
  if v.shape[:3] != k.shape[:3] or score.shape != k.shape[:3]:
    raise ValueError(f"{op}: v_BSKD {v.shape} and score_BSK {score.shape} must match k_BSKD"
                     f" {k.shape} on [B, S, K]")
  if past_len.shape != (batch, num_kv_heads):
    raise ValueError(f"{op}: past_len_BK must be [B, K] = {(batch, num_kv_heads)}, got"
                     f" {past_len.shape}")
  if (new_k_BKD.shape != (batch, num_kv_heads, k.shape[-1])
      or new_v_BKD.shape != (batch, num_kv_heads, v.shape[-1])
      or new_score_BK.shape != (batch, num_kv_heads)):
    raise ValueError(f"{op}: new_k_BKD {new_k_BKD.shape}, new_v_BKD {new_v_BKD.shape},"
                     f" new_score_BK {new_score_BK.shape} must be [B, K, D] / [B, K] for the"
                     " cache's B and K")
  version = resolve(op, implementation,
                    {"xla": reference.evict_and_insert, "pallas": pallas.evict_and_insert},
                    gpu_default=EVICT_INSERT_GPU_DEFAULT)
  stacked = [as_stacked(x, group) for x in (k_BSKD, v_BSKD, score_BSK, past_len_BK)]
  index = stacked[0][1]
  out = version(*(x for x, _ in stacked), ptr, new_k_BKD, new_v_BKD, new_score_BK, index,
                window_keys=window_keys)
  return out if group is not None else tuple(x[0] for x in out)
