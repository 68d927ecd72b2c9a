"""Synthetic recall tasks made from (index, seed): MQAR (zoology format) and passkey (S-NIAH-1).

Both sources are Grain `RandomAccessDataSource`s (`__len__`, `__getitem__`): element `i` is a pure
function of `(seed, i)`, drawn from `np.random.default_rng(np.random.SeedSequence([seed, i]))`, so
any process can produce any element without generating the ones before it, and the trainer's
synthetic data and the evaluation tasks agree on every example.

Label convention (shared by every source in `lalte_jax.data`): labels are already shifted.
`labels[t]` is the token the model must predict from position `t` (the target of `logits[t]`), and
`IGNORE_LABEL` (-100) marks positions that are not scored. A prediction at `t` is right when
`argmax(logits[t]) == labels[t]`; `score_recall` computes that fraction.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

IGNORE_LABEL = -100
PAD_ID = 0  # pad / BOS in both tasks; never a key, value, digit or word


def example_rng(seed: int, index: int) -> np.random.Generator:
  """The generator of element `index`: independent streams per (seed, index) pair."""
  return np.random.default_rng(np.random.SeedSequence([seed, index]))


def _check_index(index, length: int) -> int:
  index = operator.index(index)
  if not 0 <= index < length:
    raise IndexError(f"index {index} out of range for a source of {length} examples")
  return index


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ValueError(message)


# ------------------------------------------------------------------------------------------------
# MQAR


@dataclasses.dataclass(frozen=True)
class MQARSource:
  """Multi-query associative recall in the zoology format (Arora et al.), optionally long-gap.

  Vocabulary: ids `[0, num_reserved_ids)` are reserved (0 = pad/BOS) and never drawn; keys come from
  `[num_reserved_ids, vocab_size // 2)`, values from `[vocab_size // 2, vocab_size)`.

  Layout of `tokens [seq_len]` (P = `num_kv_pairs`, F = `prefix_len`, 0 in zoology):
  - positions `0 .. F-1`: filler before the pairs (so that the first tokens of a sequence, e.g.
    LTE's attention sinks, hold no pair);
  - positions `F .. F+2P-1`: the key-value region `k_0 v_0 k_1 v_1 ... k_{P-1} v_{P-1}`, keys
    distinct, values distinct;
  - positions `F+2P ..`: the query region. It is cut into slots of two positions; each key is
    repeated once, at the start of a slot (`query_pos = F + 2P + 2 * slot`), in random order.
    Slots are drawn without replacement with zoology's power law, P(slot s) proportional to
    `(s + 1) ** (power_a - 1)`, so most queries come soon after the key-value region and a few far
    later. Every other position holds filler: random ids from `[num_reserved_ids, vocab_size)`
    (zoology's `random_non_queries`) or `PAD_ID` when `random_non_queries=False`.

  `labels [seq_len]` is `IGNORE_LABEL` except at each query position, where it is the value bound to
  the queried key: the model reads `k_i` at `query_pos` and must predict `v_i` as the next token
  (the token that actually follows is filler, as in zoology). Accuracy = fraction of query
  positions predicted exactly (`score_recall`).

  Long-gap variant (`min_gap > 0`): every query lies more than `min_gap` positions after both the
  key and the value it asks for (`query_pos - value_pos > min_gap`, value_pos = key_pos + 1). The
  power law then starts at the first slot that satisfies this for the last pair (hence for all).
  To put the whole pair outside a sliding window that holds `W` keys including the current one
  (SWA `window_size=W`), use `min_gap = W - 1`; for an LTE window `w` (w + 1 keys),
  `min_gap = w`.
  """
  num_examples: int
  seq_len: int
  vocab_size: int
  num_kv_pairs: int
  seed: int = 0
  power_a: float = 0.01
  min_gap: int = 0
  num_reserved_ids: int = 1
  random_non_queries: bool = True
  prefix_len: int = 0

  def __post_init__(self):
    for name in ("num_examples", "num_kv_pairs"):
      _require(getattr(self, name) > 0,
               f"MQARSource.{name} must be positive, got {getattr(self, name)}")
    _require(self.seed >= 0, f"MQARSource.seed must be >= 0, got {self.seed}")
    _require(0 < self.power_a <= 1, f"MQARSource.power_a must be in (0, 1], got {self.power_a}")
    _require(self.min_gap >= 0, f"MQARSource.min_gap must be >= 0, got {self.min_gap}")
    _require(self.prefix_len >= 0, f"MQARSource.prefix_len must be >= 0, got {self.prefix_len}")
    _require(self.num_reserved_ids >= 1,
             f"MQARSource.num_reserved_ids must be >= 1 (id 0 is pad), got {self.num_reserved_ids}")
    num_keys = self.vocab_size // 2 - self.num_reserved_ids
    num_values = self.vocab_size - self.vocab_size // 2
    _require(min(num_keys, num_values) >= self.num_kv_pairs,
             f"MQARSource.vocab_size={self.vocab_size} gives {num_keys} keys and {num_values}"
             f" values; num_kv_pairs={self.num_kv_pairs} distinct ones of each are needed")
    _require(len(self._candidate_slots) >= self.num_kv_pairs,
             f"MQARSource.seq_len={self.seq_len} leaves {len(self._candidate_slots)} query slots"
             f" (min_gap={self.min_gap}, prefix_len={self.prefix_len}) for"
             f" num_kv_pairs={self.num_kv_pairs} queries")

  @property
  def kv_region_len(self) -> int:
    return 2 * self.num_kv_pairs

  @property
  def query_start(self) -> int:
    """First position of the query region (`prefix_len + 2P`)."""
    return self.prefix_len + self.kv_region_len

  @property
  def _candidate_slots(self) -> np.ndarray:
    num_slots = max(self.seq_len - self.query_start, 0) // 2
    # A query in slot s (at F + 2P + 2s) is 2s + 1 after the nearest value, the last one (at
    # F + 2P - 1);
    # 2s + 1 > min_gap  <=>  s >= (min_gap + 1) // 2.
    first_slot = (self.min_gap + 1) // 2
    return np.arange(first_slot, max(num_slots, first_slot))

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    """Example `index`: {"tokens": int32 [seq_len], "labels": int32 [seq_len]}."""
    rng = example_rng(self.seed, _check_index(index, self.num_examples))
    num_pairs, first_value = self.num_kv_pairs, self.vocab_size // 2
    keys = self.num_reserved_ids + rng.choice(first_value - self.num_reserved_ids, num_pairs,
                                              replace=False)
    values = first_value + rng.choice(self.vocab_size - first_value, num_pairs, replace=False)

    candidates = self._candidate_slots
    weights = np.arange(1, len(candidates) + 1, dtype=np.float64) ** (self.power_a - 1)
    slots = rng.choice(candidates, num_pairs, replace=False, p=weights / weights.sum())
    query_positions = self.query_start + 2 * slots

    if self.random_non_queries:
      tokens = rng.integers(self.num_reserved_ids, self.vocab_size, self.seq_len)
    else:
      tokens = np.full(self.seq_len, PAD_ID)
    tokens[self.prefix_len:self.query_start:2] = keys
    tokens[self.prefix_len + 1:self.query_start:2] = values
    tokens[query_positions] = keys
    labels = np.full(self.seq_len, IGNORE_LABEL)
    labels[query_positions] = values
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}

  def roles(self, index) -> dict[str, np.ndarray]:
    """Where each part of example `index` lies: {"query": int [P] the query positions in order,
    "value": int [P] the position of the value each of them asks for, "filler": bool [seq_len]
    the positions that are neither in the key-value region nor a query}."""
    example = self[index]
    query_Q = np.flatnonzero(example["labels"] != IGNORE_LABEL)
    keys_P = example["tokens"][self.prefix_len:self.query_start:2]
    order_P = np.argsort(keys_P)  # keys are distinct: the pair of each queried key by search
    pair_Q = order_P[np.searchsorted(keys_P, example["tokens"][query_Q], sorter=order_P)]
    filler_T = np.ones(self.seq_len, bool)
    filler_T[self.prefix_len:self.query_start] = False
    filler_T[query_Q] = False
    return {"query": query_Q, "value": self.prefix_len + 2 * pair_Q + 1, "filler": filler_T}


# ------------------------------------------------------------------------------------------------
# Passkey / S-NIAH-1 over token ids

# Token ids of the passkey task; each stands for a fixed phrase of RULER's S-NIAH-1 template.
NEEDLE_ID = 1  # "One of the special magic numbers for"
QUERY_ID = 2  # "What is the special magic number for"
IS_ID = 3  # "is:" — ends the needle's key and the question (RULER's answer prefix)
FIRST_DIGIT_ID = 4  # ids 4..13 spell the digits 0..9
FIRST_WORD_ID = 14  # ids 14.. are words: haystack filler and key words
_HAYSTACK_ENTROPY = 0x5EED_4A7  # fixed: like RULER's repeated sentence, the haystack is one pattern


@dataclasses.dataclass(frozen=True)
class PasskeySource:
  """Single-needle retrieval (S-NIAH-1 style) spelled in token ids, for any vocabulary size.

  `tokens [seq_len]` = `[PAD_ID]` (as BOS) + haystack[:cut] + needle + haystack[cut:] + question +
  answer, where
  - haystack: one fixed pattern of `haystack_pattern_len` word ids repeated and truncated to fill
    the sequence (RULER S1 repeats one sentence); the pattern depends only on `vocab_size` and
    `haystack_pattern_len`, not on the seed;
  - needle: `NEEDLE_ID key IS_ID value` — `key` is `key_len` random word ids (RULER's
    adjective-noun key), `value` a `num_digits`-digit number with a non-zero leading digit
    (RULER: 7 digits), one digit id per digit;
  - the needle is inserted between two repetitions of the pattern, at a depth drawn from
    `num_depths` evenly spaced depths in [0, 1] (0 = right after BOS, 1 = after the last whole
    repetition);
  - question: `QUERY_ID key IS_ID` (the answer prefix), followed by the answer = the value's digits.

  `labels` is `IGNORE_LABEL` except on the positions that predict the answer: `labels[t] =
  tokens[t + 1]` for the `num_digits` positions from the final `IS_ID` to the answer's
  second-to-last digit. For generation, `prompt_and_answer` splits an example before the answer.
  """
  num_examples: int
  seq_len: int
  vocab_size: int
  seed: int = 0
  num_digits: int = 7
  key_len: int = 2
  haystack_pattern_len: int = 24
  num_depths: int = 40

  def __post_init__(self):
    _require(self.seed >= 0, f"PasskeySource.seed must be >= 0, got {self.seed}")
    _require(self.vocab_size > FIRST_WORD_ID,
             f"PasskeySource.vocab_size must exceed {FIRST_WORD_ID} (ids below are markers and"
             f" digits), got {self.vocab_size}")
    for name in ("num_examples", "num_digits", "key_len", "haystack_pattern_len", "num_depths"):
      _require(getattr(self, name) > 0,
               f"PasskeySource.{name} must be positive, got {getattr(self, name)}")
    _require(self.haystack_len >= self.haystack_pattern_len,
             f"PasskeySource.seq_len={self.seq_len} leaves {self.haystack_len} haystack tokens;"
             f" at least haystack_pattern_len={self.haystack_pattern_len} are needed")

  @property
  def haystack_len(self) -> int:
    needle_len = 2 + self.key_len + self.num_digits
    question_len = 2 + self.key_len
    return self.seq_len - 1 - needle_len - question_len - self.num_digits

  @property
  def answer_start(self) -> int:
    """Position of the answer's first digit; the prompt is `tokens[:answer_start]`."""
    return self.seq_len - self.num_digits

  def haystack_pattern(self) -> np.ndarray:
    rng = np.random.default_rng(_HAYSTACK_ENTROPY)
    return rng.integers(FIRST_WORD_ID, self.vocab_size, self.haystack_pattern_len)

  def __len__(self) -> int:
    return self.num_examples

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    """Example `index`: {"tokens": int32 [seq_len], "labels": int32 [seq_len]}."""
    rng = example_rng(self.seed, _check_index(index, self.num_examples))
    key = rng.integers(FIRST_WORD_ID, self.vocab_size, self.key_len)
    value = rng.integers(10 ** (self.num_digits - 1), 10 ** self.num_digits)
    digits = FIRST_DIGIT_ID + np.array([int(d) for d in str(value)])
    depth = np.linspace(0.0, 1.0, self.num_depths)[rng.integers(self.num_depths)]

    num_repeats = -(-self.haystack_len // self.haystack_pattern_len)
    haystack = np.tile(self.haystack_pattern(), num_repeats)[:self.haystack_len]
    # Cut between two repetitions (RULER inserts needles between sentences).
    num_whole_patterns = self.haystack_len // self.haystack_pattern_len
    cut = int(round(depth * num_whole_patterns)) * self.haystack_pattern_len
    needle = np.concatenate([[NEEDLE_ID], key, [IS_ID], digits])
    question = np.concatenate([[QUERY_ID], key, [IS_ID]])
    tokens = np.concatenate([[PAD_ID], haystack[:cut], needle, haystack[cut:], question, digits])

    labels = np.full(self.seq_len, IGNORE_LABEL)
    labels[self.answer_start - 1:-1] = tokens[self.answer_start:]
    return {"tokens": tokens.astype(np.int32), "labels": labels.astype(np.int32)}

  def prompt_and_answer(self, index) -> tuple[np.ndarray, np.ndarray]:
    """(prompt int32 [answer_start], answer int32 [num_digits]) of example `index`."""
    tokens = self[index]["tokens"]
    return tokens[:self.answer_start], tokens[self.answer_start:]


# ------------------------------------------------------------------------------------------------
# Scoring


def score_recall(logits_or_predictions, labels, *, per_example: bool = False):
  """Fraction of labelled positions predicted exactly.

  Args:
    logits_or_predictions: logits `[..., T, V]` (argmax taken) or predicted ids `[..., T]`, where
      entry `t` is the prediction for the token after position `t` (the label convention above).
    labels: int `[..., T]`, `IGNORE_LABEL` where not scored.
    per_example: return a float array over the leading axes (accuracy per sequence; NaN for a
      sequence without labels) instead of one float over all labelled positions.
  """
  predictions, labels = np.asarray(logits_or_predictions), np.asarray(labels)
  if predictions.ndim == labels.ndim + 1:
    predictions = predictions.argmax(axis=-1)
  if predictions.shape != labels.shape:
    raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} do not match"
                     " (logits need one extra trailing vocabulary axis)")
  scored = labels != IGNORE_LABEL
  correct = (predictions == labels) & scored
  if per_example:
    with np.errstate(invalid="ignore", divide="ignore"):
      return correct.sum(axis=-1) / scored.sum(axis=-1)
  if not scored.any():
    raise ValueError("labels hold no scored position (all are IGNORE_LABEL)")
  return float(correct.sum() / scored.sum())
