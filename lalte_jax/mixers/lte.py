"""Learnable token eviction attention, training-time definition (§4).

The router scores every (token, KV head) from the pre-RoPE key and the value. A key is visible to
query t iff it is causal and (it is among the w+1 most recent keys, or a sink (first `num_sinks`
positions), or its score is > 0). No cap applies in training (§4.2); the cap b bounds the decode
cache (§5). The boolean selection carries no gradient, so the router learns through a
straight-through estimator on v (§4.3): forward v is unchanged, backward
dL/dscore_{j,h} = sum_d v_{j,h,d} dL/dv_{j,h,d} with the total gradient of v (in-window use
included, G10).

Decoding keeps the constant-memory LTE cache (§5; the cache and its array operations are in
`lalte_jax.inference.lte_cache`, whose docstring describes it): `prefill` scores the prompt,
fills the ring and the capped out-of-window set and runs every prompt query against its window
plus that set; `decode` evicts the oldest ring token into the set, inserts the new token, gives
the token `margin` steps back its final score and attends over the cache, in place in the stacked
decode cache. Keys are
roped at padded-tensor indices (§5.5).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.inference import lte_cache
from lalte_jax.inference.caches import StepContext
from lalte_jax.inference.lte_cache import LTECache
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.attention import AttentionProjections
from lalte_jax.mixers.lte_router import LTERouter
from lalte_jax.sharding import per_shard
from pallas_kernels.decode_attention import decode_attention
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


# Folded into the layer's dropout key for the reveal draw: a stream apart from the router's
# per-conv-layer dropout keys, which are split from the same key.
_REVEAL_STREAM = 1


@flax.struct.dataclass
class RoutingControls:
  """How the LTE layers route in one training step, beyond §4 (the router warm-up variants of
  lalte_jax/train/router_warmup.py); the defaults are §4 itself. Traced or Python values.

  reveal_probability: each token the router evicts is visible to every query anyway with this
    probability, drawn per row, token and KV head from the dropout key (1: every token). The
    scores keep their values and gradients, so revealed tokens' long-range reads reach them.
  score_gradient: False cuts every gradient through the scores (the straight-through signal and
    the sparsity loss's), so neither the routers nor, through them, the key and value
    projections learn from the routing; the selection itself is unchanged.
  task_gradient: False cuts only the straight-through signal (the task loss's gradient through
    the reads of each value, §4.3): the returned scores keep theirs, so the sparsity loss alone
    moves the routers.
  """
  reveal_probability: jax.Array | float = 0.0
  score_gradient: jax.Array | bool = True
  task_gradient: jax.Array | bool = True


def _gradient_where(flag: jax.Array | bool, x: jax.Array) -> jax.Array:
  """x, with its gradient cut where `flag` is False (a Python True adds nothing to the step)."""
  return x if flag is True else jnp.where(flag, x, jax.lax.stop_gradient(x))


class LTEAttention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    lte = config.lte
    self.config = lte
    self.proj = AttentionProjections(config, lte.num_heads, lte.num_kv_heads, lte.head_dim,
                                     rngs=rngs)
    self.router = LTERouter(lte, rngs=rngs)

  def __call__(self, x_BTD: jax.Array, *, dropout_key: jax.Array | None = None,
               routing: RoutingControls | None = None) -> tuple[jax.Array, jax.Array]:
    """Returns (output [B,T,hidden], score [B,T,Hkv] float32). `routing` changes how the layer
    routes during training (RoutingControls; None: as §4); revealing needs `dropout_key`."""
    lte = self.config
    routing = routing or RoutingControls()
    q_BTHD, k_BTKD, v_BTKD = self.proj.qkv(x_BTD)
    score_BTK = self.router(k_BTKD, v_BTKD, dropout_key=dropout_key)
    score_BTK = _gradient_where(routing.score_gradient, score_BTK)
    # The scores as the reads' straight-through gradient reaches them.
    v_BTKD = straight_through_scores(v_BTKD, _gradient_where(routing.task_gradient, score_BTK))
    kept_BTK = selected_tokens(score_BTK)
    reveal = routing.reveal_probability
    if not (isinstance(reveal, (int, float)) and reveal == 0):  # likewise a Python 0
      if dropout_key is None:
        raise ValueError("LTEAttention: reveal_probability needs a dropout_key (training only)")
      draw_BTK = jax.random.uniform(jax.random.fold_in(dropout_key, _REVEAL_STREAM),
                                    score_BTK.shape)
      kept_BTK = kept_BTK | (draw_BTK < reveal)
    positions_BT = default_positions(*x_BTD.shape[:2])
    q_BTHD = apply_rope(q_BTHD, positions_BT, lte.rope_theta)
    k_BTKD = apply_rope(k_BTKD, positions_BT, lte.rope_theta)
    o_BTHD = per_shard(
        lambda q, k, v, kept: masked_attention(q, k, v, window_size=lte.window_keys,
                                               num_sinks=lte.num_sinks, kept_BSK=kept,
                                               implementation=lte.implementation),
        q_BTHD, k_BTKD, v_BTKD, kept_BTK)
    return self.proj.output(o_BTHD), score_BTK

  def prefill(self, h_BTD: jax.Array, norm, cache: LTECache, ctx: StepContext
              ) -> tuple[jax.Array, LTECache]:
    """h + the layer's output over a left-padded prompt (h the block's residual stream, `norm`
    its pre-mixer RMSNorm) and the filled cache (§5.2).

    Each prompt query attends to its window (w + 1 keys, padding excluded) plus the kept OOW set
    *at the end of the prompt* restricted to keys at least W older (§5.2 step 6, G24); below the
    cap this equals the training-time layer. Outputs at pads are zero; the cache's contents on
    entry are ignored (a prompt starts a sequence). With `ctx.chunk_tokens` the queries (their
    projection, attention and o_proj) go a chunk at a time against the whole prompt's keys and
    kept set: the same outputs.
    """
    lte = self.config
    real_BT = ctx.valid_BT
    x_BTD = norm(h_BTD)
    k_pre_BTKD, v_BTKD = self.proj.keys_values(x_BTD)
    score_BTK = self.router(k_pre_BTKD, v_BTKD, mask_BT=real_BT)
    score_BTK = lte_cache.mark_sinks_and_padding(score_BTK, real_BT, lte.num_sinks)
    positions_BT = default_positions(*h_BTD.shape[:2])  # padded-tensor indices (G25)
    k_BTKD = apply_rope(k_pre_BTKD, positions_BT, lte.rope_theta)
    k_BTKD, v_BTKD = k_BTKD.astype(cache.k.dtype), v_BTKD.astype(cache.v.dtype)
    cache, kept_BTK = lte_cache.fill_from_prompt(cache, lte, k_BTKD, v_BTKD, score_BTK, real_BT)

    # Kept keys inside a query's window are visible anyway, so "kept, or within the window" is the
    # spec's "window plus kept keys with j <= t - W". Sinks are kept by their +inf score, so the
    # attention op's position-based sinks are off (with padding they are not at positions 0..s-1).
    # Outputs at pads are zero: the chunk's queries are the last of its keys, so the keys'
    # validity ends with theirs.
    def attend(x_BCD, positions_BC, k_BSKD, v_BSKD, kept_BSK, valid_BS):
      q_BCHD = apply_rope(self.proj.queries(x_BCD), positions_BC, lte.rope_theta)
      o_BCHD = masked_attention(
          q_BCHD, k_BSKD, v_BSKD, window_size=lte.window_keys, num_sinks=0, kept_BSK=kept_BSK,
          key_valid_BS=valid_BS, implementation=lte.implementation).astype(q_BCHD.dtype)
      real_BC11 = valid_BS[:, -x_BCD.shape[1]:, None, None]
      return jnp.where(real_BC11, o_BCHD, jnp.zeros_like(o_BCHD))

    h_BTD = self.proj.prompt_output(h_BTD, x_BTD, norm, positions_BT,
                                    (k_BTKD, v_BTKD, kept_BTK, real_BT), ctx.chunk_tokens, attend)
    return h_BTD, cache

  def decode(self, x_B1D: jax.Array, cache: LTECache, ctx: StepContext
             ) -> tuple[jax.Array, LTECache]:
    """One new (real) token per row at padded position t = ctx.position (§5.3, §5.5), from a
    prefilled cache or an empty one (`init_lte_cache`), on the layer group's part of the stacked
    cache (`GroupSlot` leaves, updated in place). The cache keeps its shapes and dtypes."""
    lte = self.config
    batch = x_B1D.shape[0]
    q_B1HD, k_pre_B1KD, v_B1KD = self.proj.qkv(x_B1D)
    positions_B1 = jnp.broadcast_to(ctx.position, (batch, 1))
    q_B1HD = apply_rope(q_B1HD, positions_B1, lte.rope_theta)
    k_B1KD = apply_rope(k_pre_B1KD, positions_B1, lte.rope_theta)

    if lte.router_margin == 0:
      # A context-free router's score is final at once (§7.3: LTE-MLP).
      new_score_B1K = self.router(k_pre_B1KD, v_B1KD)
    else:
      new_score_B1K = jnp.full((batch, 1, lte.num_kv_heads), lte_cache.PROVISIONAL_SCORE,
                               jnp.float32)
    cache = lte_cache.insert_token(cache, lte, k_B1KD, v_B1KD, new_score_B1K, ctx.position,
                                   ctx.pad_count_B)
    # Token t - margin now has its right context: its final score (§5.4).
    seen = ctx.position + 1
    cache = lte_cache.score_settled_token(cache, lte, self.router, seen, ctx.pad_count_B)

    # The new token is in the ring now, so the window is keys t-w..t; everything cached is in the
    # past, so no causal mask is needed. Visible: the ring minus its blanks, and OOW slots below
    # W + past_len (split so the kernel skips unfilled OOW slots).
    o_BHD = decode_attention(
        q_B1HD[:, 0], cache.k.stacked, cache.v.stacked, scale=lte.head_dim ** -0.5,
        length_BK=lte.window_keys + cache.past_len.read(),
        key_valid=lte_cache.visible_slots(cache, lte, seen, ctx.pad_count_B),
        group=cache.k.group, implementation=lte.implementation)
    return self.proj.output(o_BHD[:, None].astype(q_B1HD.dtype)), cache
