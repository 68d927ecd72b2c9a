"""Shared fixtures of the evaluation tests: tiny float32 models and a tiny HF tokenizer."""

from __future__ import annotations

import functools

from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.model import HybridLM

# Our own sentences (no third-party essay text is committed), enough for a few hundred tokens.
ESSAY_TEXT = (
    "Good tools disappear when they work. Nobody admires a hammer while building a shed! "
    "Yet the best workshops are full of odd jigs that someone made for one job. Why keep them? "
    "Because the second job always comes. A notebook of small measurements beats memory. "
    "Rivers carve valleys slowly, and most of the work happens during rare floods. "
    "Teams resemble rivers in this way. Quiet weeks build habits, loud weeks test them. "
    "The map is not the territory, but a good map saves a long walk. ") * 6


@functools.lru_cache(maxsize=None)
def tiny_model(variant: str, init_std: float = 0.2, vocab_size: int | None = None) -> HybridLM:
  """A float32 tiny model; init_std 0.2 makes argmax outputs vary from token to token."""
  config = get_model_config(f"{variant}-tiny").replace(init_std=init_std, dtype="float32")
  if vocab_size is not None:
    config = config.replace(vocab_size=vocab_size)
  return HybridLM(config, rngs=nnx.Rngs(0))


def tiny_hf_tokenizer(tmp_path):
  """A word-level HF tokenizer (whitespace + punctuation split) saved as JSON and loaded back."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  from lalte_jax.data.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
  trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
  from lalte_jax.eval import ruler  # pylint: disable=import-outside-toplevel
  # Keys and values stay unknown words ([UNK]): fine for length tests.
  tokenizer.train_from_iterator([ESSAY_TEXT, ruler.TEMPLATE, ruler.ANSWER_PREFIX, ruler.NEEDLE,
                                 ruler.S1_HAYSTACK_LINE, "number uuid numbers uuids"], trainer)
  path = tmp_path / "tokenizer.json"
  tokenizer.save(str(path))
  return load_tokenizer(path)
