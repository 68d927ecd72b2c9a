"""Training throughput over the GPUs of one host: N processes (one per GPU, as a multi-host job
runs) against one process over N GPUs, through the trainer's own command line.

    python3 tools/bench_scaling.py --json runs/scaling.json --budget-s 500          # 4-GPU host
    python3 tools/bench_scaling.py --presets lalte-0.4b --gpus 1,2 --reshard lalte-0.4b
    python3 tools/bench_scaling.py --presets "" --reshard lalte-1.4b --reshard-to 2   # only that
    python3 tools/bench_scaling.py --platform cpu --presets lalte-tiny --gpus 1,2 --seq-len 64 \\
        --steps 4 --warmup 2 --dtype float32      # CPU smoke: each "GPU" is a CPU device

Every case is `python -m lalte_jax.train` on synthetic MQAR data (the preset's vocabulary, made
on the fly), `--batch-per-gpu` sequences of `--seq-len` tokens per GPU (global batch = that x N),
one metrics record per step, no evaluation, checkpoint or export (`save_checkpoints=false`), on
the mesh of `--mesh`: `data` (data=N x fsdp=1, the trainer's default: parameters and AdamW moments
replicated, the batch split, the gradients all-reduced) or `fsdp` (data=1 x fsdp=N:
parameters, moments and batch split over all N GPUs; all-gathers of each layer's weights in the
forward and backward passes, reduce-scatters of its gradients). Per preset
and GPU count N (those of `--gpus` up to the visible GPUs; every preset's 1-GPU run first, then
every preset at the largest N, then the next smaller N, so that a short budget keeps the ends):
- "multi": N processes on localhost, process i on GPU i alone (CUDA_VISIBLE_DEVICES), joined by
  `jax.distributed` through the trainer's `--coordinator_address/--num_processes/--process_id`
  (lalte_jax/train/distributed.py) on a free port: the multi-host code path, NCCL between them;
- "single": one process over GPUs 0..N-1 (N = 1 runs only this mode; it is the baseline).
From process 0's metrics.jsonl: the loss of every step, the median `step_time_s` of the steps
after the first `--warmup` (the first compiles; each step's time ends with its metrics on the
host), `mfu` (the trainer's: `lalte_jax.train.metrics.flops_per_token` over the datasheet peak of
the device kind, per GPU; absent on CPU unless `--peak-tflops`), and `peak_memory_gib` (the
largest peak of process 0's devices). Derived: tokens/s, tokens/s per GPU, scaling efficiency
tokens/s(N) / (N x tokens/s of the 1-GPU run; of the fewest GPUs that ran when 1 GPU was out of
memory), and for "multi" the largest |loss difference| from
"single" at the same N (expected <= `--tolerance`: each process reads a contiguous block of every
global batch, so both see the same global batch in the same rows and compile the same step).

`--reshard PRESET`: resuming on other process counts. PRESET trains K+M steps (`--reshard-steps
K,M`) as `--reshard-from` processes, with a checkpoint at step K; that checkpoint is copied into a
new run, which resumes it as each count of `--reshard-to` processes (one GPU each, so a smaller
or larger mesh; a count needing more GPUs than are visible is skipped; with `--reshard-same-gpus`
all `--reshard-from` GPUs split over those processes, so the same mesh in another process
layout) and trains steps K+1..K+M; their losses must equal the uninterrupted
run's within `--reshard-tolerance` (Orbax reads the state onto the new mesh, the data position is
global: lalte_jax/train/checkpointing.py).
The global batch stays `--batch-per-gpu` x `--reshard-from`; the compute dtype is
`--reshard-dtype` (float32 by default, so that the tolerance measures the restore, not rounding).

`--deterministic` runs every case with the trainer's `reproducible=true` (XLA's deterministic
ops, every all-reduce through NCCL: `lalte_jax.xla_flags.REPRODUCIBLE_GPU`): with it the two
modes, and a resumed run and the uninterrupted one, agree to the last bit on GPUs
(docs/benchmarks.md, section 6.1); `--xla-flag FLAG` (repeatable) adds any XLA flag to every
child. Each case records the flags it ran with (`xla_flags`). The step-time breakdown (compute
against collectives) is `tools/bench_train.py --profile` on the same GPUs
(`collective_exposed_ms`: the time a collective runs with no other kernel beside it).

Budget: with `--budget-s`, a case starts only when the longest case of its preset so far (of any
preset before the first one finishes) fits in what is left, and every case is stopped at the
budget (status "timeout"); `--case-timeout-s` bounds each. Children run in their own process
groups, killed on any exit of this tool (SIGTERM and SIGINT included). The JSON (`--json`) is
rewritten after every case; a markdown table goes to stdout. Logs: <--out>/<case>/process<i>.log.
Exit status: 0 when every case ran (or was out of memory or skipped for the budget), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import time

_TOOLS = pathlib.Path(__file__).resolve().parent
REPO = _TOOLS.parent
for _path in (str(REPO), str(_TOOLS)):
  if _path not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _path)

from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # children inherit the environment

from lalte_jax.config import REMAT_POLICIES  # pylint: disable=wrong-import-position

from bench_train import table_cell  # pylint: disable=wrong-import-position
from trainer_runs import (  # pylint: disable=wrong-import-position  # tools/trainer_runs.py
    ProcessGroups, mesh_settings, read_records, run_trainer, visible_gpus)


DEFAULT_PRESETS = "lalte-0.4b,gdn_swa-0.4b,lalte-1.4b"


def _int_list(text: str) -> list[int]:
  try:
    values = [int(item) for item in text.split(",") if item.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or any(value <= 0 for value in values):
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default=DEFAULT_PRESETS,
                      help="comma-separated '<variant>-<size>' names (lalte_jax.presets)")
  parser.add_argument("--gpus", type=_int_list, default=[1, 2, 4],
                      help="GPU counts (comma-separated); those above the visible GPUs are skipped")
  parser.add_argument("--modes", default="multi,single", help="multi, single or both")
  parser.add_argument("--batch-per-gpu", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--steps", type=int, default=8, help="steps per case, warm-up included")
  parser.add_argument("--warmup", type=int, default=3,
                      help="first steps left out of the timing (the first one compiles)")
  parser.add_argument("--remat", default="dots_attention", choices=REMAT_POLICIES)
  parser.add_argument("--mesh", default="data", choices=("data", "fsdp"),
                      help="split the batch only (data) or also the parameters and moments (fsdp)")
  parser.add_argument("--deterministic", action="store_true",
                      help="every case with the trainer's reproducible=true (module doc)")
  parser.add_argument("--xla-flag", dest="xla_flags", action="append", default=[],
                      metavar="FLAG", help="an XLA flag for every child, e.g."
                      " --xla-flag=--xla_gpu_autotune_level=0 (repeatable)")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                      help="more trainer settings for every case (repeatable)")
  parser.add_argument("--peak-tflops", type=float, default=0.0,
                      help="peak TFLOP/s per device for MFU (0 = the trainer's device-kind table)")
  parser.add_argument("--tolerance", type=float, default=1e-6,
                      help="largest |loss difference| between multi and single at the same N")
  parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                      help="cpu: each GPU is a CPU device (XLA's host device count), for tests")
  parser.add_argument("--budget-s", type=float, default=0.0, help="total seconds (0 = none)")
  parser.add_argument("--case-timeout-s", type=float, default=600.0)
  parser.add_argument("--out", default="runs/bench_scaling",
                      help="run directories and logs (each case's is replaced)")
  parser.add_argument("--json", default="", help="write the results here after every case")
  parser.add_argument("--reshard", default="", metavar="PRESET",
                      help="also check resuming PRESET's checkpoint on fewer processes")
  parser.add_argument("--reshard-steps", type=_int_list, default=[4, 3], metavar="K,M")
  parser.add_argument("--reshard-from", type=int, default=4, help="processes of the first run")
  parser.add_argument("--reshard-to", type=_int_list, default=[2, 1],
                      help="process counts that resume the checkpoint")
  parser.add_argument("--reshard-same-gpus", action="store_true",
                      help="resume on all --reshard-from GPUs split over fewer processes (the same"
                           " mesh, another process layout) instead of one GPU per process")
  parser.add_argument("--reshard-seq-len", type=int, default=0, help="0 = --seq-len")
  parser.add_argument("--reshard-tolerance", type=float, default=1e-5)
  parser.add_argument("--reshard-dtype", default="float32", choices=("bfloat16", "float32"),
                      help="compute dtype of the resume check (float32: rounding differences"
                           " between meshes stay far below the tolerance)")
  args = parser.parse_args(argv)
  args.presets = [name.strip() for name in args.presets.split(",") if name.strip()]
  args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
  if not args.presets and not args.reshard:
    parser.error("--presets names no preset (an empty list is for --reshard alone)")
  if not args.modes or set(args.modes) - {"multi", "single"}:
    parser.error(f"--modes must be multi, single or both, got {','.join(args.modes)!r}")
  for name in ("batch_per_gpu", "seq_len", "steps", "case_timeout_s", "reshard_from"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
  if not 1 <= args.warmup < args.steps:
    parser.error(f"--warmup must lie in [1, --steps={args.steps}), got {args.warmup}")
  if args.budget_s < 0 or args.reshard_seq_len < 0:
    parser.error("--budget-s and --reshard-seq-len must be >= 0")
  if len(args.reshard_steps) != 2:
    parser.error(f"--reshard-steps takes K,M, got {args.reshard_steps}")
  global_batch = args.batch_per_gpu * args.reshard_from
  if args.reshard and any(global_batch % n for n in args.reshard_to):
    parser.error(f"--reshard-to counts {args.reshard_to} must divide the global batch"
                 f" {global_batch} (--batch-per-gpu x --reshard-from: it splits over the"
                 " processes)")
  if args.reshard and args.reshard_same_gpus and any(
      args.reshard_from % n for n in args.reshard_to):
    parser.error(f"--reshard-same-gpus: --reshard-to counts {args.reshard_to} must divide"
                 f" --reshard-from={args.reshard_from} (its GPUs split over the processes)")
  bad = [flag for flag in args.xla_flags if not flag.startswith("--xla_")]
  if bad:
    parser.error(f"--xla-flag takes XLA flags such as --xla_gpu_autotune_level=0, got {bad}")
  args.xla_flags = tuple(args.xla_flags)
  return args


def _raise_exit(signum, frame):
  del frame
  raise SystemExit(128 + signum)  # unwinds through `finally`, which kills the children


def trainer_settings(args: argparse.Namespace, preset: str, *, gpus: int, global_batch: int,
                     seq_len: int, steps: int, run_dir: pathlib.Path) -> list[str]:
  """The `--set` values of one run (shipped config tiny_mqar, everything that matters set)."""
  variant, _, size = preset.rpartition("-")
  return [f"variant={variant}", f"size={size}", f"model_dtype={args.dtype}",
          f"remat={args.remat}", "data=mqar", f"seq_len={seq_len}",
          f"global_batch_size={global_batch}", "grad_accum_steps=1", f"steps={steps}",
          "warmup_steps=1", "lr=3e-4", *mesh_settings(args.mesh, gpus), "mesh_tensor=1",
          "log_every=1", "eval_every=0", "eval_batches=0", "tensorboard=false",
          "progress_bar=false", "save_checkpoints=false",
          f"peak_tflops_per_device={args.peak_tflops}", f"output_dir={run_dir}",
          *(["reproducible=true"] if args.deterministic else []), *args.settings]


def step_metrics(records: list[dict], warmup: int, tokens_per_step: int, gpus: int) -> dict:
  """Losses of every step; median step time, tokens/s and MFU of the steps after `warmup`."""
  result = {"steps_logged": [r["step"] for r in records], "losses": [r["loss"] for r in records]}
  timed = [r for r in records if r["step"] > warmup and "step_time_s" in r]
  memory = [r["peak_memory_gib"] for r in records if "peak_memory_gib" in r]
  result["peak_memory_gib"] = max(memory) if memory else None
  if not timed:
    return result
  step_time = statistics.median(r["step_time_s"] for r in timed)
  mfu = [r["mfu"] for r in timed if "mfu" in r]
  result.update(step_times_s=[r["step_time_s"] for r in timed], step_time_s=step_time,
                tokens_per_s=tokens_per_step / step_time,
                tokens_per_s_per_gpu=tokens_per_step / step_time / gpus,
                mfu=statistics.median(mfu) if mfu else None)
  return result


def add_comparisons(cases: list[dict], tolerance: float) -> None:
  """Scaling efficiency against each preset's single-process run on the fewest GPUs that ran
  (1 unless it was out of memory: `efficiency_base_gpus`), multi's losses against single's."""
  for case in cases:
    bases = [c for c in cases if c["preset"] == case["preset"] and c["mode"] == "single"
             and c.get("tokens_per_s")]
    base = min(bases, key=lambda c: c["gpus"], default=None)
    if base and case.get("tokens_per_s"):
      case["efficiency_base_gpus"] = base["gpus"]
      case["scaling_efficiency"] = (case["tokens_per_s"] * base["gpus"]
                                    / (case["gpus"] * base["tokens_per_s"]))
    single = next((c for c in cases if (c["preset"], c["mode"], c["gpus"])
                   == (case["preset"], "single", case["gpus"]) and c.get("losses")), None)
    if case["mode"] == "multi" and single and case.get("losses"):
      if len(single["losses"]) == len(case["losses"]):
        difference = max(abs(a - b) for a, b in zip(case["losses"], single["losses"]))
        case["loss_max_abs_diff_vs_single"] = difference
        case["losses_match_single"] = difference <= tolerance
      else:
        case["losses_match_single"] = False


def markdown_table(cases: list[dict]) -> str:
  lines = ["| preset | mode | GPUs | status | step s | tokens/s | tokens/s/GPU | efficiency |"
           " MFU | peak GiB | max loss diff |", "|" + "---|" * 11]
  for c in cases:
    lines.append(
        f"| {c['preset']} | {c['mode']} | {c['gpus']} | {c['status']} |"
        f" {table_cell(c.get('step_time_s'), '.3f')} |"
        f" {table_cell(c.get('tokens_per_s'), ',.0f')} |"
        f" {table_cell(c.get('tokens_per_s_per_gpu'), ',.0f')} |"
        f" {table_cell(c.get('scaling_efficiency'), '.1%')} | {table_cell(c.get('mfu'), '.1%')} |"
        f" {table_cell(c.get('peak_memory_gib'), '.1f')} |"
        f" {table_cell(c.get('loss_max_abs_diff_vs_single'), '.2e')} |")
  return "\n".join(lines)


class Budget:
  """Seconds left of `--budget-s`, and whether a case of a preset fits (module doc)."""

  def __init__(self, total_s: float, case_timeout_s: float):
    self.total_s, self.case_timeout_s = total_s, case_timeout_s
    self.start = time.monotonic()
    self.durations: dict[str, list[float]] = {}

  def left_s(self) -> float:
    if not self.total_s:
      return float("inf")
    return self.total_s - (time.monotonic() - self.start)

  def estimate_s(self, preset: str) -> float:
    own = self.durations.get(preset)
    if own:
      return max(own)
    others = [d for durations in self.durations.values() for d in durations]
    return max(others) if others else 0.0

  def timeout_s(self, preset: str) -> float | None:
    """The child timeout of a case of `preset`, or None when it would not finish in time."""
    left = self.left_s()
    if left <= 0 or self.estimate_s(preset) > left:
      return None
    return min(self.case_timeout_s, left)

  def record(self, preset: str, seconds: float) -> None:
    self.durations.setdefault(preset, []).append(seconds)


class Report:
  """The results so far, written to `--json` (atomically) after every case."""

  def __init__(self, args: argparse.Namespace, argv: list[str]):
    self.path = pathlib.Path(args.json) if args.json else None
    self.tolerance = args.tolerance
    self.data = {"command": "python3 tools/bench_scaling.py " + " ".join(argv),
                 "settings": {key: value for key, value in vars(args).items()},
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cases": [], "reshard": None}

  def add(self, case: dict) -> None:
    self.data["cases"].append(case)
    add_comparisons(self.data["cases"], self.tolerance)
    self.write()

  def write(self) -> None:
    if self.path is None:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    temporary = self.path.with_name(self.path.name + ".tmp")
    temporary.write_text(json.dumps(self.data, indent=2) + "\n", encoding="utf-8")
    temporary.replace(self.path)


def case_plan(args: argparse.Namespace, visible: int) -> list[tuple[str, str, int]]:
  """(preset, mode, GPUs) in running order, so that a budget that runs out leaves the most
  telling cases done: every preset's 1-GPU baseline, then every preset at the largest count,
  then at the next smaller one...; multi before single."""
  counts = sorted({gpus for gpus in args.gpus if gpus <= visible})
  plan = []
  for gpus in counts[:1] + counts[:0:-1]:
    for preset in args.presets:
      for mode in ("multi", "single"):
        if mode in args.modes and not (gpus == 1 and mode == "multi"):
          plan.append((preset, mode, gpus))
      if gpus == 1 and "single" not in args.modes:
        plan.append((preset, "single", 1))  # the baseline of every efficiency
  return plan


def run_case(groups: ProcessGroups, args: argparse.Namespace, budget: Budget,
             devices: list[str], preset: str, mode: str, gpus: int) -> dict:
  case = {"preset": preset, "mode": mode, "gpus": gpus, "batch_per_gpu": args.batch_per_gpu,
          "seq_len": args.seq_len, "global_batch": args.batch_per_gpu * gpus,
          "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype, "remat": args.remat,
          "mesh": args.mesh, "deterministic": args.deterministic,
          "xla_flags": list(args.xla_flags)}
  timeout_s = budget.timeout_s(preset)
  if timeout_s is None:
    return {**case, "status": "skipped", "error": f"{budget.left_s():.0f} s left, a case of"
            f" {preset} takes about {budget.estimate_s(preset):.0f} s"}
  run_dir = pathlib.Path(args.out) / f"{preset}_{mode}_{gpus}"
  shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed or appended one
  settings = trainer_settings(args, preset, gpus=gpus, global_batch=case["global_batch"],
                              seq_len=args.seq_len, steps=args.steps, run_dir=run_dir)
  run = run_trainer(groups, run_dir, settings, processes=gpus if mode == "multi" else 1,
                    devices=devices[:gpus], timeout_s=timeout_s, platform=args.platform,
                    extra_xla_flags=args.xla_flags)
  budget.record(preset, run["wall_s"])
  tokens_per_step = case["global_batch"] * args.seq_len
  case.update(run, **step_metrics(read_records(run_dir), args.warmup, tokens_per_step, gpus))
  return case


def _link_or_copy(source: str, destination: str) -> None:
  try:
    os.link(source, destination)
  except OSError:
    shutil.copy2(source, destination)


def run_reshard(groups: ProcessGroups, args: argparse.Namespace, budget: Budget,
                devices: list[str]) -> dict:
  """The resume check of `--reshard` (module doc)."""
  preset, (k, m) = args.reshard, args.reshard_steps
  seq_len = args.reshard_seq_len or args.seq_len
  global_batch = args.batch_per_gpu * args.reshard_from
  result = {"preset": preset, "checkpoint_step": k, "steps_after": m, "seq_len": seq_len,
            "dtype": args.reshard_dtype, "mesh": args.mesh, "deterministic": args.deterministic,
            "xla_flags": list(args.xla_flags),
            "global_batch": global_batch, "from_processes": args.reshard_from,
            "tolerance": args.reshard_tolerance, "runs": []}
  out = pathlib.Path(args.out) / f"reshard_{preset}"
  shutil.rmtree(out, ignore_errors=True)

  def run(name: str, processes: int) -> dict | None:
    gpus = args.reshard_from if args.reshard_same_gpus else processes
    timeout_s = budget.timeout_s(f"reshard {preset}")
    if timeout_s is None or gpus > len(devices):
      result["runs"].append({"name": name, "status": "skipped", "error": (
          "budget" if timeout_s is None else f"{gpus} GPUs needed, {len(devices)} visible")})
      return None
    run_dir = out / name
    settings = trainer_settings(args, preset, gpus=gpus, global_batch=global_batch,
                                seq_len=seq_len, steps=k + m, run_dir=run_dir)
    settings += ["save_checkpoints=true", f"checkpoint_every={k}", "checkpoint_keep=10",
                 f"model_dtype={args.reshard_dtype}"]
    outcome = run_trainer(groups, run_dir, settings, processes=processes,
                          devices=devices[:gpus], timeout_s=timeout_s, platform=args.platform,
                          extra_xla_flags=args.xla_flags)
    budget.record(f"reshard {preset}", outcome["wall_s"])
    outcome.update(name=name, processes=processes, gpus=gpus,
                   losses={r["step"]: r["loss"] for r in read_records(run_dir)})
    result["runs"].append(outcome)
    return outcome if outcome["status"] == "ok" else None

  reference = run(f"{args.reshard_from}_processes", args.reshard_from)
  if reference is None:
    result["status"] = "error"
    return result
  source = out / f"{args.reshard_from}_processes" / "checkpoints"
  differences = []
  for processes in args.reshard_to:
    run_dir = out / f"resumed_on_{processes}"
    # Only step K: the resumed run starts from the newest checkpoint it finds.
    # Hard links where the file system allows (a 1.4B float32 state is ~17 GB; the resumed run
    # only reads it).
    shutil.copytree(source, run_dir / "checkpoints", copy_function=_link_or_copy,
                    ignore=lambda folder, names: [name for name in names if folder == str(source)
                                                  and name.isdigit() and int(name) != k])
    resumed = run(run_dir.name, processes)
    if resumed is None:
      continue
    steps = sorted(resumed["losses"])
    if steps != list(range(k + 1, k + m + 1)):
      resumed["error"] = f"logged steps {steps}, expected {k + 1}..{k + m}"
      continue
    difference = max(abs(resumed["losses"][s] - reference["losses"][s]) for s in steps)
    resumed["loss_max_abs_diff"] = difference
    differences.append(difference)
  complete = len(differences) == len(args.reshard_to)
  result["loss_max_abs_diff"] = max(differences) if differences else None
  result["status"] = ("ok" if complete and max(differences) <= args.reshard_tolerance else
                      "mismatch" if complete else "error")
  return result


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  resharded = [args.reshard_from, *([] if args.reshard_same_gpus else args.reshard_to)]
  wanted = max([*args.gpus, *(resharded if args.reshard else [])])
  devices = visible_gpus(args.platform, wanted)
  report = Report(args, argv)
  report.data["visible_gpus"] = len(devices)
  budget = Budget(args.budget_s, args.case_timeout_s)
  groups = ProcessGroups()
  previous = {signum: signal.signal(signum, _raise_exit) for signum in (signal.SIGTERM,)}
  try:
    for preset, mode, gpus in case_plan(args, len(devices)):
      case = run_case(groups, args, budget, devices, preset, mode, gpus)
      report.add(case)
      print(f"{preset} {mode} x{gpus}: {case['status']}"
            f" {table_cell(case.get('tokens_per_s'), ',.0f')} tokens/s"
            f" {case.get('error', '')}".rstrip(), flush=True)
    if args.reshard:
      if args.reshard_from > len(devices):
        report.data["reshard"] = {"preset": args.reshard, "status": "skipped",
                                  "error": f"{args.reshard_from} GPUs needed, {len(devices)}"
                                           " visible"}
      else:
        report.data["reshard"] = run_reshard(groups, args, budget, devices)
      report.write()
  finally:
    groups.close()
    for signum, handler in previous.items():
      signal.signal(signum, handler)
  print(markdown_table(report.data["cases"]))
  reshard = report.data["reshard"]
  if reshard:
    print(f"reshard {reshard['preset']}: {reshard['status']}, largest |loss difference|"
          f" {table_cell(reshard.get('loss_max_abs_diff'), '.2e')} after resuming step"
          f" {args.reshard_steps[0]} of {args.reshard_from} processes on"
          f" {args.reshard_to} processes")
  failed = [c for c in report.data["cases"] if c["status"] not in ("ok", "oom", "skipped")]
  mismatched = [c for c in report.data["cases"] if c.get("losses_match_single") is False]
  return 1 if failed or mismatched or (reshard and reshard["status"] not in ("ok", "skipped")
                                       ) else 0


if __name__ == "__main__":
  sys.exit(main())
