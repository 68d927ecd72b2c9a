"""Learnable token eviction attention, training-time definition (§4).

The router scores every (token, KV head) from the pre-RoPE key and the value. A key is visible to
query t iff it is causal and (it is among the w+1 most recent keys, or a sink (first `num_sinks`
positions), or its score is > 0). No cap applies in training (§4.2); the cap b bounds the decode
cache (§5). The boolean selection carries no gradient, so the router learns through a
straight-through estimator on v (§4.3): forward v is unchanged, backward
dL/dscore_{j,h} = sum_d v_{j,h,d} dL/dv_{j,h,d} with the total gradient of v (in-window use
included, G10).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.attention import AttentionProjections
from lalte_jax.mixers.lte_router import LTERouter
from lalte_jax.sharding import per_shard
from pallas_kernels.masked_attention import masked_attention


@jax.custom_vjp
def straight_through_scores(v_BTKD: jax.Array, score_BTK: jax.Array) -> jax.Array:
  """Identity on v whose backward pass also sends sum_d v * dL/dv to the scores (§4.3)."""
  del score_BTK
  return v_BTKD


def _straight_through_fwd(v_BTKD, score_BTK):
  return v_BTKD, (v_BTKD, score_BTK)


def _straight_through_bwd(residuals, dv_BTKD):
  v_BTKD, score_BTK = residuals
  dscore_BTK = jnp.sum(v_BTKD.astype(jnp.float32) * dv_BTKD.astype(jnp.float32), axis=-1)
  return dv_BTKD, dscore_BTK.astype(score_BTK.dtype)


straight_through_scores.defvjp(_straight_through_fwd, _straight_through_bwd)


def selected_tokens(score_BTK: jax.Array) -> jax.Array:
  """Kept out-of-window tokens: score > 0, i.e. r = sigmoid(x) > 0.5. Sinks are added by the
  attention op (`num_sinks`)."""
  return score_BTK > 0


def retention_count(score_BTK: jax.Array, margin: int) -> jax.Array:
  """Tokens with score > 0 among positions j < T - margin: [B, Hkv] float32 (§4.5).

  The last `margin` positions are excluded: their right context was zero padding.
  """
  length = score_BTK.shape[1]
  return jnp.sum(score_BTK[:, :length - margin] > 0, axis=1).astype(jnp.float32)


class LTEAttention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    lte = config.lte
    self.config = lte
    self.proj = AttentionProjections(config, lte.num_heads, lte.num_kv_heads, lte.head_dim,
                                     rngs=rngs)
    self.router = LTERouter(lte, rngs=rngs)

  def __call__(self, x_BTD: jax.Array, *, dropout_key: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Returns (output [B,T,hidden], score [B,T,Hkv] float32)."""
    lte = self.config
    q_BTHD, k_BTKD, v_BTKD = self.proj.qkv(x_BTD)
    score_BTK = self.router(k_BTKD, v_BTKD, dropout_key=dropout_key)
    v_BTKD = straight_through_scores(v_BTKD, score_BTK)
    positions_BT = default_positions(*x_BTD.shape[:2])
    q_BTHD = apply_rope(q_BTHD, positions_BT, lte.rope_theta)
    k_BTKD = apply_rope(k_BTKD, positions_BT, lte.rope_theta)
    o_BTHD = per_shard(
        lambda q, k, v, kept: masked_attention(q, k, v, window_size=lte.window_keys,
                                               num_sinks=lte.num_sinks, kept_BSK=kept,
                                               implementation=lte.implementation),
        q_BTHD, k_BTKD, v_BTKD, selected_tokens(score_BTK))
    return self.proj.output(o_BTHD), score_BTK
