"""Training throughput of FLA's PyTorch models of our presets, the anchor of tools/bench_train.py.

    python3 tools/bench_train_fla.py --presets gdn_swa-0.4b gdn-0.4b --batch 4 8 16 --json fla.json
    python3 tools/bench_train_fla.py --ours ours.json --json fla.json   # + ratios to our rows

For every preset whose model FLA 0.6.0 has (gdn, gdn_swa, gdn_attn, transformer: see
tools/fla_models.py; laLTE, laNSA and NSA have none), in each `--modes` mode:
- `eager`: the `fla.models` model of the preset's config (FLA's random init, float32 parameters)
  trained as FLA's own training scripts do: bf16 autocast, AdamW with `fused=True` (our trainer's
  betas, eps and weight decay), no activation checkpointing, `model(input_ids, labels=input_ids)`
  (FLA shifts the labels; its fused cross-entropy is the config's default);
- `compile`: the same with `torch.compile(model)`. Dynamo compiles each layer index apart (FLA's
  layers keep their index as an attribute), so its recompile limits are raised to cover every
  layer; otherwise the layers past the limit run eagerly.
Each mode builds a fresh model and optimizer, runs `--warmup` steps (the first autotunes FLA's
Triton kernels for the shape, or compiles, for minutes; its time is `first_step_s`), then times
`--steps` steps, each ended with torch.cuda.synchronize; the median gives tokens/s. Peak memory is
torch.cuda.max_memory_allocated over the whole mode. MFU uses the model FLOP count of
`lalte_jax.train.metrics.flops_per_token` (the same model as ours) over the datasheet peak of the
device (`--peak_tflops` overrides), as tools/bench_train.py does.

FLA 0.6.0 refuses its gated GDN backward on Hopper with Triton < 3.7.1; this tool lifts that guard
for timing only (tools/fla_models.py's `lift_hopper_guard`; every row records it). FLA's
gradients are not checked here; ours are checked against the float64 recurrence by the GPU tests.

Each `--batch` value is a row per (preset, mode); a mode stops at its first batch that runs out
of memory. `--ours PATH` reads tools/bench_train.py's `--json` rows of the same run and adds, per
preset, our fastest batch's tokens/s over FLA's fastest (mode, batch), and at each batch both
ran, ours over FLA's faster mode there (`compare_with_ours`: FLA's eager step is launch-bound at
small batches). Run both tools on the same GPU, one after the other (each takes the whole GPU):
  python3 tools/bench_train.py --presets gdn-0.4b gdn_swa-0.4b --batch 4 8 12 --json ours.json
  PYTHONPATH=/tmp/site:$PWD python3 tools/bench_train_fla.py --presets gdn-0.4b gdn_swa-0.4b \\
      --batch 4 8 16 --ours ours.json --json fla.json

Each (preset, mode, batch) row runs in a child process of this tool (one after the other, each with the
whole GPU), so a crash of one mode (`torch.compile` died with a segmentation fault once on an
H200) leaves the others: its row gets the status "crashed". Prints one JSON line per row, then a
markdown table; `--json` rewrites the rows after each one. Out of memory gives the row status
"oom" and the run goes on; any other failure gives status "error" (the traceback on stderr), the
run goes on and exits with status 1 (as after a crash).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

_TOOLS = pathlib.Path(__file__).resolve().parent
for _path in (str(_TOOLS.parent), str(_TOOLS)):
  if _path not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _path)

# pylint: disable=wrong-import-position
import numpy as np

from lalte_jax.config import get_model_config
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.metrics import flops_per_token, is_out_of_memory, peak_flops_per_device

from bench_train import table_cell  # tools/bench_train.py
from fla_models import fla_model, has_fla_model, lift_hopper_guard, load_fla  # tools/fla_models.py

DEFAULT_PRESETS = ("gdn-0.4b", "gdn_swa-0.4b")
MODES = ("eager", "compile")
# Dynamo's per-function recompile limit: at least one entry per layer index (module doc).
DYNAMO_CACHE_SIZE_LIMIT = 256


def new_parser() -> argparse.ArgumentParser:
  return argparse.ArgumentParser(description=__doc__.splitlines()[0])


def parse_args(argv: list[str] | None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
  """The checked arguments; `parser` (default: a new one) also reports later errors."""
  parser = parser or new_parser()
  parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                      help="'<variant>-<size>' names; those FLA has no model of are skipped")
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch", type=int, nargs="+", default=[4],
                      help="sequences per step, one row each (a mode stops at its first batch"
                           " that runs out of memory)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2,
                      help="untimed steps first (the first autotunes or compiles)")
  parser.add_argument("--peak_tflops", type=float, default=0.0,
                      help="peak TFLOP/s of the device for MFU (0 = look up the device name)")
  parser.add_argument("--ours", default="", help="tools/bench_train.py --json rows to compare")
  parser.add_argument("--json", default="", help="also write the rows (a JSON list) here")
  parser.add_argument("--child_row", default="", help=argparse.SUPPRESS)  # see child_row
  args = parser.parse_args(argv)
  for name in ("seq_len", "steps", "warmup"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be positive, got {getattr(args, name)}")
  if any(batch <= 0 for batch in args.batch):
    parser.error(f"--batch must be positive, got {args.batch}")
  args.batch = sorted(set(args.batch))
  unknown = []
  for preset in args.presets:
    try:
      get_model_config(preset)
    except (KeyError, ValueError) as error:
      unknown.append(f"{preset} ({error})")
  if unknown:
    parser.error(f"--presets: unknown {', '.join(unknown)}")
  args.ours_rows = read_ours(parser, args.ours) if args.ours else []
  return args


def read_ours(parser: argparse.ArgumentParser, path: str) -> list[dict]:
  """bench_train.py's JSON rows, or a parser error naming the file."""
  try:
    rows = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
  except (OSError, json.JSONDecodeError) as error:
    parser.error(f"--ours {path}: not a readable JSON file ({error})")
  if not isinstance(rows, list) or not all(isinstance(row, dict) and "preset" in row
                                           for row in rows):
    parser.error(f"--ours {path}: expected tools/bench_train.py's list of rows")
  return rows


