"""EVAPORATE-style recall tasks (§9.3): FDA, SWDE, NQ, SQuAD, TriviaQA, DROP.

The reference (Arora et al., "Just read twice": the `based_*` tasks of HazyResearch's lm-eval
fork) gives each document as `{"text": prompt, "value": gold answer}`: the model continues the
prompt greedily until a newline (at most 48 tokens) and scores 1 when any gold answer occurs in
the continuation, case-insensitively ("contains"). The task score is the mean x100.

Here the documents are read from local JSONL files `<dir>/<task>.jsonl`, one such object per line
("value" may also be a list of gold answers); `export_hf_dataset` writes them from the reference's
HF datasets when those are reachable (`hazyresearch/based-fda`, `-swde`, `-squad`, ...). Nothing
else here touches the network.

Truncation (§9.3, the paper's reading): only prompts longer than `context_length` tokens are cut,
to a window of `context_length - answer_length` tokens placed around the first occurrence of the
answer (half of the window before it); a prompt whose answer does not occur keeps its last tokens.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Callable, Sequence

TASKS = ("fda", "swde", "nq", "squad", "triviaqa", "drop")
STOP_STRING = "\n"
MAX_NEW_TOKENS = 48


@dataclasses.dataclass(frozen=True)
class Document:
  text: str
  answers: tuple[str, ...]


def contains_score(prediction: str, answers: Sequence[str]) -> int:
  """1 when any answer occurs in `prediction` (case-insensitive, literal), else 0."""
  return int(any(re.search(re.escape(answer), prediction, re.IGNORECASE) for answer in answers))


def cut_at_stop(text: str, stops: Sequence[str] = (STOP_STRING,)) -> str:
  """`text` up to the first of `stops` (the reference's `until`)."""
  end = min([text.find(s) for s in stops if s and s in text], default=len(text))
  return text[:end]


def require_file(path: str | pathlib.Path) -> pathlib.Path:
  """`path` as a Path; ValueError naming it if it is not a file."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"evaporate: {path} does not exist (expected a JSONL file with \"text\" and"
                     " \"value\" per line)")
  return path


def load_documents(path: str | pathlib.Path, limit: int | None = None) -> list[Document]:
  """Documents of a JSONL file with "text" and "value" (a string or a list of strings)."""
  path = require_file(path)
  documents = []
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      text, value = record["text"], record["value"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
      raise ValueError(f"evaporate: {path}:{number} is not a {{\"text\", \"value\"}} JSON object"
                       f" ({error})") from error
    answers = (value,) if isinstance(value, str) else tuple(str(v) for v in value)
    if not isinstance(text, str) or not answers or not all(answers):
      raise ValueError(f"evaporate: {path}:{number} needs a string text and non-empty answers")
    documents.append(Document(text=text, answers=answers))
    if limit is not None and len(documents) >= limit:
      break
  if not documents:
    raise ValueError(f"evaporate: {path} holds no document")
  return documents


def truncate_around_answer(ids: Sequence[int], answer_start: int | None, *, context_length: int,
                           answer_length: int) -> list[int]:
  """`ids` if they fit `context_length`; else a window of `context_length - answer_length` ids
  with half of it before token `answer_start` (the last ids when the answer is absent)."""
  ids = list(ids)
  if len(ids) <= context_length:
    return ids
  window = context_length - answer_length
  if window <= 0:
    raise ValueError(f"context_length {context_length} must exceed answer_length {answer_length}")
  if answer_start is None:
    return ids[-window:]
  start = min(max(0, answer_start - window // 2), len(ids) - window)
  return ids[start:start + window]


def build_prompt(document: Document, encode: Callable[[str], list[int]], *, context_length: int,
                 answer_length: int = MAX_NEW_TOKENS) -> list[int]:
  """Prompt ids of a document after the truncation of the module docstring. `encode` returns the
  ids as the model receives them (BOS included if any)."""
  ids = encode(document.text)
  if len(ids) <= context_length:
    return ids
  lowered = document.text.lower()
  positions = [lowered.find(a.lower()) for a in document.answers if a.lower() in lowered]
  answer_start = None
  if positions:
    # Token index of the answer: the length of the encoded text before it.
    answer_start = len(encode(document.text[:min(positions)]))
  return truncate_around_answer(ids, answer_start, context_length=context_length,
                                answer_length=answer_length)


def evaluate_evaporate(model, documents: Sequence[Document], encode: Callable[[str], list[int]],
                       decode: Callable[[Sequence[int]], str], *, context_length: int = 4096,
                       max_new_tokens: int = MAX_NEW_TOKENS, stop_ids: Sequence[int] = (),
                       batch_size: int = 8, progress=None) -> dict:
  """Greedy continuations of `documents`, cut at the first newline, scored by contains."""
  from lalte_jax.eval import decoding  # pylint: disable=import-outside-toplevel
  prompts = [build_prompt(d, encode, context_length=context_length, answer_length=max_new_tokens)
             for d in documents]
  completions = decoding.greedy_generate(model, prompts, max_new_tokens, stop_ids=stop_ids,
                                         batch_size=batch_size, progress=progress)
  predictions = [cut_at_stop(decode(ids)) for ids in completions]
  scores = [contains_score(p, d.answers) for p, d in zip(predictions, documents)]
  return {"score": 100.0 * sum(scores) / len(scores), "num_examples": len(documents),
          "scoring": "contains (case-insensitive), greedy until newline",
          "samples": [{"prediction": p, "answers": list(d.answers)}
                      for p, d in list(zip(predictions, documents))[:3]]}


# The reference's datasets (HF hub) whose names we know; pass any other name explicitly.
KNOWN_HF_DATASETS = {"fda": "hazyresearch/based-fda", "swde": "hazyresearch/based-swde",
                     "squad": "hazyresearch/based-squad"}


def export_hf_dataset(dataset_name: str, out_path: str | pathlib.Path, *,
                      split: str = "validation", limit: int | None = None) -> int:
  """Writes the "text"/"value" columns of a HF dataset split as JSONL (needs the `datasets`
  package and access to the hub or a local cache); returns the number of documents written."""
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ValueError("evaporate: exporting a HF dataset needs the `datasets` package (pip"
                     " install datasets)") from error
  rows = datasets.load_dataset(dataset_name, split=split)
  out_path = pathlib.Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  count = 0
  with open(out_path, "w", encoding="utf-8") as out:
    for row in rows:
      if limit is not None and count >= limit:
        break
      out.write(json.dumps({"text": row["text"], "value": row["value"]}) + "\n")
      count += 1
  return count
