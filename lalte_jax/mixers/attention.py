"""Softmax attention with RoPE and GQA: full causal or sliding window (§3.1).

The q/k/v/o projections here are shared by every attention-type mixer (LTE and NSA add to them).
"""

from __future__ import annotations

import jax
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.projections import input_projection, output_projection
from lalte_jax.sharding import per_shard
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
    batch, length = x_BTD.shape[:2]
    q = self.q_proj(x_BTD).reshape(batch, length, self.num_heads, self.head_dim)
    k = self.k_proj(x_BTD).reshape(batch, length, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x_BTD).reshape(batch, length, self.num_kv_heads, self.head_dim)
    return q, k, v

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
    q_BTHD, k_BTKD, v_BTKD = self.proj.qkv(x_BTD)
    positions_BT = default_positions(*x_BTD.shape[:2])
    q_BTHD = apply_rope(q_BTHD, positions_BT, attn.rope_theta)
    k_BTKD = apply_rope(k_BTKD, positions_BT, attn.rope_theta)
    o_BTHD = per_shard(
        lambda q, k, v: masked_attention(q, k, v, window_size=attn.window_size,
                                         implementation=attn.implementation),
        q_BTHD, k_BTKD, v_BTKD)
    return self.proj.output(o_BTHD)
