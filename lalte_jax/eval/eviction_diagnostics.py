"""What an LTE model keeps on MQAR, and whether what it keeps explains what it recalls.

`mqar_diagnostics(model, source)` scores a model on an `MQARSource` twice and, for models with
LTE layers, measures the kept sets behind both scores:
- capped accuracy: the cached inference path (`recall.evaluate_mqar`), where each
  LTE layer keeps at most `cap` out-of-window tokens per KV head, chosen at the end of the input
  (§5.2, G24); uncapped accuracy: the training-time forward (no cap, no dropout);
- availability (%): the share of queries whose value token is visible to the query through the
  LTE layer, i.e. within its window or kept, in at least one KV head (mean over LTE layers);
  "capped" under the cache's kept set, "uncapped" under the training mask (score > 0 or sink);
  also per (layer, head);
- retention (fraction of out-of-window candidates, positions j < T - W that are not sinks): of the
  queried value tokens and of the filler tokens (neither a pair nor a query), uncapped (score > 0)
  and capped (in the cache's kept set);
- kept count per sequence (out-of-window candidates with score > 0) per (layer, head): its mean
  and maximum over the sequences, against the cap's free slots (cap - sinks);
- the same availability and retention for each queried value's successor (the token right after
  it: the next pair's key, or the first token after the pairs). The GDN layer below the LTE layer
  mixes each token into the next ones through its short convolution, so the successor's key and
  value can carry the pair, and a model may recall through it; "availability with successor"
  counts a query whose value or successor is visible.
`score_gradients` gives dCE/dscore at every (LTE layer, token, KV head): the straight-through
signal the router learns from (§4.3); `gradient_summary` averages it over the queried values,
their successors and the fillers, and also over the values with the residual stream's RMSNorms
holding their scale (`hold_norm_scale`: no gradient through their root mean square). Why: the
signal <dCE/dv, v> is the loss's response to scaling a value up, and a norm undoes a common
scale, so where one block's output dominates the residual stream the heads' signals can cancel
(docs/results.md); holding the scale shows what the signal would be without that.
`router_off_model` returns a model whose LTE layers keep every token.

The capped kept set is computed from the router's scores of the training-time forward with the
cache's own compaction op (`pallas_kernels.lte_cache_ops.compact_top_scores`, as
`lalte_jax.inference.lte_cache` prefills), since the cache stores keys and values but not their
positions. For the first LTE layer of a model this is the cache's kept set; a deeper LTE layer
reads, at inference, the output of capped layers below it, so its scores there (and possibly its
kept set) differ from the forward's: its capped numbers are those of its uncapped inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lalte_jax.data.synthetic import IGNORE_LABEL, MQARSource
from lalte_jax.eval import recall
from lalte_jax.layers.norms import inverse_rms
from lalte_jax.train import router_warmup
from pallas_kernels.lte_cache_ops import compact_top_scores


def router_off_model(model):
  """A copy of `model` whose LTE layers keep every token (its router's bias overridden)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = router_warmup.keep_every_token(nnx.to_pure_dict(params), True)
  nnx.replace_by_pure_dict(params, pure)
  return nnx.merge(graphdef, params, rest)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT):
  logits_BTV, aux = nnx.merge(graphdef, state)(tokens_BT, return_aux=True)
  return jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32), aux.lte_scores


def uncapped_forward(model, tokens_BT) -> tuple[np.ndarray, np.ndarray | None]:
  """(argmax predictions int32 [B, T], LTE scores float32 [L_lte, B, T, Hkv] or None) of the
  training-time forward pass without dropout."""
  graphdef, state = nnx.split(model)
  predictions, scores = _forward(graphdef, state, jnp.asarray(tokens_BT, jnp.int32))
  return np.asarray(predictions), None if scores is None else np.asarray(scores)


