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

`RecallMixture` interleaves sources of one sequence length into one training source, and
`StagedCurriculum` plays sources one after another in example order: the reproduction study's
curriculum (short-gap MQAR first, then short- and long-gap MQAR plus passkey).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

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
                min_gap: int = 0, seed: int = EVAL_SEED) -> MQARSource:
  return MQARSource(num_examples=num_examples, seq_len=seq_len, vocab_size=vocab_size,
                    num_kv_pairs=num_kv_pairs, min_gap=min_gap, seed=seed)


def evaluate_mqar(model, source: MQARSource, *, batch_size: int = 16, progress=None) -> dict:
  """{"accuracy": % of query positions predicted exactly, "num_queries", "num_examples"}."""
  if source.vocab_size != model.config.vocab_size:
    raise ValueError(f"source: vocab_size {source.vocab_size} differs from the model's"
                     f" {model.config.vocab_size} (MQAR uses the model's ids directly)")
  examples = [source[i] for i in range(len(source))]
  tokens = np.stack([e["tokens"] for e in examples])
  labels = np.stack([e["labels"] for e in examples])
  predictions = decoding.teacher_forced_predictions(model, tokens, batch_size=batch_size,
                                                    progress=progress)
  num_queries = int((labels != IGNORE_LABEL).sum())
  return {"accuracy": 100.0 * score_recall(predictions, labels), "num_queries": num_queries,
          "num_examples": len(source), "scoring": "teacher-forced prefill logits"}


def evaluate_passkey(model, source: PasskeySource, *, batch_size: int = 16,
                     progress=None) -> dict:
  """{"accuracy": % of examples whose generated value is exact, "num_examples"}."""
  if source.vocab_size != model.config.vocab_size:
    raise ValueError(f"source: vocab_size {source.vocab_size} differs from the model's"
                     f" {model.config.vocab_size}")
  pairs = [source.prompt_and_answer(i) for i in range(len(source))]
  completions = decoding.greedy_generate(model, [prompt for prompt, _ in pairs],
                                         source.num_digits, batch_size=batch_size,
                                         progress=progress)
  correct = [list(answer) == completion[:len(answer)]
             for (_, answer), completion in zip(pairs, completions)]
  return {"accuracy": 100.0 * float(np.mean(correct)), "num_examples": len(source),
          "scoring": "greedy generation, all digits exact"}


@dataclasses.dataclass(frozen=True)
class RecallMixture:
  """Element i is element i // n of source i % n (n sources, round robin): equal shares of every
  task in every batch-sized stretch. All sources must share `seq_len` and `vocab_size`."""
  sources: tuple
  num_examples: int

  def __post_init__(self):
    if not self.sources:
      raise ValueError("RecallMixture.sources: needs at least one source")
    lengths = {s.seq_len for s in self.sources}
    vocabs = {s.vocab_size for s in self.sources}
    if len(lengths) != 1 or len(vocabs) != 1:
      raise ValueError(f"RecallMixture.sources: seq_len {sorted(lengths)} / vocab_size"
                       f" {sorted(vocabs)} must be the same for every source")
    for source in self.sources:
      if len(source) < -(-self.num_examples // len(self.sources)):
        raise ValueError(f"RecallMixture.num_examples={self.num_examples}: {source!r} holds only"
                         f" {len(source)} examples")

  @property
  def seq_len(self) -> int:
    return self.sources[0].seq_len

  @property
  def vocab_size(self) -> int:
    return self.sources[0].vocab_size

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    index = operator.index(index)
    if not 0 <= index < self.num_examples:
      raise IndexError(f"index {index} out of range for a mixture of {self.num_examples}")
    count = len(self.sources)
    return self.sources[index % count][index // count]


@dataclasses.dataclass(frozen=True)
class StagedCurriculum:
  """Element i comes from the first stage whose cumulative example count exceeds i: stage s holds
  `stage_examples[s]` examples, the last stage the rest up to `num_examples`. Read it in order
  (`make_dataset(..., shuffle=False)`): every element is already a fresh random example, so order
  is the schedule. Stages index their sources from 0 (stage s's element j is `stages[s][j]`)."""
  stages: tuple
  stage_examples: tuple[int, ...]
  num_examples: int

  def __post_init__(self):
    if len(self.stages) != len(self.stage_examples) + 1:
      raise ValueError(f"StagedCurriculum.stage_examples: {len(self.stage_examples)} counts for"
                       f" {len(self.stages)} stages; give one count per stage but the last")
    if any(n <= 0 for n in self.stage_examples) or sum(self.stage_examples) >= self.num_examples:
      raise ValueError(f"StagedCurriculum.stage_examples {self.stage_examples}: each must be"
                       f" positive and together fewer than num_examples={self.num_examples}")
    if len({(s.seq_len, s.vocab_size) for s in self.stages}) != 1:
      raise ValueError("StagedCurriculum.stages: every stage needs the same seq_len and vocab_size")
    bounds = self.stage_examples + (self.num_examples - sum(self.stage_examples),)
    for stage, count in zip(self.stages, bounds):
      if len(stage) < count:
        raise ValueError(f"StagedCurriculum: {stage!r} holds {len(stage)} < {count} examples")

  @property
  def seq_len(self) -> int:
    return self.stages[0].seq_len

  @property
  def vocab_size(self) -> int:
    return self.stages[0].vocab_size

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    index = operator.index(index)
    if not 0 <= index < self.num_examples:
      raise IndexError(f"index {index} out of range for a curriculum of {self.num_examples}")
    for stage, count in zip(self.stages, self.stage_examples):
      if index < count:
        return stage[index]
      index -= count
    return self.stages[-1][index]


def recall_curriculum(*, seq_len: int, vocab_size: int, num_kv_pairs: int, long_gap: int,
                      num_examples: int, seed: int,
                      tasks: Sequence[str] = ("mqar", "mqar_long_gap", "passkey"),
                      warmup_examples: int = 0) -> RecallMixture | StagedCurriculum:
  """The reproduction study's training data: short-gap MQAR (zoology power law), long-gap MQAR
  (`min_gap=long_gap`) and passkey, one third each by default; with `warmup_examples` > 0 the
  first that many examples are short-gap MQAR only (associative recall first, then gaps beyond
  the windows), read in order (see `StagedCurriculum`)."""
  builders = {
      "mqar": lambda s: mqar_source(seq_len=seq_len, vocab_size=vocab_size,
                                    num_kv_pairs=num_kv_pairs, num_examples=num_examples, seed=s),
      "mqar_long_gap": lambda s: mqar_source(
          seq_len=seq_len, vocab_size=vocab_size, num_kv_pairs=num_kv_pairs,
          num_examples=num_examples, min_gap=long_gap, seed=s),
      "passkey": lambda s: PasskeySource(num_examples=num_examples, seq_len=seq_len,
                                         vocab_size=vocab_size, seed=s),
  }
  unknown = [t for t in tasks if t not in builders]
  if unknown or not tasks:
    raise ValueError(f"tasks: {list(tasks)} must be a non-empty subset of {sorted(builders)}")
  # Each task draws from its own seed so that tasks never share example streams.
  mixture = RecallMixture(tuple(builders[t](seed * 16 + i) for i, t in enumerate(tasks)),
                          num_examples)
  if warmup_examples <= 0:
    return mixture
  warmup = builders["mqar"](seed * 16 + len(builders))  # a stream of its own
  return StagedCurriculum((warmup, mixture), (warmup_examples,), num_examples)
