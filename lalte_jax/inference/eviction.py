"""Training-free eviction for the full-attention layers of a trained GDN+Attn model
(§7.1-7.2): TOVA and uniform stride + recent window, each at a fixed total cache per layer.

Choices for the spec's open points (documented here and in docs/model_spec.md §13):
- Prompt (both policies): the prompt is processed by exact full attention; the cache is reduced
  once, at the end of the prompt, to the set the policy keeps there. This is the one-shot reading
  (the same end-of-prompt reduction LTE's prefill applies, §5.2 / §5.6), cheaper than streaming
  the prompt token by token, and identical to it for prompts that fit the cache.
- TOVA (Oren et al. 2024, standard form, not "accumulated" scores): the layer keeps at most
  `cache_size` tokens. A decode step attends over the kept tokens plus the new one, then, if that
  makes `cache_size + 1`, drops the token with the lowest attention weight of the current query,
  averaged over all query heads of the layer (the new token can be the one dropped). At the end of
  the prompt it keeps the `cache_size` tokens with the highest head-averaged weights of the last
  prompt query. Ties go to the lower slot. Buffers hold `cache_size + 1` slots.
- Uniform stride + recent window: `recent` (default cache_size/2 = 512) most recent tokens, the
  current one included, plus out-of-window tokens at positions that are multiples of a stride s,
  s the smallest power of two with ceil(m / s) <= cache_size - recent, m = number of out-of-window
  tokens. Powers of two make the kept sets nested as s grows, so a streaming decoder never needs a
  token it already evicted (a stride ceil(m/512) that grows by other factors would). Position 0 is
  always kept (it acts as a sink); no other sinks. Between cache_size/2 and cache_size tokens are
  kept once the window is full.
Positions are real positions (first real token = 0), as for full attention (§3.1). A decode step
works on the layer group's part of the stacked cache (`GroupSlot` leaves): it scatters the moved
rows in place and the attention ops read the group's slots from the stacked buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from lalte_jax.config import AttentionConfig
from pallas_kernels.decode_attention import decode_attention, decode_attention_weights
from pallas_kernels.dispatch import Implementation

POLICIES = ("tova", "uniform")


@dataclasses.dataclass(frozen=True)
class EvictionConfig:
  policy: Literal["tova", "uniform"]
  cache_size: int = 1024  # tokens kept per layer (per row), all heads together
  recent: int | None = None  # uniform only: recent-window part; None = cache_size // 2

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(f"eviction.policy: must be one of {POLICIES}, got {self.policy!r}")
    if not isinstance(self.cache_size, int) or self.cache_size < 2:
      raise ValueError(f"eviction.cache_size: must be an int >= 2, got {self.cache_size!r}")
    if self.recent is not None:
      if self.policy != "uniform":
        raise ValueError("eviction.recent: only the 'uniform' policy has a recent window")
      if not isinstance(self.recent, int) or not 1 <= self.recent < self.cache_size:
        raise ValueError(f"eviction.recent: must be an int in [1, cache_size), got"
                         f" {self.recent!r}")

  @property
  def recent_size(self) -> int:
    return self.recent if self.recent is not None else self.cache_size // 2


@flax.struct.dataclass
class EvictionCache:
  """k/v [B, slots, Hkv, D] post-RoPE; pos_BS real position of each slot (-1 = empty).

  TOVA: slots = cache_size + 1, any order. Uniform: slots [0, recent) are a ring (slot = position
  mod recent), slots [recent, cache_size) the strided tokens; stride_B is the current stride.
  """
  k_BSKD: jax.Array
  v_BSKD: jax.Array
  pos_BS: jax.Array
  stride_B: jax.Array
  policy: str = flax.struct.field(pytree_node=False, default="tova")
  recent: int = flax.struct.field(pytree_node=False, default=0)


def init_eviction_cache(eviction: EvictionConfig, attn: AttentionConfig, batch: int, dtype
                        ) -> EvictionCache:
  slots = eviction.cache_size + (1 if eviction.policy == "tova" else 0)
  shape = (batch, slots, attn.num_kv_heads, attn.head_dim)
  return EvictionCache(k_BSKD=jnp.zeros(shape, dtype), v_BSKD=jnp.zeros(shape, dtype),
                       pos_BS=jnp.full((batch, slots), -1, jnp.int32),
                       stride_B=jnp.ones((batch,), jnp.int32), policy=eviction.policy,
                       recent=eviction.recent_size if eviction.policy == "uniform" else 0)


def _head_mean_weights(q_BHD, k_BSKD, valid_BS, group=None) -> jax.Array:
  """[B, S] float32: the query's attention weights over the valid slots, averaged over its heads
  (k stacked over layer groups when `group` is given). One version, XLA, on every backend."""
  return jnp.mean(decode_attention_weights(q_BHD, k_BSKD, key_valid=valid_BS, group=group),
                  axis=1)


def _next_power_of_two(x_B: jax.Array) -> jax.Array:
  """Smallest power of two >= x (x >= 1), int32."""
  return jnp.left_shift(1, 32 - jax.lax.clz(jnp.maximum(x_B, 1) - 1)).astype(jnp.int32)


def uniform_stride(out_of_window_B: jax.Array, strided_slots: int) -> jax.Array:
  """Smallest power of two s with ceil(m / s) <= strided_slots (1 when m <= strided_slots)."""
  needed_B = -(-jnp.maximum(out_of_window_B, 0) // strided_slots)
  return _next_power_of_two(jnp.maximum(needed_B, 1))


def _gather_rows(x_BT_: jax.Array, index_BS: jax.Array) -> jax.Array:
  index = index_BS.reshape(*index_BS.shape, *([1] * (x_BT_.ndim - 2)))
  return jnp.take_along_axis(x_BT_, index, axis=1)


def eviction_prefill(cache: EvictionCache, q_BTHD, k_BTKD, v_BTKD, valid_BT, pad_count_B
                     ) -> EvictionCache:
  """The cache at the end of a left-padded prompt (post-RoPE q/k, real positions = index - pad).
  The prompt's own attention is the layer's (exact full attention)."""
  batch, length = valid_BT.shape
  slots = cache.pos_BS.shape[1]
  real_len_B = length - pad_count_B
  if cache.policy == "tova":
    weights_BS = _head_mean_weights(q_BTHD[:, -1], k_BTKD, valid_BT)
    keep = min(slots - 1, length)
    score_BS = jnp.where(valid_BT, weights_BS, -jnp.inf)
    top_BC, index_BC = jax.lax.top_k(score_BS, keep)
    pos_BC = jnp.where(jnp.isfinite(top_BC), index_BC - pad_count_B[:, None], -1)
  else:
    recent = cache.recent
    last_B1 = real_len_B[:, None] - 1
    ring_R = jnp.arange(recent)
    ring_pos_BR = last_B1 - (last_B1 - ring_R[None]) % recent  # latest position in each slot
    strided = slots - recent
    stride_B = uniform_stride(real_len_B - recent, strided)
    strided_pos_BC = jnp.arange(strided)[None] * stride_B[:, None]
    strided_pos_BC = jnp.where(strided_pos_BC < real_len_B[:, None] - recent, strided_pos_BC, -1)
    pos_BC = jnp.concatenate([jnp.where(ring_pos_BR >= 0, ring_pos_BR, -1), strided_pos_BC], 1)
    cache = cache.replace(stride_B=stride_B)
    index_BC = pos_BC + pad_count_B[:, None]
  index_BC = jnp.clip(index_BC, 0, length - 1)
  keep = pos_BC.shape[1]
  pad = ((0, 0), (0, slots - keep), (0, 0), (0, 0))
  k_BSKD = jnp.pad(_gather_rows(k_BTKD, index_BC), pad).astype(cache.k_BSKD.dtype)
  v_BSKD = jnp.pad(_gather_rows(v_BTKD, index_BC), pad).astype(cache.v_BSKD.dtype)
  pos_BS = jnp.pad(pos_BC, ((0, 0), (0, slots - keep)), constant_values=-1).astype(jnp.int32)
  return cache.replace(k_BSKD=k_BSKD, v_BSKD=v_BSKD, pos_BS=pos_BS)


def _write(cache: EvictionCache, slot_B, k_B1KD, v_B1KD, pos_B) -> EvictionCache:
  rows = jnp.arange(slot_B.shape[0])
  return cache.replace(k_BSKD=cache.k_BSKD.scatter((rows, slot_B), k_B1KD[:, 0]),
                       v_BSKD=cache.v_BSKD.scatter((rows, slot_B), v_B1KD[:, 0]),
                       pos_BS=cache.pos_BS.scatter((rows, slot_B), pos_B))


def _uniform_admit(cache: EvictionCache, pos_B) -> EvictionCache:
  """Moves the token leaving the ring (position pos - recent) to the strided part if the (possibly
  grown) stride keeps it, after dropping strided tokens that the new stride no longer keeps."""
  recent = cache.recent
  pos_BS = cache.pos_BS.read()
  strided = pos_BS.shape[1] - recent
  rows = jnp.arange(pos_B.shape[0])
  ring_slot_B = pos_B % recent
  leaving_B = pos_BS[rows, ring_slot_B]  # pos - recent, or -1 while the ring fills
  stride_B = uniform_stride(pos_B - recent + 1, strided)
  strided_pos_BC = pos_BS[:, recent:]
  kept_BC = (strided_pos_BC >= 0) & (strided_pos_BC % stride_B[:, None] == 0)
  strided_pos_BC = jnp.where(kept_BC, strided_pos_BC, -1)
  admit_B = (leaving_B >= 0) & (leaving_B % stride_B == 0)
  free_B = recent + jnp.argmax(strided_pos_BC < 0, axis=1)  # nested sets: always room (see doc)
  target_B = jnp.where(admit_B, free_B, recent + strided)  # out of range: dropped by the scatter
  pos_BS = jnp.concatenate([pos_BS[:, :recent], strided_pos_BC], axis=1)
  return cache.replace(
      k_BSKD=cache.k_BSKD.scatter((rows, target_B), cache.k_BSKD.take((rows, ring_slot_B))),
      v_BSKD=cache.v_BSKD.scatter((rows, target_B), cache.v_BSKD.take((rows, ring_slot_B))),
      pos_BS=cache.pos_BS.write(pos_BS.at[rows, target_B].set(leaving_B, mode="drop")),
      stride_B=cache.stride_B.write(stride_B))


def eviction_decode(cache: EvictionCache, q_B1HD, k_B1KD, v_B1KD, pos_B, *,
                    implementation: Implementation = None) -> tuple[jax.Array, EvictionCache]:
  """Attention of the new token (real position pos_B, post-RoPE q/k) and the updated cache, whose
  leaves are `GroupSlot`s. `implementation` chooses the attention's version
  (`pallas_kernels.decode_attention`)."""
  if cache.policy == "tova":
    free_B = jnp.argmax(cache.pos_BS.read() < 0, axis=1)  # at most cache_size kept: one is free
    cache = _write(cache, free_B, k_B1KD, v_B1KD, pos_B)
  else:
    cache = _uniform_admit(cache, pos_B)
    cache = _write(cache, pos_B % cache.recent, k_B1KD, v_B1KD, pos_B)
  pos_BS = cache.pos_BS.read()
  valid_BS = pos_BS >= 0
  group = cache.k_BSKD.group
  o_BHD = decode_attention(q_B1HD[:, 0], cache.k_BSKD.stacked, cache.v_BSKD.stacked,
                           key_valid=valid_BS, group=group, implementation=implementation)
  if cache.policy == "tova":
    weights_BS = _head_mean_weights(q_B1HD[:, 0], cache.k_BSKD.stacked, valid_BS, group)
    full_B = jnp.all(valid_BS, axis=1)
    evict_B = jnp.argmin(jnp.where(valid_BS, weights_BS, jnp.inf), axis=1)
    rows = jnp.arange(pos_B.shape[0])
    pos_BS = pos_BS.at[rows, evict_B].set(jnp.where(full_B, -1, pos_BS[rows, evict_B]))
    cache = cache.replace(pos_BS=cache.pos_BS.write(pos_BS))
  return o_BHD[:, None], cache
