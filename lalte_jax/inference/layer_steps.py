"""Per-mixer prefill and decode steps on the modules' own parameters and sub-methods.

Each step is `step(mixer, x_BTD, cache, ctx) -> (mixer_output_BTD, new_cache)` where `x_BTD` is the
normed residual stream of the tokens of this call (the whole left-padded prompt at prefill, one
token at decode) and `ctx` a `StepContext`. Prefill starts from an empty cache; GDN steps also
continue from any state.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from lalte_jax.inference import eviction as eviction_lib
from lalte_jax.inference.caches import GDNCache, KVCache, NSACache
from lalte_jax.inference.nsa_decode import nsa_decode_attention
from lalte_jax.layers.rope import apply_rope, default_positions
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.gated_delta_rule import (ChunkConfig, chunk_gated_delta_rule,
                                             fused_recurrent_gated_delta_rule)
from pallas_kernels.masked_attention import masked_attention
from pallas_kernels.nsa import nsa_attention


@flax.struct.dataclass
class StepContext:
  valid_BT: jax.Array  # bool: real token (False = left pad)
  pad_count_B: jax.Array  # [B] int32 left pads of each row
  position: jax.Array  # [] int32 padded index of this call's first token

  @property
  def real_positions_BT(self) -> jax.Array:
    """RoPE positions of full/SWA/NSA layers: the first real token of a row is 0 (§3.1).
    Pads get negative positions; they are never visible."""
    length = self.valid_BT.shape[1]
    return self.position + jnp.arange(length, dtype=jnp.int32)[None] - self.pad_count_B[:, None]


def _write_prompt(buffer_BSKD: jax.Array, x_BTKD: jax.Array) -> jax.Array:
  """The prompt's keys or values into the first T slots of a preallocated cache buffer."""
  return jax.lax.dynamic_update_slice_in_dim(buffer_BSKD, x_BTKD.astype(buffer_BSKD.dtype), 0,
                                             axis=1)


# ------------------------------------------------------------------------------------------ GDN


