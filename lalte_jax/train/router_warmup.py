"""Router warm-up (the reference's `routing_freeze_steps`, 0 in the paper's runs).

With `TrainConfig.lte_routing_freeze_steps = N`, during the first N optimizer steps:
- every LTE layer keeps every token, so its training mask is plain causal attention. The forward
  pass sees each router's output bias replaced by `ROUTER_OFF_LOGIT`: every logit is then so
  large that sigmoid(logit) rounds to 1 in float32 and every score is +0.5 (kept, §4.2). The
  derivative of the sigmoid there, s (1 - s), is exactly 0, so the straight-through gradient
  dL/dscore (§4.3) reaches neither the router's weights nor, through the router's input, the key
  and value projections: the router learns nothing while attention learns to use every token;
- the router's parameters are not updated at all (weight decay included);
- the sparsity controller stays at its initial state (lambda 0, EMA = seq_len, §4.6); from step
  N + 1 on it runs as in a fresh run, its step k - N playing the role of k.
The same override evaluates a model with its router off (`keep_every_token(params, True)`).

With `TrainConfig.lte_routing_freeze_learns` the router learns during those N steps instead:
the model is called with a reveal probability of 1 (every token visible to every query, the
scores untouched), so each token's score receives the straight-through gradient of all its
reads, the long-range ones included, and the router and its inputs are updated with the rest of
the model; the controller is held as above, so no sparsity loss acts. Why: a frozen router
starts routing at step N + 1 with the scores of its initialisation applied to keys and values
trained for N steps, and in the capacity study (docs/results.md, "Results at 48,000 steps")
that evicted nearly every token of one KV head within 50 steps, in every run; tokens evicted
then never came back, because an evicted token is read only inside the window.

With `lte_routing_freeze_anneal` as well, the reveal probability falls linearly from 1 at step 1
to 1/N at step N (`reveal_probability` below): each token the router
evicts is visible with that probability, drawn anew per step, row, token and KV head, so a
queried value with a low score still has long-range reads (and their gradient) now and then,
while the model learns to depend on the router's selection step by step. Why: in the study,
at the abrupt switch of the learning warm-up the loss jumped from 0.005 to 9.3 within 50 steps,
the gradient of a head whose output is noise drives its scores down, and two of three runs
never recovered. (The gradual switch did worse: docs/results.md.)

With `lte_router_frozen_after_warmup` instead, the routers learn during the warm-up as above
and get no update after it (`hold_routers` from step N + 1 on, weight decay included), and no
gradient passes through the scores (`RoutingControls.score_gradient`), so neither the routers
nor, through them, the key and value projections learn from the routing: the model trains on
the selection function the warm-up learned (its scores still move with the keys and values that
attention trains). Why: at the end of the
learning warm-up the routers kept 94-99% of the queried values and few fillers in most heads,
and the collapse came after the switch, from the routers' own updates; this separates the two.

With `lte_router_sparsity_only_after_warmup` the routers keep learning after a learning
warm-up, but the task loss's straight-through gradient no longer reaches the scores
(`RoutingControls.task_gradient`); the sparsity loss's does, so the controller still pulls each
head's kept count down to the cap, and the tokens with the lowest scores go first. Why: frozen
routers kept their selection through the switch, but with the keys and values they score still
training, their kept counts grew to 1.3-3x the cap by the end of the run, and the capped cache
then evicted queried values (docs/results.md). Measured, it does not: with the task gradient cut,
the sparsity loss is the routers' only gradient, Adam scales its update to the learning rate
however small lambda is, and the scores fall until a head keeps almost nothing (docs/results.md).

With `lte_router_threshold_rate` r > 0 as well as `lte_router_frozen_after_warmup`, the frozen
routers' output biases are the one thing that moves after the warm-up: after every step each
changes by -r ln(c / b) (`threshold_shift`; c: that step's retention count of the layer and KV
head, b: the cap), outside the optimizer. A bias adds the same amount to every logit of its head,
so the order in which the router ranks tokens stays as the warm-up learned it, and only the cut
moves: the count settles at the cap, and the tokens ranked lowest are the ones dropped. Why: the
frozen routers kept their selection but not their count (see above); the sparsity loss could not
hold the count without destroying the selection; a threshold set from the count needs no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lalte_jax.mixers.lte import RoutingControls

# Added to nothing, replacing the router's output bias: far beyond where sigmoid saturates in
# float32 (|x| > ~17), and exactly representable in bfloat16 (the logits are computed in the
# model's dtype).
ROUTER_OFF_LOGIT = 8192.0
ROUTER_MODULE = "router"
ROUTER_OUTPUT_BIAS = "proj_bias"


def path_names(path) -> tuple:
  """The keys of a pytree path (dict keys, attribute names, sequence indices)."""
  return tuple(getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
               for key in path)


def is_router_parameter(path) -> bool:
  """Whether the leaf at `path` (of an nnx pure-dict parameter tree) belongs to an LTE router."""
  return ROUTER_MODULE in path_names(path)


def is_router_bias(path) -> bool:
  """Whether the leaf at `path` is an LTE router's output bias (one logit offset per KV head)."""
  names = path_names(path)
  return ROUTER_MODULE in names and names[-1] == ROUTER_OUTPUT_BIAS


