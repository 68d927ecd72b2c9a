"""`python -m lalte_jax.eval --checkpoint DIR --tasks mqar,sniah1,... --lengths 1024,2048,4096`.

Loads a params-only checkpoint (`lalte_jax.inference.checkpoint.load_model`) and a tokenizer
(`--tokenizer FILE`, else the checkpoint's tokenizer.json, else bytes; synthetic tasks use the
model's ids directly), runs the tasks through the inference path (cached prefill / greedy
decode, LTE cap enforced, G24) with a progress bar per task and length, and writes the report
under `--output-dir` (default `<checkpoint>/eval`): each run writes new files
`results-<UTC time>.json` and `.md` (an earlier run's are never replaced), and copies them to
`results.json` / `results.md`, which hold the newest run. MQAR accuracy is teacher-forced from
the prefill logits at every position; the other generative tasks decode greedily. Tasks: see
`lalte_jax.eval.suite`. Bad inputs (paths, tasks, values) are checked before the model runs
and exit 2 with a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib


from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # before JAX creates a backend

from lalte_jax import cli_boundary  # pylint: disable=wrong-import-position


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(part) for part in text.split(",") if part.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
  from lalte_jax.eval import suite  # pylint: disable=import-outside-toplevel
  from lalte_jax.inference.param_dtype import (  # pylint: disable=import-outside-toplevel
      PARAM_DTYPE_HELP, PARAM_DTYPES)
  parser = cli_boundary.ArgumentParser(
      prog="python -m lalte_jax.eval", description=__doc__.splitlines()[0],
      example="python -m lalte_jax.eval --checkpoint runs/readme_demo/export --tasks"
              " mqar,passkey --lengths 256 --num-examples 32")
  parser.add_argument("--checkpoint", required=True, help="params-only checkpoint directory")
  parser.add_argument("--tasks", required=True,
                      help=f"comma-separated, from {','.join(suite.ALL_TASKS)}")
  parser.add_argument("--lengths", type=_int_list, default=(1024, 2048, 4096),
                      help="target lengths of mqar/passkey/sniah tasks (default 1024,2048,4096)")
  parser.add_argument("--num-examples", type=int, default=100, help="per task and length")
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seed", type=int, default=suite.recall.EVAL_SEED)
  parser.add_argument("--tokenizer", help="HF tokenizers JSON / SentencePiece .model (default:"
                      " the checkpoint's tokenizer.json, else bytes)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="activation dtype (default: the checkpoint's config)")
  parser.add_argument("--param-dtype", choices=PARAM_DTYPES, default="float32",
                      help=PARAM_DTYPE_HELP)
  parser.add_argument("--mqar-num-kv-pairs", type=int, default=8)
  parser.add_argument("--mqar-min-gap", type=int,
                      help="long-gap MQAR gap (default: from the model's attention windows)")
  parser.add_argument("--sniah-max-new-tokens", type=int, default=64)
  parser.add_argument("--haystack-dir", help="directory of essay .txt files (sniah2, sniah3)")
  parser.add_argument("--data-dir", help="held-out corpus from lalte_jax/data/prepare.py (ppl)")
  parser.add_argument("--ppl-sequences", type=int, default=64)
  parser.add_argument("--evaporate-dir", help="directory of <task>.jsonl files (EVAPORATE)")
  parser.add_argument("--evaporate-context-length", type=int, default=4096)
  parser.add_argument("--output-dir", help="default: <checkpoint>/eval; each run adds"
                      " results-<UTC time>.json/.md and updates results.json/.md")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  return parser


def run(argv: list[str] | None = None) -> dict:
  """Parses `argv`, evaluates, writes the reports; returns the JSON payload. Raises ValueError
  for bad inputs."""
  from lalte_jax.data import tokenizer as tokenizers  # pylint: disable=import-outside-toplevel
  from lalte_jax.eval import report, suite  # pylint: disable=import-outside-toplevel
  from lalte_jax.inference import checkpoint  # pylint: disable=import-outside-toplevel
  args = build_parser().parse_args(argv)
  options = suite.EvalOptions(
      tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()), lengths=args.lengths,
      num_examples=args.num_examples, batch_size=args.batch_size, seed=args.seed,
      mqar_num_kv_pairs=args.mqar_num_kv_pairs, mqar_min_gap=args.mqar_min_gap,
      sniah_max_new_tokens=args.sniah_max_new_tokens, haystack_dir=args.haystack_dir,
      data_dir=args.data_dir, ppl_sequences=args.ppl_sequences,
      evaporate_dir=args.evaporate_dir, evaporate_context_length=args.evaporate_context_length,
      progress=not args.no_progress)
  suite.check_inputs(options)
  output_dir = report.check_output_dir(args.output_dir
                                       or pathlib.Path(args.checkpoint) / "eval")
  tokenizer = tokenizers.tokenizer_for_checkpoint(args.tokenizer, args.checkpoint)
  model = checkpoint.load_model(args.checkpoint, dtype=args.dtype, param_dtype=args.param_dtype)
  records = suite.run_suite(model, options, tokenizer)
  payload = {"checkpoint": str(pathlib.Path(args.checkpoint).absolute()),
             "model": model.config.name, "tokenizer": tokenizer.name,
             "options": dataclasses.asdict(options), "results": records}
  markdown = (f"# Evaluation of {model.config.name}\n\ncheckpoint `{args.checkpoint}`, tokenizer"
              f" `{tokenizer.name}`, {options.num_examples} examples per task and length; MQAR:"
              " teacher-forced accuracy (%) over query positions from the prefill logits;"
              " passkey / S-NIAH / EVAPORATE: greedy decoding (%); ppl: bits per byte.\n\n"
              + report.task_table(records))
  json_path, markdown_path = report.write_report(output_dir, payload, markdown)
  payload["paths"] = [str(json_path), str(markdown_path)]
  return payload


@cli_boundary.reports_bad_input
def main(argv: list[str] | None = None) -> int:
  payload = run(argv)
  print(pathlib.Path(payload["paths"][1]).read_text(encoding="utf-8"))
  print(f"wrote {', '.join(payload['paths'])} (newest copied to results.json/.md)")
  return 0
