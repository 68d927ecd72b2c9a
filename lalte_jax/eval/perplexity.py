"""Held-out perplexity and bits per byte on a corpus written by lalte_jax/data/prepare.py.

The sequences are those of the corpus's validation split when it has one (`lalte-prepare-data
--val-fraction`), else all of it (a corpus prepared from held-out text). Every next token of each
packed sequence is scored (labels[t] = tokens[t+1], the pretraining
objective), through the cached prefill path like every evaluation here. Bits per byte = total NLL
in bits / UTF-8 bytes of the scored tokens, the bytes being those of `tokenizer.decode` of each
scored token run (special tokens such as BOS decode to nothing but their NLL still counts), so the
number compares models with different tokenizers on the same text.
"""

from __future__ import annotations

import math

from lalte_jax.data.pretokenized import PretokenizedSource, read_metadata
from lalte_jax.eval import decoding


def evaluate_perplexity(model, data_dir, tokenizer, *, num_sequences: int | None = None,
                        batch_size: int = 8, progress=None) -> dict:
  """{"perplexity", "bits_per_byte", "nll_per_token", "num_tokens", "num_bytes", "split"} over
  the first `num_sequences` held-out sequences of `data_dir` (all when None; module doc)."""
  split = "validation" if "validation" in read_metadata(data_dir) else "train"
  source = PretokenizedSource(data_dir, split=split)
  if source.vocab_size > model.config.vocab_size:
    raise ValueError(f"data_dir: {data_dir} was tokenized with {source.vocab_size} ids, more than"
                     f" the model's vocabulary of {model.config.vocab_size}")
  count = len(source) if num_sequences is None else min(num_sequences, len(source))
  if count == 0:
    raise ValueError(f"data_dir: {data_dir} holds no sequence")
  sequences = [source[i]["tokens"] for i in range(count)]
  results = decoding.token_logprobs(model, sequences, batch_size=batch_size, progress=progress)
  nll = -sum(float(logp.sum()) for logp, _ in results)
  num_tokens = sum(len(logp) for logp, _ in results)
  num_bytes = sum(len(tokenizer.decode(s[1:]).encode("utf-8")) for s in sequences)
  return {**nll_metrics(nll, num_tokens, num_bytes), "num_tokens": num_tokens,
          "num_bytes": num_bytes, "num_sequences": count, "split": split}


def nll_metrics(nll: float, num_tokens: float, num_bytes: float | None) -> dict:
  """{"nll_per_token", "perplexity", "bits_per_byte"} of a summed negative log-likelihood `nll`
  (nats) over `num_tokens` scored tokens spelling `num_bytes` UTF-8 bytes (bits per byte NaN
  when the bytes are unknown or zero). The trainer's held-out evaluation uses it too."""
  bits_per_byte = nll / math.log(2) / num_bytes if num_bytes else float("nan")
  return {"nll_per_token": nll / num_tokens, "perplexity": math.exp(nll / num_tokens),
          "bits_per_byte": bits_per_byte}
