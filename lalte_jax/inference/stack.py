"""Prefill and decode through the whole HybridLM: embed, a `lax.scan` over the stacked layer groups
carrying the residual stream and the stacked caches, where each `Block.step` runs its mixer's
`prefill` or `decode` on its group's part of the cache (`group_slot.group_view`), then
`HybridLM.logits_from_hidden`. Traceable functions; `lalte_jax.generate` jits them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.inference import group_slot
from lalte_jax.inference.caches import ModelCache, StepContext
from lalte_jax.mixers.gdn import GatedDeltaNet


def decode_groups(model) -> tuple | None:
  """Each layer group's parameters as arrays of their own, (graphdef, (state_0, ..., state_G-1)),
  prepared for decoding (`split_groups`), on a GPU; None elsewhere (the groups then run as a
  rolled `lax.scan`).

  A decode step is bound by reading the weights. Sliced out of the stacked parameters by a
  rolled loop, every group's weights are copied each step (one H100, lalte-1.4b B32 after 4K:
  180 copies, 2.0 ms; 7.03 -> 5.87 ms a step with the groups unrolled). Unrolled, a step alone
  reads each group's slice in place, but inside `generate`'s `while_loop` the slices of the
  loop-carried parameters are copied again every step (H200, same shapes: 181 copies, 1.45 ms a
  token), so `generate` splits the groups once, before its loop, and its steps read them as they
  are (its memory grows by one copy of the groups' weights). XLA:CPU copies LTE cache leaves
  when the groups are unrolled, so the CPU keeps the rolled loop.

  Split groups also hold each GDN layer's six input projections as one kernel, so that a decode
  step reads them in one GEMM a layer instead of six small ones (a step is bound by reading
  weights and by kernel launches); the fused kernel replaces the six in the copy, it does not add
  to it.
  """
  return split_groups(model) if jax.default_backend() == "gpu" else None


def split_groups(model) -> tuple:
  """(graphdef, one state per layer group) of `model.groups`: the stacked parameters sliced, with
  every GDN layer's input projections fused (`GatedDeltaNet.fuse_decode_projections`, a no-op on
  a model `prepared_for_decoding`), so the groups only decode. The groups share the one
  graphdef."""
  graphdef, stacked_state = nnx.split(model.groups)
  num_groups = jax.tree.leaves(stacked_state)[0].shape[0]
  states = []
  for g in range(num_groups):
    group = _fused(nnx.merge(graphdef, jax.tree.map(lambda x, g=g: x[g], stacked_state)))
    prepared_graphdef, state = nnx.split(group)
    states.append(state)
  return prepared_graphdef, tuple(states)


def prepared_for_decoding(model):
  """A copy of `model` whose GDN layers hold their input projections fused, on the stacked
  parameters (one more copy of those kernels; every other array is shared with `model`). It only
  decodes. For a step jitted on its own (`generate.decode_step_fn`): the step then slices each
  group's fused kernel where it lies, and takes as many parameter arrays as the model has (with
  the split groups as arguments, twelve times as many at lalte-1.4b, the waited-for step took
  0.3-1.2 ms longer on one H200, in host gaps)."""
  return _fused(nnx.merge(*nnx.split(model)))


def _fused(module):
  """`module` (a fresh copy: it is changed) with `fuse_decode_projections` run on its GDN
  layers."""
  # Listed first: fusing changes the graph that iter_graph walks.
  gdn_layers = [node for _, node in nnx.iter_graph(module) if isinstance(node, GatedDeltaNet)]
  for layer in gdn_layers:
    layer.fuse_decode_projections()
  return module


def _run_groups(model, h_BTD: jax.Array, caches: tuple, ctx: StepContext, mode: str,
                groups: tuple | None = None) -> tuple[jax.Array, tuple]:
  """The layer groups over the residual stream and the stacked caches; `groups`: the groups'
  parameters split by `decode_groups` (run one after another), else a rolled scan over
  `model.groups`."""
  graphdef, stacked_state = groups if groups is not None else nnx.split(model.groups)

  # The stacked caches ride in the carry and each mixer reads and writes its group's part of them
  # by index (`group_slot`), so XLA updates the donated cache buffers in place. Mapping them as
  # scan inputs/outputs instead makes XLA allocate the whole output cache anew each step
  # (measured on CPU: 1.75x the cache in temporaries and twice the step time for a full-attention
  # cache), and slicing a group's cache out and writing it back copies it twice per step.
  def one_group(carry, xs):
    h_BTD, stacked_caches = carry
    group_index, group_state = xs
    group = nnx.merge(graphdef, group_state)
    new_caches = []
    for block, stacked in zip(group.blocks, stacked_caches):
      h_BTD, view = block.step(h_BTD, group_slot.group_view(stacked, group_index), ctx, mode)
      new_caches.append(group_slot.stacked(view))
    return (h_BTD, tuple(new_caches)), None

  if groups is not None:
    carry = (h_BTD, caches)
    for index, group_state in enumerate(stacked_state):
      carry, _ = one_group(carry, (jnp.asarray(index, jnp.int32), group_state))
    return carry
  num_groups = jax.tree.leaves(stacked_state)[0].shape[0]
  # A prefill is bound by compute, and rolled it compiles once instead of once per group.
  (h_BTD, caches), _ = jax.lax.scan(
      one_group, (h_BTD, caches), (jnp.arange(num_groups, dtype=jnp.int32), stacked_state))
  return h_BTD, caches


def prefill_impl(model, tokens_BT: jax.Array, valid_BT: jax.Array, cache: ModelCache,
                 all_logits: bool, chunk_tokens: int | None = None
                 ) -> tuple[jax.Array, ModelCache]:
  """Runs a left-padded prompt from an empty cache.

  Returns the logits of the last position [B, V] (or of every position [B, T, V] when
  `all_logits`) and the filled cache. chunk_tokens: see `lalte_jax.inference.chunking`.
  """
  ctx = StepContext.for_prompt(valid_BT, chunk_tokens)
  h_BTD = model.embed(tokens_BT)
  h_BTD, layers = _run_groups(model, h_BTD, cache.layers, ctx, "prefill")
  logits = model.logits_from_hidden(h_BTD if all_logits else h_BTD[:, -1:])
  new_cache = cache.replace(layers=layers, pad_count_B=ctx.pad_count_B,
                            position=jnp.asarray(tokens_BT.shape[1], jnp.int32))
  return (logits if all_logits else logits[:, 0]), new_cache


def decode_impl(model, token_B: jax.Array, cache: ModelCache, groups: tuple | None = None
                ) -> tuple[jax.Array, ModelCache]:
  """One token per row at padded index `cache.position`; returns logits [B, V] and the cache.
  `groups`: `decode_groups(model)` when the caller split them already (outside its loop)."""
  ctx = StepContext.for_token(cache)
  h_B1D = model.embed(token_B[:, None])
  if groups is None:
    groups = decode_groups(model)
  h_B1D, layers = _run_groups(model, h_B1D, cache.layers, ctx, "decode", groups)
  logits_B1V = model.logits_from_hidden(h_B1D)
  return logits_B1V[:, 0], cache.replace(layers=layers, position=cache.position + 1)
