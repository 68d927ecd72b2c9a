"""`python -m lalte_jax.generate --checkpoint DIR [--tokenizer FILE] --prompt "..." [...]`.

Loads a params-only checkpoint (`lalte_jax.inference.checkpoint`) and a tokenizer
(`lalte_jax.data.tokenizer.load_tokenizer`: a HF `tokenizers` JSON file or directory, a
SentencePiece `.model` file; without --tokenizer the checkpoint's own tokenizer.json, which a
training run on a corpus with a HF tokenizer copies into its export, else UTF-8 bytes) and prints
the completion of each prompt. Text prompts (`--prompt`) start with BOS when the
model's vocabulary holds it; `--prompt-ids 1,5,9` gives a prompt as token ids, used as they are
(e.g. for models of synthetic tasks, whose ids are no text), and `--print-ids` prints each
completion's ids, one line per prompt, instead of its text. The tokenizer's EOS (if the model has it) ends a
completion. Bad inputs exit with status 2 and a one-line error.
"""

from __future__ import annotations

import argparse

from lalte_jax import xla_flags

xla_flags.apply_serving()  # before JAX creates a backend

# pylint: disable=wrong-import-position
import jax

from lalte_jax import cli_boundary
from lalte_jax.data import tokenizer as tokenizers
from lalte_jax.inference import checkpoint
from lalte_jax.inference.param_dtype import PARAM_DTYPE_HELP, PARAM_DTYPES


def build_parser() -> argparse.ArgumentParser:
  parser = cli_boundary.ArgumentParser(
      prog="python -m lalte_jax.generate", description=__doc__.splitlines()[0],
      example="python -m lalte_jax.generate --checkpoint runs/readme_demo/export --prompt-ids"
              " 1,5,9 --print-ids --max-new-tokens 8")
  parser.add_argument("--checkpoint", required=True, help="params-only checkpoint directory")
  parser.add_argument("--tokenizer", help="HF tokenizers JSON file or directory, or a"
                      " SentencePiece .model file (default: the checkpoint's tokenizer.json,"
                      " else UTF-8 bytes)")
  prompts = parser.add_mutually_exclusive_group(required=True)
  prompts.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
  prompts.add_argument("--prompt-ids", action="append", metavar="ID,ID,...",
                       help="prompt as comma-separated token ids (no BOS added); repeat for a"
                            " batch")
  parser.add_argument("--print-ids", action="store_true",
                      help="print the generated token ids (comma-separated) instead of text")
  parser.add_argument("--model", help="expected preset name; error if the checkpoint differs")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="activation dtype (default: the preset's)")
  parser.add_argument("--param-dtype", choices=PARAM_DTYPES, default="float32",
                      help=PARAM_DTYPE_HELP)
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
  parser.add_argument("--prefill-chunk-tokens", type=int,
                      help="run the prompt's layers this many tokens at a time"
                           " (less memory for long prompts, the same completion)")
  return parser


def run(argv: list[str] | None = None) -> list[str]:
  """Parses `argv`, generates, returns the completions; raises ValueError for bad inputs."""
  from lalte_jax import generate as generation
  args = build_parser().parse_args(argv)
  tokenizer = tokenizers.tokenizer_for_checkpoint(args.tokenizer, args.checkpoint)
  model = checkpoint.load_params(args.checkpoint, config_name=args.model, dtype=args.dtype,
                                 param_dtype=args.param_dtype)
  vocab_size = model.config.vocab_size
  eviction = None
  if args.eviction is not None:
    eviction = generation.EvictionConfig(args.eviction, cache_size=args.eviction_cache_size)
  if args.prompt_ids:
    prompts = [parse_token_ids(text, vocab_size) for text in args.prompt_ids]
  else:
    prompts = [tokenizers.encode_prompt(tokenizer, text, vocab_size=vocab_size)
               for text in args.prompt]
  stop_tokens = tuple(args.stop_id) + tokenizers.stop_ids(tokenizer, vocab_size)
  out = generation.generate(
      model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, stop_tokens=stop_tokens, rng=jax.random.key(args.seed), eviction=eviction,
      prefill_chunk_tokens=args.prefill_chunk_tokens)
  completions = [row[:int(n)] for row, n in zip(out.tokens, out.lengths)]
  if args.print_ids:
    return [",".join(str(int(i)) for i in ids) for ids in completions]
  return [tokenizer.decode(ids) for ids in completions]


def parse_token_ids(text: str, vocab_size: int) -> list[int]:
  """The ids of one `--prompt-ids` value ("1,5,9"); ValueError naming the value when it is not a
  non-empty list of ids in [0, vocab_size)."""
  try:
    ids = [int(part) for part in text.split(",")]
  except ValueError:
    raise ValueError(f"--prompt-ids {text!r}: expected comma-separated token ids such as"
                     " 1,5,9") from None
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"--prompt-ids {text!r}: id {bad[0]} is outside the model's vocabulary"
                     f" [0, {vocab_size})")
  return ids


@cli_boundary.reports_bad_input
def main(argv: list[str] | None = None) -> int:
  for text in run(argv):
    print(text)
  return 0