def keep_every_token(params: dict, active: jax.Array | bool) -> dict:
  """`params` with every LTE router's output bias replaced by ROUTER_OFF_LOGIT where `active`
  (a traced or Python bool): the model then keeps every token and passes no gradient to its
  routers. Other leaves are returned as they are."""
  def override(path, leaf):
    if is_router_bias(path):
      return jnp.where(active, jnp.asarray(ROUTER_OFF_LOGIT, leaf.dtype), leaf)
    return leaf
  return jax.tree_util.tree_map_with_path(override, params)


def hold_routers(new_tree, old_tree, active: jax.Array | bool):
  """`new_tree` with the router leaves of `old_tree` where `active`: the routers stay frozen.
  Works for the parameters and for any tree of their structure (optimizer moments)."""
  def select(path, new, old):
    return jnp.where(active, old, new) if is_router_parameter(path) else new
  return jax.tree_util.tree_map_with_path(select, new_tree, old_tree)


def threshold_shift(count_LH: jax.Array, cap: int, rate: float) -> jax.Array:
  """The change of each LTE router's output bias after a step whose retention count per LTE
  layer and KV head was `count_LH` [L_lte, Hkv]: -rate ln(c / cap), float32. Proportional in
  log space, so the count approaches the cap geometrically from either side; a count below one
  token counts as half a token, so that an empty head raises its threshold by a bounded step."""
  count_LH = jnp.maximum(count_LH.astype(jnp.float32), 0.5)
  return -jnp.float32(rate) * jnp.log(count_LH / jnp.float32(cap))


def shift_router_bias(params: dict, shift_LH: jax.Array, active: jax.Array | bool) -> dict:
  """`params` with `shift_LH` [L_lte, Hkv] (LTE layers in depth order) added to the routers'
  output biases where `active`. The biases are stacked per layer group ([G, Hkv] each); depth
  order runs over the groups, then over the LTE blocks of a group in block order."""
  blocks = sorted({_block_index(path) for path in _router_bias_paths(params)})
  groups = shift_LH.shape[0] // max(len(blocks), 1)
  shift_GJH = shift_LH.reshape(groups, len(blocks), shift_LH.shape[-1])

  def add(path, leaf):
    if is_router_bias(path):
      shift_GH = shift_GJH[:, blocks.index(_block_index(path))].reshape(leaf.shape)
      return jnp.where(active, leaf + shift_GH.astype(leaf.dtype), leaf)
    return leaf
  return jax.tree_util.tree_map_with_path(add, params)


def _router_bias_paths(params: dict) -> list:
  return [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
          if is_router_bias(path)]


def _block_index(path) -> int:
  """The index of the block within its layer group that holds the leaf at `path`."""
  names = path_names(path)
  return names[names.index("blocks") + 1]


def reveal_probability(step: jax.Array, freeze_steps: int, anneal: bool) -> jax.Array:
  """The reveal probability at optimizer step `step` (0-based) of a learning warm-up of
  `freeze_steps` steps: during it 1, or with `anneal` 1 - step / freeze_steps; after it 0 (the
  router's selection alone)."""
  if not freeze_steps:
    return jnp.float32(0.0)
  during = (1.0 - step.astype(jnp.float32) / freeze_steps) if anneal else jnp.float32(1.0)
  return jnp.where(step < freeze_steps, during, jnp.float32(0.0))


def routing_controls(step: jax.Array, config) -> RoutingControls | None:
  """The model's `RoutingControls` at optimizer step `step` (0-based) of a run of `config` (a
  TrainConfig): None (routing as §4) unless the run has a learning warm-up; then the reveal
  probability above; after the warm-up, with `lte_router_frozen_after_warmup` no gradient
  through the scores, with `lte_router_sparsity_only_after_warmup` none of the task loss's."""
  freeze_steps = config.lte_routing_freeze_steps
  if not (freeze_steps and config.lte_routing_freeze_learns):
    return None
  during = step < freeze_steps
  return RoutingControls(
      reveal_probability=reveal_probability(step, freeze_steps, config.lte_routing_freeze_anneal),
      score_gradient=during if config.lte_router_frozen_after_warmup else True,
      task_gradient=during if config.lte_router_sparsity_only_after_warmup else True)
