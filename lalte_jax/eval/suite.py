"""Runs a list of evaluation tasks on one model: the options, the task registry, the records.

Tasks with a target length (run once per `--lengths` entry):
- `mqar`, `mqar_long_gap`: synthetic recall on the model's ids, accuracy over query positions,
  teacher-forced from the prefill logits (`lalte_jax.eval.recall`);
- `passkey`: S-NIAH-1 spelled in the model's ids, greedy generation (`recall`);
- `sniah1`, `sniah2`, `sniah3`: RULER's S-NIAH with the tokenizer (`lalte_jax.eval.ruler`).
Tasks without one: `ppl` (held-out perplexity / bits per byte, `perplexity`) and the EVAPORATE
tasks `fda`, `swde`, `nq`, `squad`, `triviaqa`, `drop` (`evaporate`).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

from lalte_jax.data import tokenizer as tokenizers
from lalte_jax.data.pretokenized import read_metadata
from lalte_jax.data.synthetic import PasskeySource
from lalte_jax.eval import evaporate, perplexity, recall, ruler

LENGTH_TASKS = ("mqar", "mqar_long_gap", "passkey", "sniah1", "sniah2", "sniah3")
OTHER_TASKS = ("ppl",) + evaporate.TASKS
ALL_TASKS = LENGTH_TASKS + OTHER_TASKS


@dataclasses.dataclass(frozen=True)
class EvalOptions:
  tasks: tuple[str, ...]
  lengths: tuple[int, ...] = (1024, 2048, 4096)
  num_examples: int = 100
  batch_size: int = 8
  seed: int = recall.EVAL_SEED
  mqar_num_kv_pairs: int = 8
  mqar_min_gap: int | None = None  # None: from the model's windows (recall.long_gap_min_gap)
  sniah_max_new_tokens: int = 64
  haystack_dir: str | None = None
  data_dir: str | None = None
  ppl_sequences: int | None = 64
  evaporate_dir: str | None = None
  evaporate_context_length: int = 4096
  progress: bool = True

  def __post_init__(self):
    if not self.tasks:
      raise ValueError("tasks: name at least one task")
    unknown = [t for t in self.tasks if t not in ALL_TASKS]
    if unknown:
      raise ValueError(f"tasks: unknown {unknown}; choose from {list(ALL_TASKS)}")
    if any(t in LENGTH_TASKS for t in self.tasks) and not self.lengths:
      raise ValueError(f"lengths: tasks {[t for t in self.tasks if t in LENGTH_TASKS]} need at"
                       " least one length")
    for name in ("num_examples", "batch_size", "mqar_num_kv_pairs", "sniah_max_new_tokens",
                 "evaporate_context_length"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
    if any(n < 1 for n in self.lengths):
      raise ValueError(f"lengths: must be positive, got {list(self.lengths)}")
    if self.mqar_min_gap is not None and self.mqar_min_gap < 0:
      raise ValueError(f"mqar_min_gap: must be >= 0, got {self.mqar_min_gap}")
    if {"sniah2", "sniah3"} & set(self.tasks) and not self.haystack_dir:
      raise ValueError("haystack_dir: sniah2/sniah3 need a directory of essay .txt files")
    if "ppl" in self.tasks and not self.data_dir:
      raise ValueError("data_dir: ppl needs a held-out corpus written by lalte_jax/data/prepare.py")
    if set(evaporate.TASKS) & set(self.tasks) and not self.evaporate_dir:
      raise ValueError("evaporate_dir: EVAPORATE tasks read <dir>/<task>.jsonl")


def evaporate_path(options: EvalOptions, task: str) -> pathlib.Path:
  return pathlib.Path(options.evaporate_dir) / f"{task}.jsonl"


def check_inputs(options: EvalOptions) -> None:
  """Checks the files and directories the tasks will read, before any model runs: raises
  ValueError / FileNotFoundError naming the first one missing."""
  if {"sniah2", "sniah3"} & set(options.tasks):
    ruler.essay_files(options.haystack_dir)
  if "ppl" in options.tasks:
    read_metadata(options.data_dir)
  for task in set(evaporate.TASKS) & set(options.tasks):
    evaporate.require_file(evaporate_path(options, task))


def _progress_bar(enabled: bool, total: int, description: str):
  if not enabled:
    return None
  try:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return tqdm(total=total, desc=description, unit="ex", dynamic_ncols=True, leave=False)


def run_suite(model, options: EvalOptions, tokenizer=None) -> list[dict]:
  """One record per (task, length) (see `lalte_jax.eval.report`), in task then length order."""
  check_inputs(options)
  tokenizer = tokenizer if tokenizer is not None else tokenizers.load_tokenizer(None)
  vocab_size = model.config.vocab_size
  encode = functools.partial(tokenizers.encode_prompt, tokenizer, vocab_size=vocab_size)
  stop = tokenizers.stop_ids(tokenizer, vocab_size)
  essay_words = (ruler.load_essay_words(options.haystack_dir)
                 if {"sniah2", "sniah3"} & set(options.tasks) else None)
  records = []
  for task in options.tasks:
    for length in (options.lengths if task in LENGTH_TASKS else (None,)):
      description = task if length is None else f"{task} @{length}"
      bar = _progress_bar(options.progress, options.num_examples, description)
      try:
        record = _run_one(model, options, task, length, tokenizer, encode, stop, essay_words, bar)
      finally:
        if bar is not None:
          bar.close()
      records.append({"task": task, "length": length, **record})
  return records


def _run_one(model, options, task, length, tokenizer, encode, stop, essay_words, bar) -> dict:
  vocab_size = model.config.vocab_size
  common = dict(batch_size=options.batch_size, progress=bar)
  if task in ("mqar", "mqar_long_gap"):
    min_gap = 0
    if task == "mqar_long_gap":
      min_gap = (options.mqar_min_gap if options.mqar_min_gap is not None
                 else recall.long_gap_min_gap(model.config))
    source = recall.mqar_source(seq_len=length, vocab_size=vocab_size,
                                num_kv_pairs=options.mqar_num_kv_pairs,
                                num_examples=options.num_examples, min_gap=min_gap,
                                seed=options.seed)
    result = recall.evaluate_mqar(model, source, **common)
    return {"metric": "accuracy", "value": result.pop("accuracy"), "min_gap": min_gap, **result}
  if task == "passkey":
    source = PasskeySource(num_examples=options.num_examples, seq_len=length,
                           vocab_size=vocab_size, seed=options.seed)
    result = recall.evaluate_passkey(model, source, **common)
    return {"metric": "accuracy", "value": result.pop("accuracy"), **result}
  if task in ruler.TASKS:
    sniah = ruler.SNIAHTask(task, length, encode, essay_words=essay_words, seed=options.seed)
    result = ruler.evaluate_sniah(model, sniah, tokenizer.decode,
                                  num_examples=options.num_examples,
                                  max_new_tokens=options.sniah_max_new_tokens, stop_ids=stop,
                                  **common)
    return {"metric": "string_match_all", "value": result.pop("score"), **result}
  if task == "ppl":
    if bar is not None:
      bar.reset(total=options.ppl_sequences or 0)
    result = perplexity.evaluate_perplexity(model, options.data_dir, tokenizer,
                                            num_sequences=options.ppl_sequences, **common)
    return {"metric": "bits_per_byte", "value": result["bits_per_byte"], **result}
  documents = evaporate.load_documents(evaporate_path(options, task), limit=options.num_examples)
  if bar is not None:
    bar.reset(total=len(documents))
  result = evaporate.evaluate_evaporate(model, documents, encode, tokenizer.decode,
                                        context_length=options.evaporate_context_length,
                                        stop_ids=stop, **common)
  return {"metric": "contains", "value": result.pop("score"), **result}