def capped_kept(score_LBTK: np.ndarray, *, window_keys: int, cap: int,
                num_sinks: int) -> np.ndarray:
  """bool [L, B, T, K]: the out-of-window tokens an LTE cache keeps after a prefill of the whole
  (unpadded) sequence: the top-`cap` of the positions older than the window by score, kept if
  > 0, the first `num_sinks` positions counting as +inf (§5.2)."""
  score_LBTK = np.array(score_LBTK, np.float32)
  num_layers, batch, length, heads = score_LBTK.shape
  num_candidates = length - min(length, window_keys)
  if num_candidates == 0:
    return np.zeros(score_LBTK.shape, bool)
  score_LBTK[:, :, :num_sinks] = np.inf
  empty_BTK1 = jnp.zeros((batch, length, heads, 1), jnp.float32)
  return np.stack([np.asarray(compact_top_scores(empty_BTK1, empty_BTK1, jnp.asarray(score),
                                                 num_candidates=num_candidates, cap=cap)[-1])
                   for score in score_LBTK]).reshape(num_layers, batch, length, heads)


def _candidates(length: int, window_keys: int, num_sinks: int) -> np.ndarray:
  """bool [T]: the out-of-window candidates of the kept set (j < T - W), sinks excluded."""
  position_T = np.arange(length)
  return (position_T < length - window_keys) & (position_T >= num_sinks)


def _roles(source: MQARSource, indices) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(query int [N, P], value int [N, P], filler bool [N, T]) of the examples `indices`."""
  roles = [source.roles(i) for i in indices]
  return (np.stack([r["query"] for r in roles]), np.stack([r["value"] for r in roles]),
          np.stack([r["filler"] for r in roles]))


def _marked(shape: tuple, position_NP: np.ndarray) -> np.ndarray:
  """bool [N, T] of `shape`, True at each row's positions `position_NP` [N, P]."""
  marked_NT = np.zeros(shape, bool)
  marked_NT[np.arange(len(position_NP))[:, None], position_NP] = True
  return marked_NT


def kept_set_statistics(score_LNTK: np.ndarray, kept_capped_LNTK: np.ndarray,
                        query_NP: np.ndarray, value_NP: np.ndarray, filler_NT: np.ndarray, *,
                        window_keys: int, cap: int, num_sinks: int) -> dict:
  """The availability, retention and kept-count numbers of the module doc (lists per [L, K])."""
  length = score_LNTK.shape[2]
  sink_T = np.arange(length) < num_sinks
  kept_uncapped_LNTK = (score_LNTK > 0) | sink_T[None, None, :, None]
  candidate_T = _candidates(length, window_keys, num_sinks)
  rows_N1 = np.arange(len(value_NP))[:, None]
  successor_NP = value_NP + 1

  def visible(kept_LNTK, position_NP):  # [L, N, P, K]: seen by the query through head k
    in_window_NP = query_NP - position_NP < window_keys
    return in_window_NP[None, :, :, None] | kept_LNTK[:, rows_N1, position_NP]

  def retention(kept_LNTK, mask_NT):  # [L, K]: kept share of the masked candidates
    mask_NT = mask_NT & candidate_T[None]
    return (kept_LNTK & mask_NT[None, :, :, None]).sum((1, 2)) / max(int(mask_NT.sum()), 1)

  value_NT = _marked(filler_NT.shape, value_NP)
  successor_NT = _marked(filler_NT.shape, successor_NP)
  count_LNK = ((score_LNTK > 0) & candidate_T[None, None, :, None]).sum(2)
  result = {"window_keys": window_keys, "cap": cap, "free_slots": cap - num_sinks,
            "num_candidates": int(candidate_T.sum())}
  for name, kept in (("capped", kept_capped_LNTK), ("uncapped", kept_uncapped_LNTK)):
    avail_LNPK = visible(kept, value_NP)
    result[f"availability_{name}"] = 100.0 * float(avail_LNPK.any(-1).mean())
    result[f"availability_{name}_head"] = (100.0 * avail_LNPK.mean((1, 2))).tolist()
    either_LNPK = avail_LNPK | visible(kept, successor_NP)
    result[f"availability_with_successor_{name}"] = 100.0 * float(either_LNPK.any(-1).mean())
    suffix = "" if name == "uncapped" else "_capped"
    result[f"value_retention{suffix}"] = retention(kept, value_NT).tolist()
    result[f"successor_retention{suffix}"] = retention(kept, successor_NT).tolist()
    result[f"filler_retention{suffix}"] = retention(kept, filler_NT).tolist()
  result["kept_count_mean"] = count_LNK.mean(1).tolist()
  result["kept_count_max"] = count_LNK.max(1).tolist()
  return result


