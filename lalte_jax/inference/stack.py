"""Prefill and decode through the whole HybridLM: embed, a `lax.scan` over the stacked layer groups
carrying the residual stream and the stacked caches, mapping (group parameters, group caches) ->
new group caches, final norm and head. Traceable functions; `lalte_jax.generate` jits them.

Reads HybridLM's attributes (`embed`, `groups`, `final_norm`, `lm_head`) and runs each Block's
pieces (`mixer_norm`, `mixer`, `mlp_norm`, `mlp`) around the cached mixer steps, the same
arithmetic as `Block.__call__`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.inference.caches import ModelCache
from lalte_jax.inference.layer_steps import DECODE_STEPS, PREFILL_STEPS, StepContext


def _run_groups(model, h_BTD: jax.Array, caches: tuple, ctx: StepContext, steps: dict
                ) -> tuple[jax.Array, tuple]:
  graphdef, stacked_state = nnx.split(model.groups)

  # The stacked caches ride in the carry and group i's slice is read and written back by index:
  # XLA then updates the (donated) cache buffers in place. Mapping them as scan inputs/outputs
  # instead makes XLA allocate the whole output cache anew each step (measured on CPU: 1.75x the
  # cache in temporaries and twice the step time for a full-attention cache; 0.75x here, the
  # remaining copy being one group's slice).
  def one_group(carry, xs):
    h_BTD, stacked_caches = carry
    group_index, group_state = xs
    group = nnx.merge(graphdef, group_state)
    new_caches = []
    for block, stacked in zip(group.blocks, stacked_caches):
      cache = jax.tree.map(
          lambda x: jax.lax.dynamic_index_in_dim(x, group_index, keepdims=False), stacked)
      mixed_BTD, cache = steps[block.mixer_kind](block.mixer, block.mixer_norm(h_BTD), cache, ctx)
      h_BTD = h_BTD + mixed_BTD.astype(h_BTD.dtype)
      h_BTD = h_BTD + block.mlp(block.mlp_norm(h_BTD))
      new_caches.append(jax.tree.map(
          lambda x, new: jax.lax.dynamic_update_index_in_dim(x, new.astype(x.dtype), group_index,
                                                             0), stacked, cache))
    return (h_BTD, tuple(new_caches)), None

  num_groups = jax.tree.leaves(stacked_state)[0].shape[0]
  (h_BTD, caches), _ = jax.lax.scan(
      one_group, (h_BTD, caches), (jnp.arange(num_groups, dtype=jnp.int32), stacked_state))
  return h_BTD, caches


def logits_from_hidden(model, h_BTD: jax.Array) -> jax.Array:
  """Final norm and LM head (tied or not), logits float32 [B, T, V]."""
  h_BTD = model.final_norm(h_BTD)
  head_DV = model.embed.embedding[...].T if model.config.tie_embeddings else model.lm_head[...]
  return jnp.einsum("btd,dv->btv", h_BTD, head_DV.astype(h_BTD.dtype),
                    preferred_element_type=jnp.float32)


def prefill_impl(model, tokens_BT: jax.Array, valid_BT: jax.Array, cache: ModelCache,
                 all_logits: bool) -> tuple[jax.Array, ModelCache]:
  """Runs a left-padded prompt from an empty cache.

  Returns the logits of the last position [B, V] (or of every position [B, T, V] when
  `all_logits`) and the filled cache.
  """
  length = tokens_BT.shape[1]
  pad_count_B = (length - jnp.sum(valid_BT, axis=1)).astype(jnp.int32)
  ctx = StepContext(valid_BT=valid_BT, pad_count_B=pad_count_B,
                    position=jnp.zeros((), jnp.int32))
  h_BTD = model.embed(tokens_BT)
  h_BTD, layers = _run_groups(model, h_BTD, cache.layers, ctx, PREFILL_STEPS)
  logits = logits_from_hidden(model, h_BTD if all_logits else h_BTD[:, -1:])
  new_cache = cache.replace(layers=layers, pad_count_B=pad_count_B,
                            position=jnp.asarray(length, jnp.int32))
  return (logits if all_logits else logits[:, 0]), new_cache


def decode_impl(model, token_B: jax.Array, cache: ModelCache) -> tuple[jax.Array, ModelCache]:
  """One token per row at padded index `cache.position`; returns logits [B, V] and the cache."""
  batch = token_B.shape[0]
  ctx = StepContext(valid_BT=jnp.ones((batch, 1), bool), pad_count_B=cache.pad_count_B,
                    position=cache.position)
  h_B1D = model.embed(token_B[:, None])
  h_B1D, layers = _run_groups(model, h_B1D, cache.layers, ctx, DECODE_STEPS)
  logits_B1V = logits_from_hidden(model, h_B1D)
  return logits_B1V[:, 0], cache.replace(layers=layers, position=cache.position + 1)
