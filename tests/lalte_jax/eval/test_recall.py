"""Synthetic recall evaluations: determinism, the long-gap property against each model's window,
teacher-forced MQAR through the cached prefill."""

import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.config import get_model_config
from lalte_jax.data.synthetic import IGNORE_LABEL, PasskeySource
from lalte_jax.eval import decoding, recall
from tests.lalte_jax.eval.helpers import tiny_model


def test_mqar_examples_are_deterministic_in_the_seed():
  make = lambda seed: recall.mqar_source(seq_len=128, vocab_size=256, num_kv_pairs=8,
                                         num_examples=4, min_gap=40, seed=seed)
  first, again, other = make(7), make(7), make(8)
  for i in range(4):
    np.testing.assert_array_equal(first[i]["tokens"], again[i]["tokens"])
  assert any((first[i]["tokens"] != other[i]["tokens"]).any() for i in range(4))


@pytest.mark.parametrize("variant,window_keys", [("gdn_swa", 48), ("lalte", 25), ("lansa", 32)])
def test_long_gap_puts_every_queried_pair_outside_the_window(variant, window_keys):
  config = get_model_config(f"{variant}-tiny")
  gap = recall.long_gap_min_gap(config)
  source = recall.mqar_source(seq_len=256, vocab_size=256, num_kv_pairs=8, num_examples=20,
                              min_gap=gap)
  for i in range(len(source)):
    tokens, labels = source[i]["tokens"], source[i]["labels"]
    for query in np.flatnonzero(labels != IGNORE_LABEL):
      key_position = int(np.flatnonzero(tokens[:16] == tokens[query])[0])
      # The window of the query holds keys query - window_keys + 1 .. query: neither the key nor
      # its value (key_position + 1) is in it.
      assert query - (key_position + 1) >= window_keys


def test_long_gap_needs_an_explicit_gap_without_windows():
  with pytest.raises(ValueError, match="no windowed layer"):
    recall.long_gap_min_gap(get_model_config("gdn-tiny"))


@pytest.mark.slow
def test_teacher_forced_predictions_match_the_forward_pass():
  model = tiny_model("gdn_swa")
  source = recall.mqar_source(seq_len=96, vocab_size=256, num_kv_pairs=4, num_examples=3)
  tokens = np.stack([source[i]["tokens"] for i in range(3)])
  predictions = decoding.teacher_forced_predictions(model, tokens, batch_size=2)
  np.testing.assert_array_equal(predictions, np.asarray(jnp.argmax(model(tokens), axis=-1)))
  result = recall.evaluate_mqar(model, source, batch_size=2)
  labels = np.stack([source[i]["labels"] for i in range(3)])
  scored = labels != IGNORE_LABEL
  assert result["num_queries"] == scored.sum() == 12
  assert result["accuracy"] == pytest.approx(100 * (predictions == labels)[scored].mean())


@pytest.mark.slow
def test_passkey_scores_exact_generated_values():
  model = tiny_model("gdn")
  source = PasskeySource(num_examples=2, seq_len=64, vocab_size=256, num_digits=3)
  result = recall.evaluate_passkey(model, source, batch_size=2)
  prompts = [source.prompt_and_answer(i) for i in range(2)]
  completions = decoding.greedy_generate(model, [p for p, _ in prompts], 3)
  expected = np.mean([list(a) == c for (_, a), c in zip(prompts, completions)])
  assert result["accuracy"] == pytest.approx(100 * expected)
