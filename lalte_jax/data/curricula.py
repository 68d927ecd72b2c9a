"""Training curricula: several synthetic sources of one length played as one source, by name.

- `RecallMixture` interleaves sources round robin (equal shares of every task in every stretch);
- `StagedCurriculum` plays sources one after another in example order;
- `CURRICULA` names the mixtures a `TrainConfig` selects with `data="curriculum:<name>"`; each
  reads the task's shape (`TaskShape`: length, vocabulary, pairs P, long gap, filler prefix) from
  the config and gives a training source and a held-out evaluation source:
  - "recall": short-gap MQAR, long-gap MQAR and passkey, a third each (P pairs);
  - "capacity": short-gap MQAR with ceil(P/3) pairs, short-gap MQAR with P pairs and long-gap MQAR
    with P pairs, a third each: associative recall at a smaller load, the full load with mostly
    nearby queries, and the full load with every query beyond the windows.
  Both evaluate on long-gap MQAR with P pairs, the task the curricula train for.

Every element is already a fresh random example (a pure function of its seed and index), so a
mixture may be shuffled or not; a `StagedCurriculum` must be read in order (`read_in_order`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from lalte_jax.data.synthetic import MQARSource, PasskeySource

CURRICULUM_PREFIX = "curriculum:"


@dataclasses.dataclass(frozen=True)
class RecallMixture:
  """Element i is element i // n of source i % n (n sources, round robin): equal shares of every
  task in every batch-sized stretch. All sources must share `seq_len` and `vocab_size`."""
  sources: tuple
  num_examples: int
  read_in_order: ClassVar[bool] = False

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
  (`make_dataset(..., shuffle=False)`): order is the schedule. Stages index their sources from 0
  (stage s's element j is `stages[s][j]`)."""
  stages: tuple
  stage_examples: tuple[int, ...]
  num_examples: int
  read_in_order: ClassVar[bool] = True

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
                      warmup_examples: int = 0,
                      prefix_len: int = 0) -> RecallMixture | StagedCurriculum:
  """Short-gap MQAR (zoology power law), long-gap MQAR (`min_gap=long_gap`) and passkey, one
  third each by default; with `warmup_examples` > 0 the first that many examples are short-gap
  MQAR only (associative recall first, then gaps beyond the windows), read in order."""
  def mqar(s, min_gap=0):
    return MQARSource(num_examples=num_examples, seq_len=seq_len, vocab_size=vocab_size,
                      num_kv_pairs=num_kv_pairs, min_gap=min_gap, prefix_len=prefix_len, seed=s)

  builders = {
      "mqar": mqar,
      "mqar_long_gap": lambda s: mqar(s, long_gap),
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


# ------------------------------------------------------------------------------------------------
# Named curricula


@dataclasses.dataclass(frozen=True)
class TaskShape:
  """What a named curriculum reads from the training config."""
  seq_len: int
  vocab_size: int
  num_kv_pairs: int  # P
  min_gap: int  # the long gap: every long-gap query lies more than this after its pair
  prefix_len: int = 0  # filler tokens before the key-value region


def _long_gap_mqar(shape: TaskShape, seed: int, num_examples: int) -> MQARSource:
  return MQARSource(num_examples=num_examples, seq_len=shape.seq_len,
                    vocab_size=shape.vocab_size, num_kv_pairs=shape.num_kv_pairs,
                    min_gap=shape.min_gap, prefix_len=shape.prefix_len, seed=seed)


def _recall_train(shape: TaskShape, seed: int, num_examples: int) -> RecallMixture:
  return recall_curriculum(seq_len=shape.seq_len, vocab_size=shape.vocab_size,
                           num_kv_pairs=shape.num_kv_pairs, long_gap=shape.min_gap,
                           num_examples=num_examples, seed=seed, prefix_len=shape.prefix_len)


def _capacity_train(shape: TaskShape, seed: int, num_examples: int) -> RecallMixture:
  def mqar(index, num_kv_pairs, min_gap):
    return MQARSource(num_examples=num_examples, seq_len=shape.seq_len,
                      vocab_size=shape.vocab_size, num_kv_pairs=num_kv_pairs, min_gap=min_gap,
                      prefix_len=shape.prefix_len, seed=seed * 16 + index)

  small = -(-shape.num_kv_pairs // 3)
  return RecallMixture((mqar(0, small, 0), mqar(1, shape.num_kv_pairs, 0),
                        mqar(2, shape.num_kv_pairs, shape.min_gap)), num_examples)


@dataclasses.dataclass(frozen=True)
class Curriculum:
  """A named curriculum: `train(shape, seed, num_examples)` and `eval(...)` build its sources."""
  train: Callable[[TaskShape, int, int], object]
  eval: Callable[[TaskShape, int, int], object]


CURRICULA = {
    "recall": Curriculum(train=_recall_train, eval=_long_gap_mqar),
    "capacity": Curriculum(train=_capacity_train, eval=_long_gap_mqar),
}


def curriculum_name(data: str) -> str | None:
  """The curriculum name of a `data` setting "curriculum:<name>" (None for other settings).
  Raises ValueError naming the valid names when <name> is not one of them."""
  if not data.startswith(CURRICULUM_PREFIX):
    return None
  name = data[len(CURRICULUM_PREFIX):]
  if name not in CURRICULA:
    raise ValueError(f"{data!r}: unknown curriculum {name!r}; known:"
                     f" {', '.join(CURRICULUM_PREFIX + n for n in sorted(CURRICULA))}")
  return name


def curriculum_source(name: str, shape: TaskShape, *, split: str, seed: int, num_examples: int):
  """The "train" or "eval" source of the curriculum `name` (one of CURRICULA)."""
  if name not in CURRICULA:
    raise ValueError(f"curriculum: unknown {name!r}; known: {sorted(CURRICULA)}")
  if split not in ("train", "eval"):
    raise ValueError(f"split: expected 'train' or 'eval', got {split!r}")
  build = CURRICULA[name].train if split == "train" else CURRICULA[name].eval
  return build(shape, seed, num_examples)
