"""Prefill throughput of the generator's jitted prefill per preset and prompt length, against
GDN+SWA and, with `--fla`, against FLA's PyTorch models of the same configs, in one table.

    python tools/bench_prefill.py                  # lalte/gdn_swa/gdn-1.4b at 4K and 32K prompts
    python tools/bench_prefill.py --fla            # + FLA's gdn_swa-1.4b and gdn-1.4b
    python tools/bench_prefill.py --presets lalte-tiny gdn_swa-tiny --lengths 32 64 --tokens 128 \\
        --warmup 1 --iters 2 --warmup-s 0          # CPU smoke run

For each prompt length L every row runs B = max(1, --tokens // L) random prompts of L tokens (the
same token ids for every model of one vocabulary) through `lalte_jax.generate.prefill`, the jitted
prefill that `generate` runs: the prompts through the model into an empty decode cache, logits of
the last position only. Each call includes its empty cache (a jitted zero fill; `generate` builds
it inside its own jitted program) and the entry's host work (checks of the token ids, splitting the
model: 1.4 ms for lalte-1.4b on a 2-core CPU, 2026-11-26). Random weights, `--dtype` activations
and `--param-dtype` parameters (both bfloat16 by default; the rule of
`lalte_jax.inference.param_dtype`: matrices bfloat16, vectors float32).

Timing (`pallas_kernels.benchmarking`): each row's first call is timed alone ("first call s":
compilation included, or FLA's Triton autotuning) and is its warm-up. Then, per length, `--warmup-s`
seconds of the baseline's calls (the GPU clocks ramp up), the baseline alone (median of `--iters`
calls after `--warmup` more), and every other row in alternation with the baseline
(`paired_ms`): its ms is the median of its own calls, and "vs baseline" is the baseline's median
over its own from the same rounds, i.e. its tokens/s over the baseline's. The baseline is
`--baseline`, by default the first gdn_swa preset of --presets; without one, rows are timed alone.

`--fla` adds a row "FLA <preset>" for every preset whose model FLA 0.6.0 has (tools/fla_models.py:
the same config, FLA's random init in `--dtype`, attention on FLA's `parallel_attn`), run eagerly
as `model(input_ids, use_cache=True, logits_to_keep=1)` under torch.no_grad (the cache filled, the
last position's logits, as ours) and synced with torch.cuda.synchronize. FLA autotunes its Triton
kernels on the first call of each shape, for minutes: that first call is the row's warm-up,
before anything is timed. With
`--fla`, JAX allocates GPU memory on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) so that PyTorch
has room in the same process.

Prints one JSON line per row as it is timed, then the device, the command line and a markdown
table; `--json PATH` also writes the rows (rewritten after every row, so that a run cut short keeps
what it measured). Out of memory (JAX or PyTorch, compiling or running) gives the row status "oom"
and the run goes on; any other failure gives status "error" (its message in the row, the traceback
on stderr), the run goes on and exits with status 1.

On the GPU machine, from the repository root, with FLA's wheels (fla-core and
flash-linear-attention 0.6.0) installed to /tmp/site; one length per run keeps each run shorter
(ours compile for each preset and length, FLA autotunes for each shape):
  PYTHONPATH=/tmp/site:$PWD python3 tools/bench_prefill.py --fla --lengths 4096 --json p4k.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time
import traceback
from typing import Any, Callable

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

# pylint: disable=wrong-import-position
from lalte_jax import xla_flags

xla_flags.apply_workarounds()  # before JAX creates a backend

import jax
import numpy as np

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference.param_dtype import PARAM_DTYPES
from lalte_jax.model import count_parameters
from pallas_kernels.benchmarking import Timed, median_ms, paired_ms, run_for_seconds

from bench_decode import build_model  # tools/bench_decode.py
from lalte_jax.train.metrics import is_out_of_memory
from fla_models import fla_model, has_fla_model, load_fla  # tools/fla_models.py

DEFAULT_PRESETS = ("lalte-1.4b", "gdn_swa-1.4b", "gdn-1.4b")
DEFAULT_LENGTHS = (4096, 32768)
DTYPES = ("bfloat16", "float32")


def random_prompts(batch: int, length: int, vocab_size: int) -> np.ndarray:
  """[batch, length] int32 token ids, the same for every model of one vocabulary size."""
  return np.random.default_rng(0).integers(0, vocab_size, (batch, length), dtype=np.int32)


def ours_prefill(model, batch: int, length: int) -> Timed:
  """One `lalte_jax.generate.prefill` call of random prompts from an empty cache, ready to time."""
  tokens_BT = random_prompts(batch, length, model.config.vocab_size)
  empty_cache = jax.jit(lambda: gen.init_cache(model, batch, max_length=length))
  return Timed(lambda: gen.prefill(model, tokens_BT, empty_cache())[0], [()])


def fla_prefill(torch, model, batch: int, length: int) -> Timed:
  """One eager FLA prefill of the prompts ours gets (cache filled, last logits), ready to time."""
  ids_BT = torch.as_tensor(random_prompts(batch, length, model.config.vocab_size),
                           dtype=torch.long, device="cuda")

  def call():
    with torch.no_grad():
      return model(input_ids=ids_BT, use_cache=True, logits_to_keep=1).logits
  return Timed(call, [()], sync=lambda _: torch.cuda.synchronize())


@dataclasses.dataclass
class Case:
  """One model of the table: its label, parameter count, and how to build and call it."""
  label: str
  preset: str
  implementation: str  # "lalte_jax" or "FLA"
  build: Callable[[], Any]
  prefill: Callable[[Any, int, int], Timed]  # (model, batch, length) -> one call
  parameters: int | None = None
  model: Any = None

  def timed(self, batch: int, length: int) -> Timed:
    if self.model is None:  # built on first use, kept for every length
      self.model = self.build()
      if self.parameters is None:
        self.parameters = sum(p.numel() for p in self.model.parameters())
    return self.prefill(self.model, batch, length)


def make_cases(args, torch) -> list[Case]:
  cases = [Case(name, name, "lalte_jax",
                build=lambda name=name: build_model(name, args.dtype, args.param_dtype),
                prefill=ours_prefill, parameters=count_parameters(get_model_config(name)))
           for name in args.presets]
  if torch is not None:
    cases += [Case(f"FLA {name}", name, "FLA",
                   build=lambda name=name: fla_model(torch, name, args.dtype).eval(),
                   prefill=lambda model, batch, length: fla_prefill(torch, model, batch, length))
              for name in args.presets if has_fla_model(name)]
  return cases


def failed(row: dict, error: Exception, torch) -> None:
  status = "oom" if is_out_of_memory(error) else "error"
  lines = str(error).strip().splitlines()
  row.update(status=status, error=lines[0][:500] if lines else type(error).__name__)
  if status == "error":
    traceback.print_exc()
  if torch is not None:
    torch.cuda.empty_cache()  # what a failed FLA call left in PyTorch's cache


def time_length(cases: list[Case], rows: list[dict], length: int, batch: int, args, torch,
                write: Callable[[], None]) -> None:
  """Fills each case's row of `rows` (one per case, in order) for prompts of `length` tokens."""
  ready = []
  for case, row in zip(cases, rows):
    try:
      timed = case.timed(batch, length)
      row["parameters"] = case.parameters
      start = time.perf_counter()
      timed.one_pass()  # compiles (ours) or autotunes (FLA)
      row["first_call_s"] = time.perf_counter() - start
      ready.append((row, timed))
    except Exception as error:  # pylint: disable=broad-except  # report and go on
      failed(row, error, torch)
      report(row, write)
  baseline = next((timed for row, timed in ready if row["model"] == args.baseline), None)
  ready.sort(key=lambda pair: pair[1] is not baseline)  # the baseline first (stable sort)
  for row, timed in ready:
    try:
      if baseline is None or timed is baseline:
        if timed is baseline:  # the GPU clocks ramp up, then the baseline alone
          run_for_seconds(baseline, seconds=args.warmup_s)
        ms = median_ms(timed.fn, timed.input_sets, warmup=args.warmup, repeats=args.iters,
                       sync=timed.sync)
        ratio = 1.0 if timed is baseline else None
      else:
        ms, baseline_ms = paired_ms(timed, baseline, warmup=args.warmup, rounds=args.iters)
        ratio = baseline_ms / ms
      row.update(status="ok", ms=ms, tokens_per_s=batch * length / ms * 1e3, vs_baseline=ratio)
    except Exception as error:  # pylint: disable=broad-except  # report and go on
      failed(row, error, torch)
      if timed is baseline:  # the others are then timed alone
        baseline = None
    report(row, write)