def mqar_diagnostics(model, source: MQARSource, *, batch_size: int = 16,
                     capped: bool = True) -> dict:
  """Capped / uncapped accuracy (%) on every example of `source` and, for models with LTE layers,
  `kept_set_statistics` (see the module doc). `capped=False` skips the cached path (its
  accuracy is then absent), e.g. for a model whose router is off."""
  recall.check_vocabulary(model, source)
  tokens_NT, labels_NT = recall.stacked_examples(source)
  scored_NT = labels_NT != IGNORE_LABEL
  predictions, scores = [], []
  for start in range(0, len(tokens_NT), batch_size):
    rows = tokens_NT[start:start + batch_size]
    prediction_BT, score = uncapped_forward(model, rows)
    predictions.append(prediction_BT)
    scores.append(score)
  uncapped_NT = np.concatenate(predictions)
  result = {"num_examples": len(source), "num_queries": int(scored_NT.sum()),
            "uncapped_accuracy": 100.0 * float((uncapped_NT == labels_NT)[scored_NT].mean())}
  if capped:
    result["capped_accuracy"] = recall.evaluate_mqar(model, source,
                                                     batch_size=batch_size)["accuracy"]
  lte = model.config.lte
  if scores[0] is None:
    return result
  score_LNTK = np.concatenate(scores, axis=1)
  kept_LNTK = capped_kept(score_LNTK, window_keys=lte.window_keys, cap=lte.cap,
                          num_sinks=lte.num_sinks)
  query_NP, value_NP, filler_NT = _roles(source, range(len(source)))
  result.update(kept_set_statistics(score_LNTK, kept_LNTK, query_NP, value_NP, filler_NT,
                                    window_keys=lte.window_keys, cap=lte.cap,
                                    num_sinks=lte.num_sinks))
  return result


# ------------------------------------------------------------------------------------------------
# dCE/dscore


class _ScoreProbe(nnx.Variable):
  """A zero added to a router's output: its gradient is the gradient of the score."""


class _ProbedRouter(nnx.Module):
  """An LTE router whose scores carry `probe` (zeros) [B, T, Hkv], so that d loss/d probe is
  d loss/d score; the forward pass is unchanged."""

  def __init__(self, router, probe):
    self.router = router
    self.probe = _ScoreProbe(probe)

  def __call__(self, k_BTKD, v_BTKD, *, mask_BT=None, dropout_key=None):
    return self.router(k_BTKD, v_BTKD, mask_BT=mask_BT, dropout_key=dropout_key) + self.probe[...]


class _HeldScaleNorm(nnx.Module):
  """An RMSNorm whose forward is unchanged and whose backward treats 1 / rms(x) as a constant."""

  def __init__(self, norm):
    self.norm = norm

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    held_BT1 = jax.lax.stop_gradient(inverse_rms(x32, self.norm.eps))
    return (x32 * held_BT1 * self.norm.weight[...]).astype(x.dtype)


def hold_norm_scale(model):
  """`model` (modified in place) with its residual stream's RMSNorms (each block's two and the
  final one) replaced by `_HeldScaleNorm`s: the same outputs, no gradient through the scale."""
  for block in model.groups.blocks:
    block.mixer_norm = _HeldScaleNorm(block.mixer_norm)
    block.mlp_norm = _HeldScaleNorm(block.mlp_norm)
  model.final_norm = _HeldScaleNorm(model.final_norm)
  return model


