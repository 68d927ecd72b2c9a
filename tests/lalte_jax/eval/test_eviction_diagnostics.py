"""lalte_jax.eval.eviction_diagnostics: kept sets, availability and retention on a hand-made case,
agreement with the real LTE cache and the cached evaluation, and dCE/dscore."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lalte_jax import generate
from lalte_jax.data.synthetic import IGNORE_LABEL, MQARSource
from lalte_jax.eval import eviction_diagnostics as diagnostics
from tests.lalte_jax.eval.helpers import tiny_model

# One LTE layer, two KV heads, T = 12, window W = 4 keys, cap 3 with 1 sink: out-of-window
# candidates are positions 1..7. Pairs (key, value) at (1, 2) and (3, 4), queried at 9 and 11
# (beyond the window); fillers 0 and 5..8 and 10, of which 5, 6, 7 are candidates.
WINDOW, CAP, SINKS = 4, 3, 1
QUERY_NP = np.array([[9, 11], [9, 11]])
VALUE_NP = np.array([[2, 4], [2, 4]])
FILLER_T = np.isin(np.arange(12), [0, 5, 6, 7, 8, 10])


def _hand_made_scores() -> np.ndarray:
  score_TK = np.full((12, 2), -0.4)
  score_TK[:8, 0] = [-0.1, -0.2, 0.3, -0.1, 0.2, 0.4, 0.1, -0.3]
  score_TK[2, 1], score_TK[4, 1], score_TK[5, 1], score_TK[7, 1] = -0.1, 0.45, -0.2, 0.05
  # Sequence 2 keeps nothing but its sink.
  return np.stack([score_TK, np.full((12, 2), -0.5)])[None]  # [L=1, N=2, T, K]


def test_capped_kept_is_the_top_cap_of_the_out_of_window_scores_with_sinks_first():
  kept = diagnostics.capped_kept(_hand_made_scores(), window_keys=WINDOW, cap=CAP,
                                 num_sinks=SINKS)
  assert kept.shape == (1, 2, 12, 2)
  # Head 0: the sink, 0.4 at 5, 0.3 at 2 (0.2 at 4 does not fit); head 1: the sink, 0.45 at 4,
  # 0.05 at 7; sequence 2: the sinks only. Nothing at or after T - W = 8.
  assert [list(np.flatnonzero(kept[0, 0, :, h])) for h in (0, 1)] == [[0, 2, 5], [0, 4, 7]]
  assert [list(np.flatnonzero(kept[0, 1, :, h])) for h in (0, 1)] == [[0], [0]]


def test_kept_set_statistics_on_a_hand_made_case():
  score = _hand_made_scores()
  kept = diagnostics.capped_kept(score, window_keys=WINDOW, cap=CAP, num_sinks=SINKS)
  stats = diagnostics.kept_set_statistics(
      score, kept, QUERY_NP, VALUE_NP, np.stack([FILLER_T, FILLER_T]), window_keys=WINDOW,
      cap=CAP, num_sinks=SINKS)
  approx = lambda x: pytest.approx(x, rel=1e-9)
  # Capped: value 2 in head 0 and value 4 in head 1 (sequence 1): 2 of 4 queries, 1 of 4 per head.
  assert stats["availability_capped"] == approx(50.0)
  assert stats["availability_capped_head"] == [[approx(25.0), approx(25.0)]]
  # Uncapped (score > 0): head 0 keeps both values of sequence 1, head 1 value 4.
  assert stats["availability_uncapped"] == approx(50.0)
  assert stats["availability_uncapped_head"] == [[approx(50.0), approx(25.0)]]
  assert stats["value_retention"] == [[approx(2 / 4), approx(1 / 4)]]
  assert stats["value_retention_capped"] == [[approx(1 / 4), approx(1 / 4)]]
  # Filler candidates 5, 6, 7 in both sequences: head 0 keeps 5, 6 uncapped (5 capped), head 1
  # keeps 7 (capped too).
  assert stats["filler_retention"] == [[approx(2 / 6), approx(1 / 6)]]
  assert stats["filler_retention_capped"] == [[approx(1 / 6), approx(1 / 6)]]
  # Successors 3 and 5 (the second pair's key, a filler): head 0 keeps 5, capped too; head 1
  # neither. Query 9 (value 2) is seen through head 0's kept value; query 11 (value 4) through
  # head 1's kept value and head 0's kept successor; sequence 2's through nothing.
  assert stats["successor_retention"] == [[approx(1 / 4), approx(0.0)]]
  assert stats["successor_retention_capped"] == [[approx(1 / 4), approx(0.0)]]
  assert stats["availability_with_successor_capped"] == approx(50.0)
  assert stats["availability_with_successor_uncapped"] == approx(50.0)
  # Kept out-of-window candidates per sequence: head 0 keeps 2, 4, 5, 6 and head 1 keeps 4, 7 in
  # sequence 1, nothing in sequence 2.
  assert stats["kept_count_mean"] == [[2.0, 1.0]] and stats["kept_count_max"] == [[4, 2]]
  assert (stats["free_slots"], stats["num_candidates"]) == (CAP - SINKS, 7)
  # Without head 1's value 4, query 11 is seen through head 0's kept successor 5 alone.
  score[0, 0, 4, 1] = -0.4
  kept = diagnostics.capped_kept(score, window_keys=WINDOW, cap=CAP, num_sinks=SINKS)
  stats = diagnostics.kept_set_statistics(
      score, kept, QUERY_NP, VALUE_NP, np.stack([FILLER_T, FILLER_T]), window_keys=WINDOW,
      cap=CAP, num_sinks=SINKS)
  assert stats["availability_capped"] == approx(25.0)
  assert stats["availability_with_successor_capped"] == approx(50.0)


@pytest.mark.slow
def test_diagnostics_match_the_forward_pass_the_cached_evaluation_and_the_cache():
  # At this init the scores spread over (-0.15, 0.34) and the cut between kept and dropped
  # tokens lies >= 3e-4 from the nearest score: far above the rounding differences between the
  # forward pass and the prefill.
  model = tiny_model("lalte", init_std=0.05)
  lte = model.config.lte
  source = MQARSource(num_examples=3, seq_len=96, vocab_size=256, num_kv_pairs=6, min_gap=25,
                      prefix_len=4, seed=1)
  result = diagnostics.mqar_diagnostics(model, source, batch_size=3)
  tokens = np.stack([source[i]["tokens"] for i in range(3)])
  labels = np.stack([source[i]["labels"] for i in range(3)])
  scored = labels != IGNORE_LABEL
  logits, aux = model(tokens, return_aux=True)
  uncapped = 100 * (np.asarray(jnp.argmax(logits, -1)) == labels)[scored].mean()
  assert result["uncapped_accuracy"] == pytest.approx(uncapped)
  assert 0 <= result["capped_accuracy"] <= 100
  # The kept set of the first LTE layer is the one the cache holds after a prefill: its count is
  # past_len and its scores, in position order, are the cache's out-of-window scores. (Deeper LTE
  # layers read the output of a capped layer at inference, so their scores differ.)
  kept = diagnostics.capped_kept(np.asarray(aux.lte_scores), window_keys=lte.window_keys,
                                 cap=lte.cap, num_sinks=lte.num_sinks)
  cache = generate.init_cache(model, 3, max_length=96)
  _, cache = generate.prefill(model, tokens, cache)
  lte_cache = cache.layers[model.config.layer_pattern.index("lte")]
  past_len = np.asarray(lte_cache.past_len)[0]  # [B, K] of the first group
  np.testing.assert_array_equal(kept[0].sum(axis=1), past_len)
  oow_score = np.asarray(lte_cache.score)[0, :, lte.window_keys:]
  marked = np.where(np.arange(96)[:, None] < lte.num_sinks, np.inf, np.asarray(aux.lte_scores)[0])
  for b, h in np.ndindex(past_len.shape):
    np.testing.assert_allclose(oow_score[b, :past_len[b, h], h], marked[b][kept[0, b, :, h], h],
                               rtol=1e-5, atol=1e-6)
  assert 0 <= result["availability_capped"] <= result["availability_uncapped"] <= 100
  assert len(result["value_retention"]) == model.config.num_lte_layers


def _probe_batch():
  """A tiny laLTE model and two MQAR sequences of 64 tokens: (model, source, tokens, labels)."""
  model = tiny_model("lalte")
  source = MQARSource(num_examples=2, seq_len=64, vocab_size=256, num_kv_pairs=4, seed=2)
  tokens = np.stack([source[i]["tokens"] for i in range(2)])
  labels = np.stack([source[i]["labels"] for i in range(2)])
  return model, source, tokens, labels


@pytest.mark.slow
def test_score_gradients_sum_to_the_router_bias_gradient():
  model, source, tokens, labels = _probe_batch()
  grad = diagnostics.score_gradients(model, tokens, labels)  # [L_lte, B, T, K]
  _, score = diagnostics.uncapped_forward(model, tokens)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    logits = nnx.merge(graphdef, params, rest)(jnp.asarray(tokens))
    scored = labels != IGNORE_LABEL
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(scored, labels, 0))
    return jnp.sum(jnp.where(scored, losses, 0.0)) / scored.sum()

  bias = nnx.to_pure_dict(jax.grad(loss)(params))["groups"]["blocks"][1]["mixer"]["router"][
      "proj_bias"]  # [G, K]; one LTE layer per group
  # score = sigmoid(x) - 0.5 and x = ... + bias: dL/dbias = sum_{b,t} dL/dscore * s (1 - s).
  sigmoid = score + 0.5
  np.testing.assert_allclose((grad * sigmoid * (1 - sigmoid)).sum(axis=(1, 2)), bias,
                             rtol=1e-4, atol=1e-7)
  assert np.abs(grad).max() > 0
  summary = diagnostics.gradient_summary(model, source, range(2))
  assert np.asarray(summary["dscore_value"]).shape == (2, 2)  # [L_lte, Hkv]
  # The successors' mean: each queried value's next position, out-of-window candidates only.
  lte = model.config.lte
  candidate = np.zeros(tokens.shape, bool)
  candidate[:, lte.num_sinks:tokens.shape[1] - lte.window_keys] = True
  successor = np.zeros(tokens.shape, bool)
  for row in range(2):
    successor[row, source.roles(row)["value"] + 1] = True
  successor &= candidate
  assert successor.any()
  expected = (grad * successor[None, :, :, None]).sum(axis=(1, 2)) / successor.sum()
  np.testing.assert_allclose(summary["dscore_successor"], expected, rtol=1e-5, atol=1e-12)
  np.testing.assert_allclose(summary["retained_successor"],
                             ((score > 0) & successor[None, :, :, None]).sum(axis=(1, 2))
                             / successor.sum())


def test_a_held_scale_norm_has_the_forward_of_rmsnorm_and_no_gradient_through_the_scale():
  from lalte_jax.layers.norms import RMSNorm
  norm = RMSNorm(6, eps=1e-6)
  norm.weight[...] = jnp.linspace(0.5, 1.5, 6)
  held = diagnostics._HeldScaleNorm(norm)
  x = jax.random.normal(jax.random.key(0), (3, 6))
  np.testing.assert_allclose(held(x), norm(x), rtol=1e-6)
  # A common scale of x leaves RMSNorm unchanged, so its derivative along x is 0; with the
  # scale held it is the output itself. (Reverse mode: RMSNorm has a custom backward.)
  along_x = lambda f: jnp.vdot(jax.grad(lambda y: jnp.sum(f(y) * f(x)))(x), x)
  np.testing.assert_allclose(along_x(norm), 0.0, atol=1e-4)
  np.testing.assert_allclose(along_x(held), jnp.sum(norm(x) ** 2), rtol=1e-5)


@pytest.mark.slow
def test_gradient_summary_holds_the_norms_scale_without_changing_the_model():
  model, source, tokens, labels = _probe_batch()
  plain = diagnostics.score_gradients(model, tokens, labels)
  held = diagnostics.score_gradients(model, tokens, labels, held_norm_scale=True)
  assert held.shape == plain.shape and np.isfinite(held).all()
  assert not np.allclose(held, plain)  # the scale's path through the norms is gone
  np.testing.assert_array_equal(diagnostics.score_gradients(model, tokens, labels), plain)
  summary = diagnostics.gradient_summary(model, source, range(2))
  assert np.asarray(summary["dscore_value_held_norm"]).shape == (2, 2)  # [L_lte, Hkv]