def _conv_with_state(state_BKC: jax.Array, x_BTC: jax.Array, weight_CK: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """SiLU(causal depthwise conv) of x continuing after the inputs in `state` (oldest first).

  Tap K-1 multiplies the current token (PyTorch order, as `ShortConv`). Returns (y_BTC, the last
  K-1 inputs as the next state).
  """
  kernel_size = weight_CK.shape[1]
  length = x_BTC.shape[1]
  full_BSC = jnp.concatenate([state_BKC.astype(x_BTC.dtype), x_BTC], axis=1)
  weight = weight_CK.astype(x_BTC.dtype)
  y_BTC = sum(full_BSC[:, i:i + length, :] * weight[:, i] for i in range(kernel_size))
  return jax.nn.silu(y_BTC), full_BSC[:, length:]


def gdn_step(layer, x_BTD: jax.Array, cache: GDNCache, ctx: StepContext
             ) -> tuple[jax.Array, GDNCache]:
  """GDN on T >= 1 tokens from `cache`; pads leave the conv window and the state untouched."""
  gdn = layer.config.gdn
  batch, length = x_BTD.shape[:2]
  valid_BT1 = ctx.valid_BT[:, :, None]
  # Zeroed conv inputs at pads are exactly the zero padding of an unpadded row.
  def conv(proj, conv_module, state_BKC, head_dim):
    inputs_BTC = jnp.where(valid_BT1, proj(x_BTD), 0)
    y_BTC, new_state = _conv_with_state(state_BKC, inputs_BTC, conv_module.weight[...])
    return y_BTC.reshape(batch, length, gdn.num_heads, head_dim), new_state

  q_BTHK, conv_q = conv(layer.q_proj, layer.q_conv, cache.conv_q_BKC, gdn.head_dim)
  k_BTHK, conv_k = conv(layer.k_proj, layer.k_conv, cache.conv_k_BKC, gdn.head_dim)
  v_BTHV, conv_v = conv(layer.v_proj, layer.v_conv, cache.conv_v_BKC, gdn.value_dim)
  g_BTH, beta_BTH = layer.gates(x_BTD)
  # g = 0 (no decay) and beta = 0 (no write) make a pad an identity step of the recurrence.
  g_BTH = jnp.where(ctx.valid_BT[:, :, None], g_BTH, 0.0)
  beta_BTH = jnp.where(ctx.valid_BT[:, :, None], beta_BTH, 0.0)
  if length == 1:
    kernel = fused_recurrent_gated_delta_rule
  else:
    kernel = functools.partial(chunk_gated_delta_rule,
                               config=ChunkConfig(chunk_size=gdn.chunk_size))
  o_BTHV, state_BHKV = kernel(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH,
                              initial_state=cache.state_BHKV, output_final_state=True,
                              use_qk_l2norm=True, implementation=gdn.implementation)
  new_cache = GDNCache(conv_q_BKC=conv_q, conv_k_BKC=conv_k, conv_v_BKC=conv_v,
                       state_BHKV=state_BHKV.astype(jnp.float32))
  return layer.output(o_BTHV, x_BTD), new_cache


# ---------------------------------------------------------------------------- full attention / SWA

def _roped_qkv(proj, x_BTD, positions_BT, theta):
  q_BTHD, k_BTKD, v_BTKD = proj.qkv(x_BTD)
  return apply_rope(q_BTHD, positions_BT, theta), apply_rope(k_BTKD, positions_BT, theta), v_BTKD


def _ring_from_prompt(x_BTKD: jax.Array, ring_size: int) -> jax.Array:
  """The last `ring_size` prompt entries placed at slot (padded index mod ring_size)."""
  batch, length = x_BTKD.shape[:2]
  if length < ring_size:
    return jnp.pad(x_BTKD, ((0, 0), (0, ring_size - length), (0, 0), (0, 0)))
  start = length - ring_size
  return jnp.roll(x_BTKD[:, start:], start % ring_size, axis=1)


def attention_prefill(layer, x_BTD, cache, ctx: StepContext):
  attn = layer.config
  q_BTHD, k_BTKD, v_BTKD = _roped_qkv(layer.proj, x_BTD, ctx.real_positions_BT, attn.rope_theta)
  o_BTHD = masked_attention(q_BTHD, k_BTKD, v_BTKD, window_size=attn.window_size,
                            key_valid_BS=ctx.valid_BT, implementation=attn.implementation)
  if isinstance(cache, eviction_lib.EvictionCache):
    cache = eviction_lib.eviction_prefill(cache, q_BTHD, k_BTKD, v_BTKD, ctx.valid_BT,
                                          ctx.pad_count_B)
  elif attn.window_size is not None:
    window = attn.window_size
    cache = KVCache(k_BSKD=_ring_from_prompt(k_BTKD, window).astype(cache.k_BSKD.dtype),
                    v_BSKD=_ring_from_prompt(v_BTKD, window).astype(cache.v_BSKD.dtype))
  else:
    cache = KVCache(k_BSKD=_write_prompt(cache.k_BSKD, k_BTKD),
                    v_BSKD=_write_prompt(cache.v_BSKD, v_BTKD))
  return layer.proj.output(o_BTHD), cache


def attention_decode(layer, x_B1D, cache, ctx: StepContext):
  attn = layer.config
  q_B1HD, k_B1KD, v_B1KD = _roped_qkv(layer.proj, x_B1D, ctx.real_positions_BT, attn.rope_theta)
  if isinstance(cache, eviction_lib.EvictionCache):
    o_B1HD, cache = eviction_lib.eviction_decode(cache, q_B1HD, k_B1KD, v_B1KD,
                                                 ctx.real_positions_BT[:, 0])
    return layer.proj.output(o_B1HD), cache
  slots = cache.k_BSKD.shape[1]
  slot = ctx.position % slots if attn.window_size is not None else ctx.position
  cache = KVCache(
      k_BSKD=jax.lax.dynamic_update_slice_in_dim(cache.k_BSKD, k_B1KD.astype(
          cache.k_BSKD.dtype), slot, axis=1),
      v_BSKD=jax.lax.dynamic_update_slice_in_dim(cache.v_BSKD, v_B1KD.astype(
          cache.v_BSKD.dtype), slot, axis=1))
  slot_S = jnp.arange(slots, dtype=jnp.int32)
  if attn.window_size is not None:
    # Padded index held by each ring slot: the latest p <= position with p = slot (mod size);
    # negative for slots not yet written. The ring holds exactly the window.
    held_S = ctx.position - (ctx.position - slot_S) % slots
  else:
    held_S = jnp.where(slot_S <= ctx.position, slot_S, -1)
  valid_BS = (held_S[None, :] >= ctx.pad_count_B[:, None]) & (held_S[None, :] >= 0)
  # The query is the newest token: every valid slot is in its past (no causal mask needed).
  o_BHD = decode_attention(q_B1HD[:, 0], cache.k_BSKD, cache.v_BSKD, key_valid=valid_BS,
                           implementation=attn.implementation)
  return layer.proj.output(o_BHD[:, None]), cache


# ------------------------------------------------------------------------------------------ NSA

def _shift_rows(x_BT_: jax.Array, shift_B: jax.Array) -> jax.Array:
  """out[b, i] = x[b, (i + shift[b]) mod T]: moves each row left by its shift, cyclically."""
  length = x_BT_.shape[1]
  index_BT = (jnp.arange(length)[None] + shift_B[:, None]) % length
  index = index_BT.reshape(*index_BT.shape, *([1] * (x_BT_.ndim - 2)))
  return jnp.take_along_axis(x_BT_, index, axis=1)


def _nsa_qkv_gates(layer, x_BTD, positions_BT):
  nsa = layer.config
  batch, length = x_BTD.shape[:2]
  q_BTHD, k_BTKD, v_BTKD = _roped_qkv(layer.proj, x_BTD, positions_BT, nsa.rope_theta)
  gates_BTH3 = jax.nn.sigmoid(layer.g_proj(x_BTD)).reshape(batch, length, nsa.num_heads, 3)
  return q_BTHD, k_BTKD, v_BTKD, gates_BTH3


def nsa_prefill(layer, x_BTD, cache: NSACache, ctx: StepContext):
  """NSA over the prompt with each row's real tokens moved to the front: block boundaries then
  count from the first real token (the reference unpads to varlen, §6), and the pads, now at the
  end, are invisible to the real tokens by causality."""
  nsa = layer.config
  batch, length = x_BTD.shape[:2]
  x_front_BTD = _shift_rows(x_BTD, ctx.pad_count_B)
  q_BTHD, k_BTKD, v_BTKD, gates_BTH3 = _nsa_qkv_gates(
      layer, x_front_BTD, default_positions(batch, length))
  o_front_BTHD = nsa_attention(q_BTHD, k_BTKD, v_BTKD, gates_BTH3, block_size=nsa.block_size,
                               block_count=nsa.block_count, window_size=nsa.window_size,
                               implementation=nsa.implementation)
  o_BTHD = _shift_rows(o_front_BTHD, -ctx.pad_count_B)  # back to the left-padded layout
  # Slots past a row's length hold pad keys; each is overwritten before any query can see it.
  cache = NSACache(k_BSKD=_write_prompt(cache.k_BSKD, k_BTKD),
                   v_BSKD=_write_prompt(cache.v_BSKD, v_BTKD))
  return layer.proj.output(o_BTHD), cache


def nsa_decode(layer, x_B1D, cache: NSACache, ctx: StepContext):
  nsa = layer.config
  real_pos_B = ctx.real_positions_BT[:, 0]
  q_B1HD, k_B1KD, v_B1KD, gates_B1H3 = _nsa_qkv_gates(layer, x_B1D, real_pos_B[:, None])
  rows = jnp.arange(x_B1D.shape[0])
  cache = NSACache(k_BSKD=cache.k_BSKD.at[rows, real_pos_B].set(k_B1KD[:, 0].astype(
                       cache.k_BSKD.dtype)),
                   v_BSKD=cache.v_BSKD.at[rows, real_pos_B].set(v_B1KD[:, 0].astype(
                       cache.v_BSKD.dtype)))
  o_B1HD = nsa_decode_attention(q_B1HD, cache.k_BSKD, cache.v_BSKD, gates_B1H3, real_pos_B, nsa)
  return layer.proj.output(o_B1HD), cache


# ------------------------------------------------------------------------------------------ LTE

def lte_prefill_step(layer, x_BTD, cache, ctx: StepContext):
  from lalte_jax.inference import lte_cache
  return lte_cache.lte_prefill(layer, x_BTD, ctx.valid_BT, cache)


def lte_decode_step(layer, x_B1D, cache, ctx: StepContext):
  del ctx  # the LTE cache tracks its own padded-tensor position (§5.5)
  from lalte_jax.inference import lte_cache
  return lte_cache.lte_decode_step(layer, x_B1D, cache)


PREFILL_STEPS = {"gdn": gdn_step, "attention": attention_prefill, "nsa": nsa_prefill,
                 "lte": lte_prefill_step}
DECODE_STEPS = {"gdn": gdn_step, "attention": attention_decode, "nsa": nsa_decode,
                "lte": lte_decode_step}
