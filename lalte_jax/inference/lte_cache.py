"""The LTE layer's constant-memory decode cache (§5), as pure JAX functions.

Per LTE layer the cache holds W + b key/value slots per KV head (W = w + 1 window keys, b = cap):

  slots [0, W)      a ring holding the W most recent tokens (the sliding window): the token at
                    padded position p sits in slot p mod W, so the next token goes to the slot
                    of the oldest one; the ring's first `blank` slots from there hold no real
                    token (never filled, or left padding of the prompt): W minus the real tokens
                    seen, at least 0 (`ring_state`).
  slots [W, W + b)  the compacted out-of-window (OOW) set: tokens that left the window with a
                    router score > 0, sinks included (G11). Only the first `past_len[b, h]` are
                    valid; their order is irrelevant.

Keys are stored after RoPE at padded-tensor positions (prefill 0..L-1, decode t = tokens seen so
far, pads included; §5.5, G25). Scores are `sigmoid - 0.5` in float32, sinks +inf, blank -inf.

Prefill (§5.2) scores the whole prompt, keeps the top-b positive-scored tokens older than the
window, and runs every prompt query against its window plus that final kept set. A decode step
(§5.3) evicts the ring's oldest token into the OOW set (appending while there is room, else
replacing the OOW minimum if the leaving score is larger), writes the new token into its slot, and
attends over the valid slots. Router scores need `margin` tokens of right context: the
reference recomputes the ring's scores lazily (§5.4: every W - 2 * margin steps it rotates the
ring, de-ropes the keys and rescores slots [margin, W)); here each decode step scores the one
token that has just got its full context, t - margin, over ring tokens t - 2 margin .. t
(`score_settled_token`). Both give every token the score the router gives it over the full
sequence before it leaves the window, so the evictions are the same.

Deliberate departures from the reference code (all fixes of its edge cases, G14), so that decoding
reproduces the training-time layer for every prompt length:

1. Sinks never lose their +inf. The reference overwrites a sink's +inf at the first lazy rescoring
   when the prompt has <= 9 tokens; here scoring keeps +inf scores. A sink decoded after the
   prompt (prompts with fewer than `num_sinks` real tokens, or decoding from an empty cache) is
   marked +inf when inserted; the reference marks sinks only at prefill.
2. De-roping uses the true positions of the ring slots, t - W + i for chronological slot i, even
   while blanks remain. The reference uses offset max(t - W, 0), which is wrong for prompts of
   fewer than 2 * margin = 12 tokens (its first rescoring then runs while blanks remain).
3. Consequence of 1: a decode step writes a score for the token it inserts (the reference leaves
   the evicted token's stale score, G15): +inf for a sink, the router score when the router has no
   context (margin 0, §7.3: LTE-MLP, scored at insertion since the lazy trigger never fires), and
   otherwise the provisional `PROVISIONAL_SCORE` (not kept), which `score_settled_token`
   replaces `margin` steps later, long before the slot can leave the window. So a ring score always belongs to the token in its slot,
   and +inf in the ring always means "sink".

The ring's position and blanks follow from the step's padded position and each row's left pads
(`caches.StepContext`), which are the same for every layer, so the cache holds no counters of its
own: a step writes nothing but the slots it changes.

Shapes: B batch, T tokens, Hq query heads, K (= Hkv) KV heads, D head dim, S = W + b cache slots,
W ring slots. Everything is jittable with static shapes. This module holds the cache and its
operations: `fill_from_prompt` on a layer group's arrays, the decode-step operations on its part
of the stacked cache (`GroupSlot` leaves, updated in place). The layer's prefill and decode step,
which project, score and attend, are `LTEAttention.prefill` / `.decode`
(`lalte_jax/mixers/lte.py`). Scoring runs the layer's router, which it is given.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from lalte_jax.config import LTEConfig
from lalte_jax.inference import caches
from lalte_jax.layers.rope import derope
from pallas_kernels.lte_cache_ops import compact_top_scores, evict_and_insert

# Score given to a freshly decoded (non-sink) token until it is scored `margin` steps later: "not
# kept". It is never read as a decision (§5.4: the slot is scored before it leaves the window).
PROVISIONAL_SCORE = 0.0


@flax.struct.dataclass
class LTECache:
  """Decode state of one LTE layer (§5.1); every leaf keeps its shape for the whole generation."""
  k: jax.Array  # [B, W + b, Hkv, D] post-RoPE keys; [0, W) ring, [W, W + b) OOW set
  v: jax.Array  # [B, W + b, Hkv, D]
  score: jax.Array  # [B, W + b, Hkv] float32; sinks +inf, padded / never-filled -inf
  past_len: jax.Array  # [B, Hkv] int32: valid OOW entries


def ring_state(lte: LTEConfig, position: jax.Array, pad_count_B: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """(ptr, blank_B) of the ring after `position` padded tokens (pads included), `pad_count_B` of
  them left padding: the slot of the next token (it holds the oldest one) and each row's blank
  slots, contiguous from ptr (mod W)."""
  window_keys = lte.window_keys
  return position % window_keys, jnp.maximum(window_keys - (position - pad_count_B), 0)


def is_sink(lte: LTEConfig, position: jax.Array, pad_count_B: jax.Array) -> jax.Array:
  """bool [B]: whether the real token at padded position `position` is one of its row's first
  `num_sinks` real tokens (after `pad_count_B` left pads), as the prefill marks them (G14 fix:
  also for sinks decoded after the prompt)."""
  return position - pad_count_B < lte.num_sinks


def init_lte_cache(lte: LTEConfig, batch: int, dtype) -> LTECache:
  """An empty cache: no OOW entry, ring scores -inf (at position 0 every ring slot is blank).

  Decoding straight from it (no prefill) is valid: the first `num_sinks` decoded tokens become
  sinks. `dtype` is the model's activation dtype (keys and values); scores are float32.
  """
  if lte.num_sinks > lte.window_keys:
    # Decode-time sink detection counts real tokens through the ring's blanks (see
    # `insert_token`).
    raise ValueError(f"lte.num_sinks: {lte.num_sinks} sinks exceed the window of"
                     f" {lte.window_keys} keys; the decode cache cannot track them")
  slots = lte.window_keys + lte.cap
  kv_shape = (batch, slots, lte.num_kv_heads, lte.head_dim)
  return LTECache(
      k=jnp.zeros(kv_shape, dtype),
      v=jnp.zeros(kv_shape, dtype),
      score=jnp.full((batch, slots, lte.num_kv_heads), -jnp.inf, jnp.float32),
      past_len=jnp.zeros((batch, lte.num_kv_heads), jnp.int32),
  )


def mark_sinks_and_padding(score_BTK: jax.Array, real_BT: jax.Array, num_sinks: int) -> jax.Array:
  """Scores with -inf at padding and +inf at the first `num_sinks` real tokens of each row."""
  real_index_BT = jnp.cumsum(real_BT.astype(jnp.int32), axis=1) - 1
  sink_BT = real_BT & (real_index_BT < num_sinks)
  score_BTK = jnp.where(sink_BT[:, :, None], jnp.inf, score_BTK)
  return jnp.where(real_BT[:, :, None], score_BTK, -jnp.inf)


def fill_from_prompt(cache: LTECache, lte: LTEConfig, k_BTKD: jax.Array, v_BTKD: jax.Array,
                     score_BTK: jax.Array, real_BT: jax.Array) -> tuple[LTECache, jax.Array]:
  """The cache at the end of a left-padded prompt (§5.2 steps 4-5), and which prompt tokens its
  out-of-window set keeps.

  Args:
    cache: gives the shapes and dtypes; its contents are ignored (a prompt starts a sequence).
    k_BTKD, v_BTKD: [B, L, K, D] the prompt's keys (after RoPE at padded indices) and values, in
      the cache's dtype.
    score_BTK: [B, L, K] float32 router scores marked by `mark_sinks_and_padding`.
    real_BT: bool [B, L], True = real token, padding on the left.

  Returns:
    the cache after the prompt (its ring state: `ring_state` at position L), and kept_BTK bool
    [B, L, K]: the tokens older than the window that the out-of-window set holds (what each
    prompt query may see beyond its window, G24).
  """
  window_keys, cap = lte.window_keys, lte.cap
  batch, length = real_BT.shape

  # Ring: the last min(L, W) tokens, token p in slot p mod W; slots no token reached score -inf.
  in_ring = min(length, window_keys)
  ring_k, ring_v = (caches.ring_from_prompt(x_BTKD, window_keys) for x_BTKD in (k_BTKD, v_BTKD))
  filled_S = jnp.arange(window_keys) < length
  ring_score = jnp.where(filled_S[None, :, None],
                         caches.ring_from_prompt(score_BTK, window_keys), -jnp.inf)

  num_candidates = length - in_ring
  if num_candidates > 0:
    # §5.2 step 5: the top-min(b, n) of the first n tokens by score, kept if score > 0.
    oow_k, oow_v, oow_score, past_len_BK, kept_BTK = compact_top_scores(
        k_BTKD, v_BTKD, score_BTK, num_candidates=num_candidates, cap=cap,
        implementation=lte.implementation)
  else:  # the whole prompt fits the window: nothing is out of it yet
    oow_k = jnp.zeros((batch, cap) + k_BTKD.shape[2:], cache.k.dtype)
    oow_v = jnp.zeros((batch, cap) + v_BTKD.shape[2:], cache.v.dtype)
    oow_score = jnp.full((batch, cap, lte.num_kv_heads), -jnp.inf, jnp.float32)
    past_len_BK = jnp.zeros((batch, lte.num_kv_heads), jnp.int32)
    kept_BTK = jnp.zeros((batch, length, lte.num_kv_heads), bool)

  new_cache = LTECache(
      k=jnp.concatenate([ring_k, oow_k], axis=1),
      v=jnp.concatenate([ring_v, oow_v], axis=1),
      score=jnp.concatenate([ring_score, oow_score], axis=1).astype(jnp.float32),
      past_len=past_len_BK,
  )
  return new_cache, kept_BTK


def score_settled_token(cache: LTECache, lte: LTEConfig, router, position: jax.Array,
                        pad_count_B: jax.Array) -> LTECache:
  """§5.4, one token per step: after `insert_token` wrote token t (so `position` = t + 1), the
  token t - margin has all the right context its router score needs; score it over ring tokens
  t - 2 margin .. t.

  The router's receptive field is +-margin tokens, so this is the score the router gives that
  token over the whole sequence, the score the reference's lazy rescoring of the whole ring
  (every W - 2 margin steps) gives it before it can leave the window: tokens leave the window
  with the same scores. Doing it per token reads 2 margin + 1 ring slots a step and needs no
  branch (a branch whose operand is the stacked cache made XLA change the whole cache's layout
  twice a step on the GPU). Blank slots stay -inf and sinks +inf (G14). `cache` holds
  `GroupSlot` leaves. No-op for a context-free router (margin 0: scored at insertion).
  """
  margin = lte.router_margin
  if margin == 0:
    return cache
  window_keys, span = lte.window_keys, 2 * margin + 1
  batch = cache.k.shape[0]
  ptr, blank_B = ring_state(lte, position, pad_count_B)
  # Chronological index c (0 = oldest) is slot (ptr + c) % W and holds position
  # position - W + c; the last `span` of them are t - 2 margin .. t.
  chrono_S = jnp.arange(window_keys - span, window_keys, dtype=jnp.int32)
  slot_S = (ptr + chrono_S) % window_keys
  rows_B1 = jnp.arange(batch, dtype=jnp.int32)[:, None]
  positions_BS = jnp.broadcast_to(position - window_keys + chrono_S, (batch, span))
  k_pre_BSKD = derope(cache.k.take((rows_B1, slot_S[None])), positions_BS, lte.rope_theta)
  real_BS = chrono_S[None, :] >= blank_B[:, None]
  fresh_BK = router.settled_scores(k_pre_BSKD, cache.v.take((rows_B1, slot_S[None])), real_BS)
  # The settled token's score follows without reading the old one: +inf for a sink (one of the
  # row's first num_sinks real tokens), -inf for a blank, else the fresh score. (A read of the
  # slot would also let XLA move it before the insert's write, which touches another slot, and
  # then copy the whole stacked score buffer to keep both.)
  real_B = real_BS[:, margin]
  sink_B = real_B & is_sink(lte, position - 1 - margin, pad_count_B)
  settled_BK = jnp.where(sink_B[:, None], jnp.inf, jnp.where(real_B[:, None], fresh_BK, -jnp.inf))
  return cache.replace(score=cache.score.write(settled_BK[:, None], start=(0, slot_S[margin])))


def insert_token(cache: LTECache, lte: LTEConfig, k_B1KD: jax.Array, v_B1KD: jax.Array,
                 score_B1K: jax.Array, position: jax.Array, pad_count_B: jax.Array) -> LTECache:
  """§5.3 step 3, for the token at padded position `position`: move the ring's oldest token
  (slot ptr) into the OOW set if it qualifies and write the new token into slot ptr. `cache`
  holds `GroupSlot` leaves.

  Score > 0: append while past_len < b, else replace the OOW minimum when that is smaller than
  the leaving score (otherwise drop it). Blank slots have score -inf and are dropped. The data
  movement is the fused `evict_and_insert` op, in place in the stacked cache.
  """
  window_keys = lte.window_keys
  ptr, _ = ring_state(lte, position, pad_count_B)
  sink_B = is_sink(lte, position, pad_count_B)
  score_BK = jnp.where(sink_B[:, None], jnp.inf, score_B1K[:, 0].astype(jnp.float32))
  slots = (cache.k, cache.v, cache.score, cache.past_len)
  moved = evict_and_insert(
      *(slot.stacked for slot in slots), ptr, k_B1KD[:, 0].astype(cache.k.dtype),
      v_B1KD[:, 0].astype(cache.v.dtype), score_BK, window_keys=window_keys,
      group=cache.k.group, implementation=lte.implementation)
  k, v, score, past_len = (slot.replace(stacked=x) for slot, x in zip(slots, moved))
  return cache.replace(k=k, v=v, score=score, past_len=past_len)


def visible_slots(cache: LTECache, lte: LTEConfig, position: jax.Array, pad_count_B: jax.Array
                  ) -> jax.Array:
  """bool [B, W + b]: ring slots except the blanks [ptr, ptr + blank) (mod W) of the ring after
  `position` padded tokens; OOW slots True. `cache` holds `GroupSlot` leaves."""
  window_keys = lte.window_keys
  ptr, blank_B = ring_state(lte, position, pad_count_B)
  slot_S = jnp.arange(cache.k.shape[1], dtype=jnp.int32)
  # Distance from ptr around the ring: the blanks are the first `blank` slots from ptr.
  from_ptr_S = jnp.mod(slot_S - ptr, window_keys)
  return (slot_S >= window_keys)[None, :] | (from_ptr_S[None, :] >= blank_B[:, None])