@functools.partial(jax.jit, static_argnums=(0, 4))
def _score_gradients(graphdef, state, tokens_BT, labels_BT, held_norm_scale=False):
  model = nnx.merge(graphdef, state)
  if held_norm_scale:
    model = hold_norm_scale(model)
  batch, length = tokens_BT.shape
  heads = model.config.lte.num_kv_heads
  for block in model.groups.blocks:
    if block.mixer_kind == "lte":  # stacked over the groups, as the block's own parameters
      block.mixer.router = _ProbedRouter(block.mixer.router,
                                         jnp.zeros((model.num_groups, batch, length, heads)))
  probed_graphdef, probes, rest = nnx.split(model, _ScoreProbe, ...)

  def loss(probes):
    logits_BTV = nnx.merge(probed_graphdef, probes, rest)(tokens_BT)
    scored_BT = labels_BT != IGNORE_LABEL
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(
        logits_BTV.astype(jnp.float32), jnp.where(scored_BT, labels_BT, 0))
    return jnp.sum(jnp.where(scored_BT, losses_BT, 0.0)) / jnp.maximum(jnp.sum(scored_BT), 1)

  gradients = nnx.merge(probed_graphdef, jax.grad(loss)(probes), rest)
  # [G, B, T, K] per LTE block of a group -> depth order [L_lte, B, T, K] (group-major).
  per_block = jnp.stack([block.mixer.router.probe[...] for block in gradients.groups.blocks
                         if block.mixer_kind == "lte"], axis=1)
  return per_block.reshape(-1, batch, length, per_block.shape[-1])


def score_gradients(model, tokens_BT, labels_BT, *, held_norm_scale: bool = False
                    ) -> np.ndarray:
  """dCE/dscore float32 [L_lte, B, T, Hkv] of the mean cross-entropy over the labelled positions
  (no dropout, no sparsity loss) with respect to every LTE router score; with `held_norm_scale`,
  of the model as `hold_norm_scale` changes it."""
  if model.config.num_lte_layers == 0:
    raise ValueError(f"model {model.config.name!r} has no LTE layer")
  graphdef, state = nnx.split(model)
  return np.asarray(_score_gradients(graphdef, state, jnp.asarray(tokens_BT, jnp.int32),
                                     jnp.asarray(labels_BT, jnp.int32), held_norm_scale))


def gradient_summary(model, source: MQARSource, indices) -> dict:
  """Mean dCE/dscore per (LTE layer, KV head) over the queried value tokens, their successors
  and the filler tokens (out-of-window candidates only) of the examples `indices` of `source`,
  with the retention (score > 0) of each; and over the values with the norms' scale held
  (`dscore_value_held_norm`)."""
  tokens_NT, labels_NT = recall.stacked_examples(source, indices)
  grad_LNTK = score_gradients(model, tokens_NT, labels_NT)
  held_LNTK = score_gradients(model, tokens_NT, labels_NT, held_norm_scale=True)
  _, score_LNTK = uncapped_forward(model, tokens_NT)
  _, value_NP, filler_NT = _roles(source, indices)
  lte = model.config.lte
  candidate_T = _candidates(tokens_NT.shape[1], lte.window_keys, lte.num_sinks)
  value_NT = _marked(filler_NT.shape, value_NP) & candidate_T[None]
  successor_NT = _marked(filler_NT.shape, value_NP + 1) & candidate_T[None]
  filler_NT = filler_NT & candidate_T[None]

  def mean(x_LNTK, mask_NT):
    return (x_LNTK * mask_NT[None, :, :, None]).sum((1, 2)) / max(int(mask_NT.sum()), 1)

  return {"dscore_value": mean(grad_LNTK, value_NT).tolist(),
          "dscore_successor": mean(grad_LNTK, successor_NT).tolist(),
          "dscore_filler": mean(grad_LNTK, filler_NT).tolist(),
          "dscore_value_held_norm": mean(held_LNTK, value_NT).tolist(),
          "retained_value": mean(score_LNTK > 0, value_NT).tolist(),
          "retained_successor": mean(score_LNTK > 0, successor_NT).tolist(),
          "retained_filler": mean(score_LNTK > 0, filler_NT).tolist(),
          "num_sequences": len(indices)}