def report(row: dict, write: Callable[[], None]) -> None:
  print(json.dumps(row), flush=True)
  write()


def cell(value, fmt: str) -> str:
  return "" if value is None else format(value, fmt)


def markdown_table(rows: list[dict], baseline: str | None) -> str:
  lines = [f"| model | parameters | prompt length | batch | ms / call | tokens/s |"
           f" vs {baseline or 'baseline'} | first call s |", "|---" + "|---:" * 7 + "|"]
  for r in rows:
    ok = r["status"] == "ok"
    lines.append(
        f"| {r['model']} | {cell(r.get('parameters'), ',')} | {r['length']} | {r['batch']} |"
        f" {cell(r.get('ms'), '.1f') if ok else r['status'].upper()} |"
        f" {cell(r.get('tokens_per_s'), ',.0f')} | {cell(r.get('vs_baseline'), '.2f')} |"
        f" {cell(r.get('first_call_s'), '.1f')} |")
  return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                      help="'<variant>-<size>' names (lalte_jax.presets)")
  parser.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS),
                      help="prompt lengths in tokens")
  parser.add_argument("--tokens", type=int, default=32768,
                      help="tokens per call: batch = max(1, tokens // length)")
  parser.add_argument("--baseline", default=None,
                      help="the preset every row is paired with and compared to (default: the"
                           " first gdn_swa preset of --presets)")
  parser.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                      help="activations (and FLA's weights)")
  parser.add_argument("--param-dtype", default="bfloat16", choices=PARAM_DTYPES,
                      help="parameter dtype in memory (default bfloat16: matrices only, vectors stay"
                           " float32; float32: all)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed ones")
  parser.add_argument("--iters", type=int, default=20, help="timed calls (or rounds) per row")
  parser.add_argument("--warmup-s", type=float, default=3.0,
                      help="seconds of the baseline's calls before each length's timing")
  parser.add_argument("--fla", action="store_true",
                      help="also FLA's PyTorch models of the presets it has (needs a CUDA GPU)")
  parser.add_argument("--json", default="", help="also write the rows (a JSON list) here")
  args = parser.parse_args(argv)
  for name in ("tokens", "iters"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be positive, got {getattr(args, name)}")
  if args.warmup < 0 or args.warmup_s < 0:
    parser.error(f"--warmup and --warmup-s must be >= 0, got {args.warmup} and {args.warmup_s}")
  if any(length <= 0 for length in args.lengths):
    parser.error(f"--lengths must be positive, got {args.lengths}")
  for name in args.presets:
    try:
      get_model_config(name)
    except ValueError as error:
      parser.error(f"--presets: {error}")
  if len(set(args.presets)) != len(args.presets):
    parser.error(f"--presets: each preset once, got {args.presets}")
  if args.baseline is None:
    args.baseline = next((name for name in args.presets
                          if name.rpartition("-")[0] == "gdn_swa"), None)
  elif args.baseline not in args.presets:
    parser.error(f"--baseline {args.baseline!r} is not one of --presets {args.presets}")
  return args, parser


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args, parser = parse_args(argv)
  torch = None
  if args.fla:
    # Read when JAX starts its GPU client: on demand, so that PyTorch has room beside it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    torch = load_fla(parser)
  cases = make_cases(args, torch)
  device = jax.devices()[0]
  common = {"dtype": args.dtype, "param_dtype": args.param_dtype, "baseline": args.baseline,
            "device_kind": device.device_kind, "warmup": args.warmup, "iters": args.iters}
  rows: list[dict] = []

  def write() -> None:
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")

  for length in args.lengths:
    batch = max(1, args.tokens // length)
    length_rows = [{"model": case.label, "preset": case.preset,
                    "implementation": case.implementation, "length": length, "batch": batch,
                    "parameters": case.parameters, "status": "pending", **common}
                   for case in cases]
    rows.extend(length_rows)
    time_length(cases, length_rows, length, batch, args, torch, write)

  versions = f"jax {jax.__version__}"
  if torch is not None:
    versions += f", torch {torch.__version__}, FLA {sys.modules['fla'].__version__}"
  print(f"\nDevice: {device.device_kind} ({jax.default_backend()}), {versions};"
        f" {args.tokens} tokens per call, {args.dtype} activations, {args.param_dtype}"
        f" parameters{f' (FLA: {args.dtype} weights)' if torch is not None else ''}, random"
        f" weights; median of {args.iters} calls after {args.warmup} warm-up calls"
        f"{f', each row in alternation with {args.baseline}' if args.baseline else ''}.")
  print(f"Command: python tools/bench_prefill.py {' '.join(argv)}\n")
  print(markdown_table(rows, args.baseline))
  return 0 if all(row["status"] in ("ok", "oom") for row in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
