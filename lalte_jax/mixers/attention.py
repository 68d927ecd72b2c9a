"""Softmax attention with RoPE and GQA: full causal or sliding window (§3.1).

The q/k/v/o projections here are shared by every attention-type mixer (LTE and NSA add to them).

Decoding: `prefill` runs the left-padded prompt (RoPE positions start at each row's first real
token) and fills the cache, `decode` adds one token and attends over it, on the layer group's part
of the stacked cache (`GroupSlot` leaves: it writes the new key and value in place and the
attention op reads the group's slots from the stacked buffer). Caches
(`lalte_jax.inference.caches.KVCache`): full attention keeps every key and value at slot = padded
index; SWA keeps a ring of `window_size` slots, the key at padded index p in slot
p % window_size. A full-attention layer may instead keep an `EvictionCache` (TOVA or uniform
stride, `lalte_jax.inference.eviction`, §7.1-7.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.inference import chunking, eviction
from lalte_jax.inference.caches import KVCache, StepContext, ring_from_prompt, write_prompt
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.projections import input_projection, output_projection
from lalte_jax.sharding import per_shard
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.masked_attention import masked_attention


class AttentionProjections(nnx.Module):
  """q_proj: hidden -> Hq*D, k_proj/v_proj: hidden -> Hkv*D, o_proj: Hq*D -> hidden; no bias."""

  def __init__(self, config: ModelConfig, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    hidden = config.hidden_size
    self.q_proj = input_projection(config, hidden, num_heads * head_dim, rngs)
    self.k_proj = input_projection(config, hidden, num_kv_heads * head_dim, rngs)
    self.v_proj = input_projection(config, hidden, num_kv_heads * head_dim, rngs)
    self.o_proj = output_projection(config, num_heads * head_dim, rngs)

  def qkv(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pre-RoPE q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]."""
    return (self.queries(x_BTD), *self.keys_values(x_BTD))

  def queries(self, x_BTD: jax.Array) -> jax.Array:
    """Pre-RoPE q [B,T,Hq,D]."""
    return self.q_proj(x_BTD).reshape(*x_BTD.shape[:2], self.num_heads, self.head_dim)

  def keys_values(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pre-RoPE k and v [B,T,Hkv,D]."""
    shape = (*x_BTD.shape[:2], self.num_kv_heads, self.head_dim)
    return self.k_proj(x_BTD).reshape(shape), self.v_proj(x_BTD).reshape(shape)

  def prompt_output(self, h_BTD: jax.Array, x_BTD: jax.Array, norm, positions_BT: jax.Array,
                    keys: tuple, chunk_tokens: int | None, attend, *,
                    unrolled: bool = False) -> jax.Array:
    """h + o_proj(attend(x, positions, *keys)) of a prompt (h: the block's residual stream,
    x = norm(h) with `norm` its pre-mixer RMSNorm, as the keys were projected from): `attend`
    gives the attention output [B, C, Hq, D] of C queries against `keys` (whole-prompt arrays
    [B, T, ...]). With `chunk_tokens` the queries go that many at a time against the keys up to
    their chunk's end (`lalte_jax.inference.chunking`), each chunk normalised from h and its
    output added into h in place (x is then not read again): one compiled body over front-padded
    keys, or with `unrolled` a Python loop over the keys as they are (full attention, NSA)."""
    length = h_BTD.shape[1]

    def added(h_BCD, x_BCD, positions_BC, keys):
      return h_BCD + self.output(attend(x_BCD, positions_BC, *keys))

    if chunk_tokens is None or length <= chunk_tokens:
      return added(h_BTD, x_BTD, positions_BT, keys)

    def normed_added(h_BCD, positions_BC, keys):
      return added(h_BCD, norm(h_BCD), positions_BC, keys)

    if unrolled:
      return chunking.unrolled_spans(
          lambda start, end, h_BTD: normed_added(h_BTD[:, start:end], positions_BT[:, start:end],
                                                 tuple(a[:, :end] for a in keys)),
          h_BTD, chunk_tokens)
    padded = tuple(chunking.front_padded(a) for a in keys)

    def chunk(start, size, h_BTD):
      h_BCD, positions_BC = (jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)
                             for a in (h_BTD, positions_BT))
      return normed_added(h_BCD, positions_BC,
                          tuple(chunking.keys_ending_at(a, start + size) for a in padded))

    return chunking.span_outputs(chunk, h_BTD, chunk_tokens)

  def roped_qkv(self, x_BTD: jax.Array, positions_BT: jax.Array, theta: float
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q and k after RoPE at `positions_BT`, and v."""
    q_BTHD, k_BTKD, v_BTKD = self.qkv(x_BTD)
    return (apply_rope(q_BTHD, positions_BT, theta), apply_rope(k_BTKD, positions_BT, theta),
            v_BTKD)

  def output(self, o_BTHD: jax.Array) -> jax.Array:
    batch, length = o_BTHD.shape[:2]
    return self.o_proj(o_BTHD.reshape(batch, length, -1))


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    attn = config.attention
    self.config = attn
    self.proj = AttentionProjections(config, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                     rngs=rngs)

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    attn = self.config
    q_BTHD, k_BTKD, v_BTKD = self.proj.roped_qkv(
        x_BTD, default_positions(*x_BTD.shape[:2]), attn.rope_theta)
    o_BTHD = per_shard(
        lambda q, k, v: masked_attention(q, k, v, window_size=attn.window_size,
                                         implementation=attn.implementation),
        q_BTHD, k_BTKD, v_BTKD)
    return self.proj.output(o_BTHD)

  def prefill(self, h_BTD: jax.Array, norm, cache, ctx: StepContext):
    """h + the layer's output over a left-padded prompt (pads invisible; h the block's residual
    stream, `norm` its pre-mixer RMSNorm) and the cache after it. With `ctx.chunk_tokens` the
    queries (projection, attention, o_proj) go a chunk at a time against the whole prompt's keys,
    except into an eviction cache, which scores every query."""
    attn = self.config
    if isinstance(cache, eviction.EvictionCache):
      q_BTHD, k_BTKD, v_BTKD = self.proj.roped_qkv(norm(h_BTD), ctx.real_positions_BT,
                                                   attn.rope_theta)
      o_BTHD = masked_attention(q_BTHD, k_BTKD, v_BTKD, window_size=attn.window_size,
                                key_valid_BS=ctx.valid_BT, implementation=attn.implementation)
      cache = eviction.eviction_prefill(cache, q_BTHD, k_BTKD, v_BTKD, ctx.valid_BT,
                                        ctx.pad_count_B)
      return h_BTD + self.proj.output(o_BTHD), cache
    positions_BT = ctx.real_positions_BT
    x_BTD = norm(h_BTD)
    k_BTKD, v_BTKD = self.proj.keys_values(x_BTD)
    k_BTKD = apply_rope(k_BTKD, positions_BT, attn.rope_theta)

    def attend(x_BCD, positions_BC, k_BSKD, v_BSKD, valid_BS):
      q_BCHD = apply_rope(self.proj.queries(x_BCD), positions_BC, attn.rope_theta)
      return masked_attention(q_BCHD, k_BSKD, v_BSKD, window_size=attn.window_size,
                              key_valid_BS=valid_BS, implementation=attn.implementation)

    h_BTD = self.proj.prompt_output(h_BTD, x_BTD, norm, positions_BT,
                                    (k_BTKD, v_BTKD, ctx.valid_BT), ctx.chunk_tokens, attend,
                                    unrolled=attn.window_size is None)
    return h_BTD, self._cache_from_prompt(cache, k_BTKD, v_BTKD)

  def _cache_from_prompt(self, cache: KVCache, k_BTKD: jax.Array, v_BTKD: jax.Array) -> KVCache:
    """The SWA ring or the full cache holding the prompt's keys (after RoPE) and values."""
    window = self.config.window_size
    if window is not None:
      return KVCache(k_BSKD=ring_from_prompt(k_BTKD, window).astype(cache.k_BSKD.dtype),
                     v_BSKD=ring_from_prompt(v_BTKD, window).astype(cache.v_BSKD.dtype))
    return KVCache(k_BSKD=write_prompt(cache.k_BSKD, k_BTKD),
                   v_BSKD=write_prompt(cache.v_BSKD, v_BTKD))

  def decode(self, x_B1D: jax.Array, cache, ctx: StepContext):
    """One new token per row at padded index `ctx.position`; `cache` holds `GroupSlot` leaves."""
    attn = self.config
    q_B1HD, k_B1KD, v_B1KD = self.proj.roped_qkv(x_B1D, ctx.real_positions_BT, attn.rope_theta)
    if isinstance(cache, eviction.EvictionCache):
      o_B1HD, cache = eviction.eviction_decode(cache, q_B1HD, k_B1KD, v_B1KD,
                                               ctx.real_positions_BT[:, 0],
                                               implementation=attn.implementation)
      return self.proj.output(o_B1HD), cache
    slots = cache.k_BSKD.shape[1]
    slot = ctx.position % slots if attn.window_size is not None else ctx.position
    cache = KVCache(k_BSKD=cache.k_BSKD.write(k_B1KD, (0, slot)),
                    v_BSKD=cache.v_BSKD.write(v_B1KD, (0, slot)))
    slot_S = jnp.arange(slots, dtype=jnp.int32)
    if attn.window_size is not None:
      # Padded index held by each ring slot: the latest p <= position with p = slot (mod size);
      # negative for slots not yet written. The ring holds exactly the window.
      held_S = ctx.position - (ctx.position - slot_S) % slots
    else:
      held_S = jnp.where(slot_S <= ctx.position, slot_S, -1)
    valid_BS = (held_S[None, :] >= ctx.pad_count_B[:, None]) & (held_S[None, :] >= 0)
    # The query is the newest token: every valid slot is in its past (no causal mask needed).
    o_BHD = decode_attention(q_B1HD[:, 0], cache.k_BSKD.stacked, cache.v_BSKD.stacked,
                             key_valid=valid_BS, group=cache.k_BSKD.group,
                             implementation=attn.implementation)
    return self.proj.output(o_BHD[:, None]), cache
