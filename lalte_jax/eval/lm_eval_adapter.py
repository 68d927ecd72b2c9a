"""An lm-evaluation-harness model over a HybridLM: `loglikelihood`, `loglikelihood_rolling` and
`generate_until`, through the cached prefill / decode path (§9.1, G24).

Importable without `lm_eval`: the class then derives from `object` and takes plain requests
(tuples of arguments, or any object with an `.args` tuple, like lm_eval's `Instance`). When
`lm_eval` is importable it derives from `lm_eval.api.model.LM` and is registered as `lalte` on
import (so `lm_eval.simple_evaluate(model="lalte", model_args="checkpoint=DIR", ...)` works after
importing this module), or pass an instance:

    lm_eval.simple_evaluate(model=LaLTELM(checkpoint="DIR", batch_size=16),
                            tasks=["lambada_openai"])

Tokenization follows lm_eval's HF model: a context/continuation pair is encoded whole and split at
the context's length (a trailing space of the context moves to the continuation), BOS is
prepended when the model's vocabulary holds it (`add_bos_token=True` in the paper's runs), and
inputs longer than `max_length` keep their last tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from lalte_jax.data import tokenizer as tokenizers
from lalte_jax.eval import decoding

try:  # pylint: disable=ungrouped-imports
  from lm_eval.api.model import LM as _LMBase
  from lm_eval.api.registry import register_model as _register_model
except ImportError:  # lm_eval is optional
  _LMBase, _register_model = object, None


def _arguments(request) -> tuple:
  return tuple(request.args) if hasattr(request, "args") else tuple(request)


class LaLTELM(_LMBase):
  """lm-eval model; `model` is a HybridLM (or `checkpoint` a params-only checkpoint directory)."""

  def __init__(self, model=None, tokenizer=None, *, checkpoint: str | None = None,
               batch_size: int | str = 8, max_length: int | str = 4096,
               max_gen_toks: int | str = 256, **unused):
    super().__init__()
    if (model is None) == (checkpoint is None):
      raise ValueError("LaLTELM: give exactly one of model (a HybridLM) and checkpoint (a"
                       " directory)")
    if model is None:
      from lalte_jax.inference import checkpoint as stored  # pylint: disable=C0415
      model = stored.load_model(checkpoint)
    if tokenizer is None or isinstance(tokenizer, str):
      tokenizer = tokenizers.load_tokenizer(tokenizer)
    self.model, self.tokenizer = model, tokenizer
    self.vocab_size = model.config.vocab_size
    self.batch_size, self.max_length = int(batch_size), int(max_length)
    self.max_gen_toks = int(max_gen_toks)
    for name in ("batch_size", "max_length", "max_gen_toks"):
      if getattr(self, name) < 1:
        raise ValueError(f"LaLTELM.{name}: must be positive, got {getattr(self, name)}")
    bos = tokenizer.bos_id
    self._prefix = [bos] if bos is not None and bos < self.vocab_size else []

  def _encode(self, text: str) -> list[int]:
    return tokenizers.encode_prompt(self.tokenizer, text, vocab_size=self.vocab_size,
                                    add_bos=False)

  def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    trailing = len(context) - len(context.rstrip())
    if trailing:
      context, continuation = context[:-trailing], context[-trailing:] + continuation
    whole = self._encode(context + continuation)
    context_ids = self._prefix + self._encode(context)
    continuation_ids = whole[len(context_ids) - len(self._prefix):]
    if not continuation_ids:
      raise ValueError(f"loglikelihood: the continuation {continuation!r} encodes to no token")
    return context_ids, continuation_ids

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    """(sum of log P(continuation | context), whether greedy decoding gives the continuation)."""
    sequences, target_counts = [], []
    for request in requests:
      context, continuation = _arguments(request)[:2]
      context_ids, continuation_ids = self._pair(context, continuation)
      if not context_ids:  # no BOS and an empty context: nothing to condition the first token
        context_ids, continuation_ids = continuation_ids[:1], continuation_ids[1:]
      sequence = (context_ids + continuation_ids)[-(self.max_length + 1):]
      sequences.append(sequence)
      target_counts.append(len(continuation_ids))
    results = decoding.token_logprobs(self.model, sequences, batch_size=self.batch_size)
    return [(float(logp[-n:].sum()), bool(greedy[-n:].all())) if n else (0.0, True)
            for (logp, greedy), n in zip(results, target_counts)]

  def loglikelihood_rolling(self, requests) -> list[float]:
    """Sum of log P(token | previous) over every token of each string, in windows of at most
    `max_length` tokens, each conditioned on the tokens just before it (no token scored twice).
    Without a BOS the string's first token has no context and is not scored."""
    totals = []
    for request in requests:
      (text,) = _arguments(request)[:1]
      ids = self._prefix + self._encode(text)
      windows, targets = [], []
      start = 1
      while start < len(ids):
        end = min(start + self.max_length, len(ids))
        context_start = max(0, end - self.max_length - 1)
        windows.append(ids[context_start:end])
        targets.append(end - start)
        start = end
      results = decoding.token_logprobs(self.model, windows, batch_size=self.batch_size)
      totals.append(sum(float(logp[-n:].sum()) for (logp, _), n in zip(results, targets)))
    return totals

  def generate_until(self, requests) -> list[str]:
    """Greedy continuations, cut at the first of the request's `until` strings."""
    groups: dict[int, list[tuple[int, list[int], list[str]]]] = {}
    for index, request in enumerate(requests):
      context, options = _arguments(request)[:2]
      options = dict(options or {})
      until = options.get("until") or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(options.get("max_gen_toks", self.max_gen_toks))
      ids = (self._prefix + self._encode(context))[-max(1, self.max_length - max_new):]
      groups.setdefault(max_new, []).append((index, ids, until))
    outputs: list = [None] * sum(len(g) for g in groups.values())
    stop = tokenizers.stop_ids(self.tokenizer, self.vocab_size)
    for max_new, group in groups.items():  # one generation budget per batch
      completions = decoding.greedy_generate(self.model, [ids for _, ids, _ in group], max_new,
                                             stop_ids=stop, batch_size=self.batch_size)
      for (index, _, until), completion in zip(group, completions):
        outputs[index] = _cut(self.tokenizer.decode(completion), until)
    return outputs


def _cut(text: str, until: Sequence[str]) -> str:
  positions = [text.find(s) for s in until if s and s in text]
  return text[:min(positions)] if positions else text


if _register_model is not None:
  _register_model("lalte")(LaLTELM)
