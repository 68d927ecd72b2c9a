"""Synthetic recall evaluations on the model's own vocabulary: MQAR, long-gap MQAR, passkey.

The examples come from the trainer's sources (`lalte_jax.data.synthetic`), deterministic in
(seed, index), so evaluation and training data are drawn by the same code (evaluation uses its own
seed, `EVAL_SEED`, distinct from the trainer's train / eval seeds 42 / 43 by default).

- MQAR (zoology format): accuracy over query positions, computed teacher-forced: one prefill over
  the whole sequence with logits at every position (the cached inference path, LTE cap enforced),
  argmax at each query compared with its value. A query's prediction never depends on the tokens
  after it, so this equals feeding each query as a prompt.
- long-gap MQAR: every queried key-value pair lies outside the attention window of its query
  (`long_gap_min_gap` derives the gap from the model's windows).
- passkey (S-NIAH-1 spelled in token ids, `PasskeySource`): greedy generation of the
  `num_digits`-token value after the question; an example counts when all digits are right (the
  token analogue of RULER's string_match_all with a one-value gold list).

The training mixtures of these tasks are in `lalte_jax.data.curricula`.
"""

from __future__ import annotations

import numpy as np

from lalte_jax.config import ModelConfig
from lalte_jax.data.synthetic import IGNORE_LABEL, MQARSource, PasskeySource, score_recall
from lalte_jax.eval import decoding

EVAL_SEED = 1234


def long_gap_min_gap(config: ModelConfig) -> int:
  """The smallest MQAR `min_gap` that puts every queried key and value outside every window of
  `config`: SWA / NSA windows of W keys (current included) give W - 1, an LTE window w (w + 1
  keys) gives w. Raises ValueError for models without a windowed layer (GDN, full attention),
  where the gap must be given explicitly."""
  gaps = []
  for kind in set(config.layer_pattern):
    if kind == "attention" and config.attention.window_size is not None:
      gaps.append(config.attention.window_size - 1)
    elif kind == "lte":
      gaps.append(config.lte.window)
    elif kind == "nsa":
      gaps.append(config.nsa.window_size - 1)
  if not gaps:
    raise ValueError(f"mqar_min_gap: model {config.name!r} has no windowed layer to derive the"
                     " long gap from; give the gap explicitly (e.g. the window of the models it"
                     " is compared with)")
  return max(gaps)


def mqar_source(*, seq_len: int, vocab_size: int, num_kv_pairs: int, num_examples: int,
                min_gap: int = 0, seed: int = EVAL_SEED, prefix_len: int = 0) -> MQARSource:
  return MQARSource(num_examples=num_examples, seq_len=seq_len, vocab_size=vocab_size,
                    num_kv_pairs=num_kv_pairs, min_gap=min_gap, seed=seed, prefix_len=prefix_len)


def check_vocabulary(model, source) -> None:
  """Raises ValueError when `source` draws ids for another vocabulary than the model's (the
  tasks use the model's ids directly)."""
  if source.vocab_size != model.config.vocab_size:
    raise ValueError(f"source: vocab_size {source.vocab_size} differs from the model's"
                     f" {model.config.vocab_size} (the task uses the model's ids directly)")


def stacked_examples(source, indices=None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [N, T], labels int32 [N, T]) of the examples `indices` (default: all)."""
  examples = [source[i] for i in (range(len(source)) if indices is None else indices)]
  return np.stack([e["tokens"] for e in examples]), np.stack([e["labels"] for e in examples])


def evaluate_mqar(model, source: MQARSource, *, batch_size: int = 16, progress=None) -> dict:
  """{"accuracy": % of query positions predicted exactly, "num_queries", "num_examples"}."""
  check_vocabulary(model, source)
  tokens, labels = stacked_examples(source)
  predictions = decoding.teacher_forced_predictions(model, tokens, batch_size=batch_size,
                                                    progress=progress)
  num_queries = int((labels != IGNORE_LABEL).sum())
  return {"accuracy": 100.0 * score_recall(predictions, labels), "num_queries": num_queries,
          "num_examples": len(source), "scoring": "teacher-forced prefill logits"}


def evaluate_passkey(model, source: PasskeySource, *, batch_size: int = 16,
                     progress=None) -> dict:
  """{"accuracy": % of examples whose generated value is exact, "num_examples"}."""
  check_vocabulary(model, source)
  pairs = [source.prompt_and_answer(i) for i in range(len(source))]
  completions = decoding.greedy_generate(model, [prompt for prompt, _ in pairs],
                                         source.num_digits, batch_size=batch_size,
                                         progress=progress)
  correct = [list(answer) == completion[:len(answer)]
             for (_, answer), completion in zip(pairs, completions)]
  return {"accuracy": 100.0 * float(np.mean(correct)), "num_examples": len(source),
          "scoring": "greedy generation, all digits exact"}