def optimizer(torch, model):
  """AdamW as our trainer sets it (betas, eps, weight decay), fused; lr only needs to be > 0."""
  defaults = TrainConfig()
  return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(defaults.adam_b1, defaults.adam_b2),
                           eps=defaults.adam_eps, weight_decay=defaults.weight_decay, fused=True)


def train_mode(torch, preset: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
  """Times FLA's training step of `preset` in `mode` at `batch` sequences; the row's measured
  fields."""
  torch.cuda.empty_cache()
  torch.cuda.reset_peak_memory_stats()
  model = fla_model(torch, preset, "float32").train()
  parameters = sum(p.numel() for p in model.parameters())
  step_model = model
  if mode == "compile":
    import torch._dynamo  # pylint: disable=import-outside-toplevel,protected-access
    dynamo_config = torch._dynamo.config  # pylint: disable=protected-access
    dynamo_config.cache_size_limit = DYNAMO_CACHE_SIZE_LIMIT
    dynamo_config.accumulated_cache_size_limit = DYNAMO_CACHE_SIZE_LIMIT
    step_model = torch.compile(model)
  adamw = optimizer(torch, model)
  vocab_size = model.config.vocab_size
  ids_BT = torch.as_tensor(
      np.random.default_rng(0).integers(0, vocab_size, (batch, args.seq_len)),
      dtype=torch.long, device="cuda")

  def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
      loss = step_model(input_ids=ids_BT, labels=ids_BT).loss
    loss.backward()
    adamw.step()
    adamw.zero_grad(set_to_none=True)
    return loss.detach()

  times = []
  for index in range(args.warmup + args.steps):
    start = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  timed = times[args.warmup:]
  step_time = statistics.median(timed)
  tokens_per_s = batch * args.seq_len / step_time
  per_token = flops_per_token(get_model_config(preset), args.seq_len)
  peak = peak_flops_per_device(torch.cuda.get_device_name(), args.peak_tflops)
  return {"parameters": parameters, "first_step_s": times[0], "step_time_s": step_time,
          "step_times_s": timed, "tokens_per_s": tokens_per_s, "final_loss": float(loss),
          "mfu": tokens_per_s * per_token / peak if peak else None,
          "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def _fastest(rows: list[dict]) -> dict | None:
  ran = [row for row in rows if row.get("tokens_per_s")]
  return max(ran, key=lambda row: row["tokens_per_s"]) if ran else None


def compare_with_ours(rows: list[dict], ours: list[dict]) -> list[dict]:
  """Per preset with rows of both at FLA's sequence length: our fastest batch's tokens/s over
  FLA's fastest (mode, batch), and at each batch both ran, ours over FLA's faster mode there.

  Each side at its own fastest batch is the comparison a user makes: FLA's eager step is
  launch-bound at small batches (2026-11-30, one H200: 1.4-1.5x its tokens/s from 4 to 8 and 16
  sequences), so a ratio at one small batch measures its Python overhead as much as its kernels.
  """
  comparisons = []
  for preset in dict.fromkeys(row["preset"] for row in rows):
    fla = [row for row in rows if row["preset"] == preset]
    seq_len = fla[0]["seq_len"]
    mine = [row for row in ours if row["preset"] == preset and row.get("seq_len") == seq_len]
    best_fla, best_ours = _fastest(fla), _fastest(mine)
    if best_fla is None or best_ours is None:
      continue
    same_batch = {}
    for batch in sorted({row["batch"] for row in fla}):
      fla_here = _fastest([row for row in fla if row["batch"] == batch])
      ours_here = _fastest([row for row in mine if row.get("global_batch") == batch])
      if fla_here and ours_here:
        same_batch[batch] = ours_here["tokens_per_s"] / fla_here["tokens_per_s"]
    comparisons.append({
        "preset": preset, "seq_len": seq_len,
        "ours_tokens_per_s": best_ours["tokens_per_s"], "ours_batch": best_ours.get("global_batch"),
        "ours_peak_memory_gib": best_ours.get("peak_memory_gib"),
        "best_fla_mode": best_fla["mode"], "best_fla_batch": best_fla["batch"],
        "best_fla_tokens_per_s": best_fla["tokens_per_s"],
        "best_fla_peak_memory_gib": best_fla.get("peak_memory_gib"),
        "ours_over_best_fla": best_ours["tokens_per_s"] / best_fla["tokens_per_s"],
        "same_batch": same_batch})
  return comparisons


def measure_row(torch, preset: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
  """One row: train_mode's fields with status "ok", or the failure's status and first line."""
  row = {"preset": preset, "mode": mode, "seq_len": args.seq_len, "batch": batch,
         "device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "hopper_guard_lifted": True}
  try:
    row.update(status="ok", **train_mode(torch, preset, mode, batch, args))
  except Exception as error:  # pylint: disable=broad-except  # the run goes on
    row["status"] = "oom" if is_out_of_memory(error) else "error"
    row["error"] = (str(error).strip().splitlines() or [type(error).__name__])[0][:500]
    if row["status"] == "error":
      traceback.print_exc()
  return row


def child_row(preset: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
  """The row of (preset, mode, batch) measured by a child process of this tool (`--child_row PATH`:
  it writes its row there), or a "crashed" row saying how the child ended without one."""
  with tempfile.TemporaryDirectory() as directory:
    path = pathlib.Path(directory) / "row.json"
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--presets", preset,
               "--modes", mode, "--seq_len", str(args.seq_len), "--batch", str(batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--peak_tflops", str(args.peak_tflops), "--child_row", str(path)]
    done = subprocess.run(command, check=False)
    if path.is_file():
      return json.loads(path.read_text(encoding="utf-8"))
  code = done.returncode
  how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
  return {"preset": preset, "mode": mode, "seq_len": args.seq_len, "batch": batch,
          "status": "crashed", "error": f"its child process ended with {how} before its row"}


def markdown_table(rows: list[dict], comparisons: list[dict]) -> str:
  lines = ["| preset | FLA mode | status | parameters | T | batch | first step s | step s |"
           " tokens/s | MFU | peak GiB |", "|" + "---|" * 11]
  for r in rows:
    lines.append(
        f"| {r['preset']} | {r['mode']} | {r['status']} | {table_cell(r.get('parameters'), ',')} |"
        f" {r['seq_len']} | {r['batch']} | {table_cell(r.get('first_step_s'), '.1f')} |"
        f" {table_cell(r.get('step_time_s'), '.3f')} |"
        f" {table_cell(r.get('tokens_per_s'), ',.0f')} |"
        f" {table_cell(r.get('mfu'), '.1%')} | {table_cell(r.get('peak_memory_gib'), '.1f')} |")
  if comparisons:
    lines += ["", "| preset | ours, fastest batch: tokens/s (batch, peak GiB) | FLA, fastest:"
              " tokens/s (mode, batch, peak GiB) | ours / FLA, each at its fastest |"
              " ours / FLA's faster mode, same batch |", "|" + "---|" * 5]
    for c in comparisons:
      same = ", ".join(f"{ratio:.2f} at {batch}" for batch, ratio in c["same_batch"].items())
      lines.append(
          f"| {c['preset']} | {c['ours_tokens_per_s']:,.0f} ({c['ours_batch']},"
          f" {table_cell(c['ours_peak_memory_gib'], '.1f')}) |"
          f" {c['best_fla_tokens_per_s']:,.0f} ({c['best_fla_mode']}, {c['best_fla_batch']},"
          f" {table_cell(c['best_fla_peak_memory_gib'], '.1f')}) |"
          f" {c['ours_over_best_fla']:.2f} | {same or '-'} |")
  return "\n".join(lines)


def write(path: str, data) -> None:
  if path:
    pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
  parser = new_parser()
  args = parse_args(argv, parser)
  presets = [preset for preset in args.presets if has_fla_model(preset)]
  for preset in sorted(set(args.presets) - set(presets)):
    print(f"{preset}: FLA has no model of this variant, skipped", file=sys.stderr)
  torch = load_fla(parser)  # here too: a machine without FLA or a GPU is told before any child
  if args.child_row:  # one row, for the parent's child_row
    lift_hopper_guard()
    row = measure_row(torch, presets[0], args.modes[0], args.batch[0], args)
    write(args.child_row, row)
    return 1 if row["status"] == "error" else 0
  rows = []
  report = {"command": "python3 tools/bench_train_fla.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "rows": rows, "comparisons": []}
  for preset in presets:
    for mode in args.modes:
      for batch in args.batch:
        rows.append(child_row(preset, mode, batch, args))
        print(json.dumps(rows[-1]), flush=True)
        write(args.json, report)
        if rows[-1]["status"] == "oom":  # a larger batch would too
          break
  report["comparisons"] = compare_with_ours(rows, args.ours_rows)
  write(args.json, report)
  print(markdown_table(rows, report["comparisons"]))
  return 1 if any(row["status"] in ("error", "crashed") for row in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
