"""`python -m lalte_jax.generate --checkpoint DIR [--tokenizer FILE] --prompt "..." [...]`.

Loads a params-only checkpoint (`lalte_jax.inference.checkpoint`) and a tokenizer — a `tokenizers`
JSON file when `--tokenizer` is given (needs the `tokenizers` package), else UTF-8 bytes (ids
0..255) — and prints one completion per `--prompt`. Bad inputs exit with a one-line error.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax

from lalte_jax.inference import checkpoint


class ByteTokenizer:
  """UTF-8 bytes as token ids 0..255; no special tokens."""
  vocab_size = 256
  stop_ids: tuple[int, ...] = ()

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class JsonTokenizer:
  """A Hugging Face `tokenizers` JSON file; the end-of-sequence token (if any) stops generation."""

  def __init__(self, path: pathlib.Path):
    try:
      import tokenizers
    except ImportError as error:
      raise ValueError(f"tokenizer: reading {path} needs the 'tokenizers' package (pip install"
                       " tokenizers); omit --tokenizer to use UTF-8 bytes") from error
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the library raises its own exception types
      raise ValueError(f"tokenizer: cannot read {path}: {error}") from error
    self.vocab_size = self._tokenizer.get_vocab_size()
    eos = [self._tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>")]
    self.stop_ids = tuple(i for i in eos if i is not None)

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text).ids

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in ids])


def load_tokenizer(path: str | None):
  if path is None:
    return ByteTokenizer()
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"tokenizer: {path} does not exist")
  return JsonTokenizer(path)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m lalte_jax.generate", description=__doc__)
  parser.add_argument("--checkpoint", required=True, help="params-only checkpoint directory")
  parser.add_argument("--tokenizer", help="tokenizers JSON file (default: UTF-8 bytes)")
  parser.add_argument("--prompt", action="append", required=True,
                      help="prompt text; repeat for a batch")
  parser.add_argument("--model", help="expected preset name; error if the checkpoint differs")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="activation dtype (default: the preset's)")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--top-k", type=int)
  parser.add_argument("--top-p", type=float)
  parser.add_argument("--seed", type=int, default=0, help="sampling key")
  parser.add_argument("--stop-id", type=int, action="append", default=[],
                      help="token id that ends a completion (the tokenizer's EOS is added)")
  parser.add_argument("--eviction", choices=("tova", "uniform"),
                      help="training-free eviction for full-attention layers (§7.1-7.2)")
  parser.add_argument("--eviction-cache-size", type=int, default=1024)
  return parser


def run(argv: list[str] | None = None) -> list[str]:
  """Parses `argv`, generates, returns the completions; raises ValueError for bad inputs."""
  from lalte_jax import generate as generation
  args = build_parser().parse_args(argv)
  tokenizer = load_tokenizer(args.tokenizer)
  model = checkpoint.load_params(args.checkpoint, config_name=args.model, dtype=args.dtype)
  if tokenizer.vocab_size > model.config.vocab_size:
    raise ValueError(f"tokenizer: {tokenizer.vocab_size} tokens do not fit the model's vocabulary"
                     f" of {model.config.vocab_size}")
  eviction = None
  if args.eviction is not None:
    eviction = generation.EvictionConfig(args.eviction, cache_size=args.eviction_cache_size)
  prompts = [tokenizer.encode(text) for text in args.prompt]
  out = generation.generate(
      model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, stop_tokens=tuple(args.stop_id) + tokenizer.stop_ids,
      rng=jax.random.key(args.seed), eviction=eviction)
  return [tokenizer.decode(row[:int(n)]) for row, n in zip(out.tokens, out.lengths)]


def main(argv: list[str] | None = None) -> None:
  try:
    completions = run(argv)
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  for text in completions:
    print(text)
