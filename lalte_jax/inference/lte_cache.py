"""The LTE layer's constant-memory decode cache (§5), as pure JAX functions.

Per LTE layer the cache holds W + b key/value slots per KV head (W = w + 1 window keys, b = cap):

  slots [0, W)      a ring holding the W most recent tokens (the sliding window). The next token
                    goes to slot `ptr`, which holds the oldest one; `blank[b]` ring slots starting
                    at `ptr` hold no real token (never filled, or left padding of the prompt).
  slots [W, W + b)  the compacted out-of-window (OOW) set: tokens that left the window with a
                    router score > 0, sinks included (G11). Only the first `past_len[b, h]` are
                    valid; their order is irrelevant.

Keys are stored after RoPE at padded-tensor positions (prefill 0..L-1, decode t = tokens seen so
far, pads included; §5.5, G25). Scores are `sigmoid - 0.5` in float32, sinks +inf, blank -inf.

Prefill (§5.2) scores the whole prompt, keeps the top-b positive-scored tokens older than the
window, and runs every prompt query against its window plus that final kept set. A decode step
(§5.3) evicts the ring's oldest token into the OOW set (appending while there is room, else
replacing the OOW minimum if the leaving score is larger), writes the new token into its slot, and
attends over the valid slots. Router scores need `margin` tokens of right context, so ring scores
are recomputed lazily (§5.4): when `ptr == W - 2 * margin` the ring is rotated into chronological
order, keys are de-roped, and the router rescores slots [margin, W). Every token therefore leaves
the window with exactly the score the router gives it over the full sequence.

Deliberate departures from the reference code (all fixes of its edge cases, G14), so that decoding
reproduces the training-time layer for every prompt length:

1. Sinks never lose their +inf. The reference overwrites a sink's +inf at the first lazy rescoring
   when the prompt has <= 9 tokens; here rescoring keeps +inf scores. A sink decoded after the
   prompt (prompts with fewer than `num_sinks` real tokens, or decoding from an empty cache) is
   marked +inf when inserted; the reference marks sinks only at prefill.
2. De-roping uses the true positions of the ring slots, t - W + i for chronological slot i, even
   while blanks remain. The reference uses offset max(t - W, 0), which is wrong for prompts of
   fewer than 2 * margin = 12 tokens (the first rescoring then runs while blanks remain).
3. Consequence of 1: a decode step writes a score for the token it inserts (the reference leaves
   the evicted token's stale score, G15): +inf for a sink, the router score when the router has no
   context (margin 0, §7.3: LTE-MLP, scored at insertion since the lazy trigger never fires), and
   otherwise the provisional `PROVISIONAL_SCORE` (not kept), which the next rescoring replaces
   before the slot can leave the window. So a ring score always belongs to the token in its slot,
   and +inf in the ring always means "sink".

Shapes: B batch, T tokens, Hq query heads, K (= Hkv) KV heads, D head dim, S = W + b cache slots,
W ring slots. Everything is jittable with static shapes; the functions read the `LTEAttention`
module's `proj`, `router` and `config` and do not modify it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from lalte_jax.config import LTEConfig
from lalte_jax.layers.rope import apply_rope, default_positions, derope
from lalte_jax.mixers.lte import LTEAttention
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.lte_cache_ops import compact_top_scores, evict_and_insert
from pallas_kernels.masked_attention import masked_attention

# Score given to a freshly decoded (non-sink) token until the next lazy rescoring: "not kept". It
# is never read as a decision (§5.4 exactness: the slot is rescored before it leaves the window).
PROVISIONAL_SCORE = 0.0


@flax.struct.dataclass
class LTECache:
  """Decode state of one LTE layer (§5.1); every leaf keeps its shape for the whole generation."""
  k: jax.Array  # [B, W + b, Hkv, D] post-RoPE keys; [0, W) ring, [W, W + b) OOW set
  v: jax.Array  # [B, W + b, Hkv, D]
  score: jax.Array  # [B, W + b, Hkv] float32; sinks +inf, padded / never-filled -inf
  past_len: jax.Array  # [B, Hkv] int32: valid OOW entries
  blank: jax.Array  # [B] int32: blank ring slots, contiguous from ptr
  ptr: jax.Array  # [] int32: next ring slot (holds the oldest token)
  position: jax.Array  # [] int32: absolute position t of the next token (pads included)


def init_lte_cache(lte: LTEConfig, batch: int, dtype) -> LTECache:
  """An empty cache: all ring slots blank, no OOW entry, next position 0.

  Decoding straight from it (no prefill) is valid: the first `num_sinks` decoded tokens become
  sinks. `dtype` is the model's activation dtype (keys and values); scores are float32.
  """
  if lte.num_sinks > lte.window_keys:
    # Decode-time sink detection counts real tokens through the ring's blanks (see
    # `_evict_and_insert`).
    raise ValueError(f"lte.num_sinks: {lte.num_sinks} sinks exceed the window of"
                     f" {lte.window_keys} keys; the decode cache cannot track them")
  slots = lte.window_keys + lte.cap
  kv_shape = (batch, slots, lte.num_kv_heads, lte.head_dim)
  return LTECache(
      k=jnp.zeros(kv_shape, dtype),
      v=jnp.zeros(kv_shape, dtype),
      score=jnp.full((batch, slots, lte.num_kv_heads), -jnp.inf, jnp.float32),
      past_len=jnp.zeros((batch, lte.num_kv_heads), jnp.int32),
      blank=jnp.full((batch,), lte.window_keys, jnp.int32),
      ptr=jnp.zeros((), jnp.int32),
      position=jnp.zeros((), jnp.int32),
  )


def _mark_sinks_and_padding(score_BTK: jax.Array, real_BT: jax.Array, num_sinks: int) -> jax.Array:
  """Scores with -inf at padding and +inf at the first `num_sinks` real tokens of each row."""
  real_index_BT = jnp.cumsum(real_BT.astype(jnp.int32), axis=1) - 1
  sink_BT = real_BT & (real_index_BT < num_sinks)
  score_BTK = jnp.where(sink_BT[:, :, None], jnp.inf, score_BTK)
  return jnp.where(real_BT[:, :, None], score_BTK, -jnp.inf)


def lte_prefill(layer: LTEAttention, x_BTD: jax.Array, pad_mask_BT: jax.Array | None,
                cache: LTECache) -> tuple[jax.Array, LTECache]:
  """Runs the LTE layer over a (left-padded) prompt and fills the cache (§5.2).

  Args:
    layer: the LTE mixer whose projections and router are used.
    x_BTD: [B, L, hidden] normed layer input, L >= 1.
    pad_mask_BT: bool [B, L], True = real token; padding must be on the left. None: no padding.
    cache: gives the cache shapes and dtype; its contents are ignored (a prompt starts a sequence).

  Returns:
    out_BTD [B, L, hidden] (zero at padded rows) and the filled cache with position = L.
    Each prompt query attends to its window (w + 1 keys, padding excluded) plus the kept OOW set
    *at the end of the prompt* restricted to keys at least W older (§5.2 step 6, G24); below the
    cap this equals the training-time layer.
  """
  lte = layer.config
  window_keys, cap = lte.window_keys, lte.cap
  batch, length = x_BTD.shape[:2]
  real_BT = (jnp.ones((batch, length), bool) if pad_mask_BT is None
             else pad_mask_BT.astype(bool))

  q_BTHD, k_pre_BTKD, v_BTKD = layer.proj.qkv(x_BTD)
  score_BTK = layer.router(k_pre_BTKD, v_BTKD, mask_BT=pad_mask_BT)
  score_BTK = _mark_sinks_and_padding(score_BTK, real_BT, lte.num_sinks)
  positions_BT = default_positions(batch, length)  # padded-tensor indices (G25)
  q_BTHD = apply_rope(q_BTHD, positions_BT, lte.rope_theta)
  k_BTKD = apply_rope(k_pre_BTKD, positions_BT, lte.rope_theta)
  cache_dtype = cache.k.dtype
  k_BTKD, v_BTKD = k_BTKD.astype(cache_dtype), v_BTKD.astype(cache_dtype)

  # Ring: the c most recent tokens at slots [W - c, W), chronological, so ptr = 0 is the oldest
  # and the never-filled slots [0, W - c) are the blanks that precede the prompt's own padding.
  in_ring = min(length, window_keys)
  ring_pad = ((0, 0), (window_keys - in_ring, 0), (0, 0))
  ring_k = jnp.pad(k_BTKD[:, length - in_ring:], ring_pad + ((0, 0),))
  ring_v = jnp.pad(v_BTKD[:, length - in_ring:], ring_pad + ((0, 0),))
  ring_score = jnp.pad(score_BTK[:, length - in_ring:], ring_pad, constant_values=-jnp.inf)
  blank_B = window_keys - jnp.sum(real_BT[:, length - in_ring:], axis=1, dtype=jnp.int32)

  num_candidates = length - in_ring
  if num_candidates > 0:
    # §5.2 step 5: the top-min(b, n) of the first n tokens by score, kept if score > 0.
    oow_k, oow_v, oow_score, past_len_BK, kept_BTK = compact_top_scores(
        k_BTKD, v_BTKD, score_BTK, num_candidates=num_candidates, cap=cap)
  else:  # the whole prompt fits the window: nothing is out of it yet
    oow_k = jnp.zeros((batch, cap) + k_BTKD.shape[2:], cache_dtype)
    oow_v = jnp.zeros((batch, cap) + v_BTKD.shape[2:], cache_dtype)
    oow_score = jnp.full((batch, cap, lte.num_kv_heads), -jnp.inf, jnp.float32)
    past_len_BK = jnp.zeros((batch, lte.num_kv_heads), jnp.int32)
    kept_BTK = jnp.zeros((batch, length, lte.num_kv_heads), bool)

  # Kept keys inside a query's window are visible anyway, so "kept, or within the window" is the
  # spec's "window plus kept keys with j <= t - W". Sinks are kept by their +inf score, so the
  # attention op's position-based sinks are off (with padding they are not at positions 0..s-1).
  o_BTHD = masked_attention(
      q_BTHD, k_BTKD, v_BTKD, window_size=window_keys, num_sinks=0, kept_BSK=kept_BTK,
      key_valid_BS=None if pad_mask_BT is None else real_BT, implementation=lte.implementation)
  out_BTD = layer.proj.output(o_BTHD.astype(q_BTHD.dtype))
  out_BTD = jnp.where(real_BT[:, :, None], out_BTD, jnp.zeros_like(out_BTD))

  new_cache = LTECache(
      k=jnp.concatenate([ring_k, oow_k], axis=1),
      v=jnp.concatenate([ring_v, oow_v], axis=1),
      score=jnp.concatenate([ring_score, oow_score], axis=1).astype(jnp.float32),
      past_len=past_len_BK,
      blank=blank_B,
      ptr=jnp.zeros((), jnp.int32),
      position=jnp.asarray(length, jnp.int32),
  )
  return out_BTD, new_cache


def _rescore_ring(layer: LTEAttention, cache: LTECache) -> LTECache:
  """§5.4: rotate the ring to chronological order and rescore slots [margin, W)."""
  lte = layer.config
  window_keys, margin = lte.window_keys, lte.router_margin
  batch = cache.k.shape[0]

  def chronological(x):  # slot ptr (the oldest token) moves to slot 0
    return jnp.concatenate([jnp.roll(x[:, :window_keys], -cache.ptr, axis=1),
                            x[:, window_keys:]], axis=1)

  k, v, score = chronological(cache.k), chronological(cache.v), chronological(cache.score)
  ring_k_BWKD, ring_v_BWKD = k[:, :window_keys], v[:, :window_keys]
  ring_score_BWK = score[:, :window_keys]

  # Chronological slot i holds position t - W + i (negative only for never-filled blanks): use
  # these true positions even while blanks remain (G14 fix; the reference clamps at 0).
  slot_W = jnp.arange(window_keys, dtype=jnp.int32)
  positions_BW = jnp.broadcast_to(cache.position - window_keys + slot_W, (batch, window_keys))
  k_pre_BWKD = derope(ring_k_BWKD, positions_BW, lte.rope_theta)
  real_BW = slot_W[None, :] >= cache.blank[:, None]
  fresh_BWK = layer.router(k_pre_BWKD, ring_v_BWKD, mask_BT=real_BW)
  fresh_BWK = jnp.where(real_BW[:, :, None], fresh_BWK, -jnp.inf)
  # Slots [0, margin) lost their left context to eviction: they keep the score they got at an
  # earlier rescoring (with full context). Sinks keep +inf (G14 fix).
  keep_old_BWK = (slot_W < margin)[None, :, None] | (ring_score_BWK == jnp.inf)
  ring_score_BWK = jnp.where(keep_old_BWK, ring_score_BWK, fresh_BWK)

  score = jnp.concatenate([ring_score_BWK, score[:, window_keys:]], axis=1)
  return cache.replace(k=k, v=v, score=score, ptr=jnp.zeros((), jnp.int32))


def lte_rescore_if_due(layer: LTEAttention, cache: LTECache) -> LTECache:
  """Lazy rescoring (§5.4) when `ptr == W - 2 * margin`, else the cache unchanged.

  `lte_decode_step` calls it first; it is idempotent (after a rescoring ptr is 0 != W - 2 margin),
  so a caller may apply it beforehand to read the score of the token about to leave the window,
  `cache.score[:, cache.ptr]`, which is then final. No-op for a context-free router (margin 0).
  """
  lte = layer.config
  margin = lte.router_margin
  if margin == 0:
    return cache
  due = cache.ptr == lte.window_keys - 2 * margin
  return jax.lax.cond(due, lambda c: _rescore_ring(layer, c), lambda c: c, cache)


def _evict_and_insert(cache: LTECache, lte: LTEConfig, k_B1KD: jax.Array, v_B1KD: jax.Array,
                      score_B1K: jax.Array) -> LTECache:
  """§5.3 step 3: move the ring's oldest token (slot ptr) into the OOW set if it qualifies, write
  the new token into slot ptr and advance.

  Score > 0: append while past_len < b, else replace the OOW minimum when that is smaller than
  the leaving score (otherwise drop it). Blank slots have score -inf and are dropped. The data
  movement is the fused `evict_and_insert` op (in place on GPU).
  """
  window_keys = lte.window_keys
  # While blanks remain, every real token seen so far is still in the ring, so the new token's
  # index among the row's real tokens is W - blank (G14 fix: sinks decoded after the prompt).
  real_index_B = window_keys - cache.blank
  sink_B = (cache.blank > 0) & (real_index_B < lte.num_sinks)
  score_BK = jnp.where(sink_B[:, None], jnp.inf, score_B1K[:, 0].astype(jnp.float32))
  k, v, score, past_len = evict_and_insert(
      cache.k, cache.v, cache.score, cache.past_len, cache.ptr,
      k_B1KD[:, 0].astype(cache.k.dtype), v_B1KD[:, 0].astype(cache.v.dtype), score_BK,
      window_keys=window_keys, implementation=lte.implementation)
  return cache.replace(
      k=k, v=v, score=score, past_len=past_len,
      blank=jnp.maximum(cache.blank - 1, 0),
      ptr=(cache.ptr + 1) % window_keys,
      position=cache.position + 1)


def _ring_valid_slots(cache: LTECache, lte: LTEConfig) -> jax.Array:
  """bool [B, W + b]: ring slots except the blanks [ptr, ptr + blank) (mod W); OOW slots True."""
  window_keys = lte.window_keys
  slot_S = jnp.arange(cache.k.shape[1], dtype=jnp.int32)
  # Distance from ptr around the ring: the blanks are the first `blank` slots from ptr.
  from_ptr_S = jnp.mod(slot_S - cache.ptr, window_keys)
  return (slot_S >= window_keys)[None, :] | (from_ptr_S[None, :] >= cache.blank[:, None])


def lte_decode_step(layer: LTEAttention, x_B1D: jax.Array, cache: LTECache
                    ) -> tuple[jax.Array, LTECache]:
  """One decode step of the LTE layer at position t = cache.position (§5.3).

  Args:
    layer: the LTE mixer.
    x_B1D: [B, 1, hidden] normed layer input of the new token (always a real token).
    cache: the layer's cache (from `lte_prefill`, or `init_lte_cache` to decode from scratch).

  Returns:
    out_B1D [B, 1, hidden] and the updated cache (same shapes and dtypes).
  """
  lte = layer.config
  batch = x_B1D.shape[0]
  q_B1HD, k_pre_B1KD, v_B1KD = layer.proj.qkv(x_B1D)
  positions_B1 = jnp.broadcast_to(cache.position, (batch, 1))
  q_B1HD = apply_rope(q_B1HD, positions_B1, lte.rope_theta)
  k_B1KD = apply_rope(k_pre_B1KD, positions_B1, lte.rope_theta)

  cache = lte_rescore_if_due(layer, cache)
  if lte.router_margin == 0:
    # A context-free router's score is final at once; no lazy trigger would ever fire (§7.3).
    new_score_B1K = layer.router(k_pre_B1KD, v_B1KD)
  else:
    new_score_B1K = jnp.full((batch, 1, lte.num_kv_heads), PROVISIONAL_SCORE, jnp.float32)
  cache = _evict_and_insert(cache, lte, k_B1KD, v_B1KD, new_score_B1K)

  # The new token is in the ring now, so the window is keys t-w..t; everything cached is in the
  # past, so no causal mask is needed. Visible: the ring minus its blanks, and OOW slots below
  # W + past_len (split so the kernel skips unfilled OOW slots).
  o_BHD = decode_attention(
      q_B1HD[:, 0], cache.k, cache.v, scale=lte.head_dim ** -0.5,
      length_BK=lte.window_keys + cache.past_len, key_valid=_ring_valid_slots(cache, lte),
      implementation=lte.implementation)
  return layer.proj.output(o_BHD[:, None].astype(q_B1HD.dtype)), cache
