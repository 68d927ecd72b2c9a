"""The capacity study (lalte_jax/configs/repro/capacity.py): plans, runs and reports its trainings.

    python tools/repro.py --out runs/capacity --parallel 12 --budget-s 480   # one GPU
    python tools/repro.py --out runs/capacity --report-only                  # tables only
    python tools/repro.py --out /tmp/smoke --smoke --models lalte_warmup     # pipeline check
    python tools/plot_results.py --results runs/capacity                    # figures

The plan, in order (each stage starts for a model as soon as the stage before gives what it
needs, so one invocation may run several stages):
1. sweep: every model of MODELS and CHECKS at every learning rate (`--lrs`), seed 0, P = 96;
2. seeds: the other seeds (`--seeds`) of every model at its chosen lr (the sweep run with the
   best capped accuracy on the held-out "select" split; uncapped for the router-off check);
3. control: every model of `--models` in CONTROL_MODELS at its chosen lr with P = 8
   (`--control-steps` steps; a fork's control forks its parent's control);
4. forks (`capacity.FORKS`): every seed at the parent's lr, once the parent's run has saved the
   end of its router warm-up (the parent keeps that checkpoint; it is copied into the fork's
   run directory with the parent's metrics and probe up to it, and the fork resumes from it).
   A fork's parent is trained even when `--models` does not name it.
Each run lives in `--out/runs/<name>/` (tools/repro_run.py: run.json, the trainer's metrics and
checkpoints, `export/`, `records.json` once finished, `log.txt`) and runs as a child process,
`--parallel` at once: the small models leave a GPU mostly idle, so sharing it is nearly free.

Resuming: the study is a pure function of what is on disk. An invocation skips finished runs
(records.json), resumes unfinished ones from their newest checkpoint, and starts the rest.
With `--budget-s` it starts no run when less than `--min-start-s` remain, and `--grace-s` before
the end it sends SIGTERM to the runs still training: they save their step and exit (a child still
busy after the grace is killed; it resumes from its previous checkpoint). A run that has trained
its last step and is evaluating gets the grace period to finish instead. Then it writes
results.json / results.md and every run's training curve, trajectories.json
(tools/repro_report.py). Run the same command again to continue; `tools/repro_state.py` packs
what a later invocation on another machine needs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

_TOOLS = pathlib.Path(__file__).resolve().parent
for _path in (str(_TOOLS.parent), str(_TOOLS)):  # run as a script from a checkout
  if _path not in sys.path:
    sys.path.insert(0, _path)

import repro_report  # pylint: disable=wrong-import-position
import repro_run  # pylint: disable=wrong-import-position
import repro_state  # pylint: disable=wrong-import-position

from lalte_jax.configs.repro import capacity  # pylint: disable=wrong-import-position
from lalte_jax.train.checkpointing import CHECKPOINT_DIR  # pylint: disable=wrong-import-position
from lalte_jax.train.trainer import SUMMARY_FILE  # pylint: disable=wrong-import-position


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n", 1)[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--out", default="runs/capacity", help="study directory")
  parser.add_argument("--models", default=",".join(capacity.ALL_MODELS),
                      help=f"comma-separated subset of {','.join(capacity.ALL_MODELS)}")
  parser.add_argument("--lrs", default=",".join(f"{x:g}" for x in capacity.LEARNING_RATES),
                      help="learning rates of the sweep")
  parser.add_argument("--seeds", default=",".join(map(str, capacity.SEEDS)),
                      help="seed indices of the final runs (0 is the sweep's)")
  parser.add_argument("--steps", type=int, default=capacity.STEPS, help="steps of a P=96 run")
  parser.add_argument("--control-steps", type=int, default=capacity.CONTROL_STEPS,
                      help="steps of a P=8 control run (0: no controls)")
  parser.add_argument("--parallel", type=int, default=1, help="runs at once (child processes)")
  parser.add_argument("--devices", default="",
                      help="comma-separated GPU ids (e.g. 0,1,2,3): each run starts on the one"
                           " running the fewest runs (CUDA_VISIBLE_DEVICES); default: every run"
                           " sees the machine's devices and uses the first")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="wall-clock seconds for this invocation (default: no limit)")
  parser.add_argument("--min-start-s", type=float, default=150.0,
                      help="with --budget-s: start no run when fewer seconds remain")
  parser.add_argument("--grace-s", type=float, default=45.0,
                      help="with --budget-s: seconds before the end at which running runs are"
                           " told to save and stop")
  parser.add_argument("--report-only", action="store_true",
                      help="train nothing: rebuild results.json/.md from the finished runs")
  parser.add_argument("--smoke", action="store_true",
                      help="the shrunk CPU scale of capacity.SMOKE (checks the pipeline)")
  args = parser.parse_args(argv)
  try:
    args.models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    args.lrs, args.seeds = _floats(args.lrs), _ints(args.seeds)
    args.devices = tuple(str(device) for device in _ints(args.devices))
  except ValueError as error:
    parser.error(f"--lrs/--seeds/--devices: {error}")
  unknown = [m for m in args.models if m not in capacity.ALL_MODELS]
  if unknown or not args.models:
    parser.error(f"--models: {list(unknown or args.models)} not in {capacity.ALL_MODELS}")
  if not args.lrs or min(args.lrs) <= 0 or not args.seeds or min(args.seeds) < 0:
    parser.error("--lrs must be positive and --seeds non-negative, neither empty")
  if args.parallel < 1 or args.steps < 1 or args.control_steps < 0:
    parser.error("--parallel and --steps must be >= 1, --control-steps >= 0")
  return args


def run_dir(out: pathlib.Path, spec: capacity.RunSpec) -> pathlib.Path:
  return out / repro_report.RUNS_DIR / spec.name


class OtherRunError(ValueError):
  """A run directory of the planned name holds a run of other settings."""


def is_finished(out: pathlib.Path, spec: capacity.RunSpec) -> bool:
  """Whether `spec`'s run has its records. Run names leave out the step count, so a directory of
  the same name may hold the run of another study (e.g. one of fewer steps): that is an error,
  since its records would be taken for this run's, or its checkpoint resumed under another
  schedule."""
  directory = run_dir(out, spec)
  stored = []
  if (directory / repro_report.RUN_FILE).is_file():
    stored.append(repro_report.read_spec(directory)[0])
  records_path = directory / repro_run.RECORDS_FILE
  if records_path.is_file():
    record = json.loads(records_path.read_text())
    stored.append(repro_report.record_spec(record))
  for other in stored:
    if other != spec:
      raise OtherRunError(f"{directory} holds the run {other}, not the planned {spec}: give this"
                          " study its own --out")
  return records_path.is_file()


def plan(args, records: list[dict]) -> list[capacity.RunSpec]:
  """Every run the study needs now, in order: the sweep, then the seeds and the controls of the
  models whose learning rate is chosen (from the finished `records`), then the forks (every seed
  at the parent's lr, P = 96 only; their parents are trained too)."""
  forks = [m for m in args.models if m in capacity.FORKS]
  parents = [capacity.FORKS[m] for m in forks if capacity.FORKS[m] not in args.models]
  own = [m for m in args.models if m not in capacity.FORKS] + list(dict.fromkeys(parents))
  specs = [capacity.RunSpec(m, lr, 0, capacity.NUM_KV_PAIRS, args.steps)
           for m in own for lr in args.lrs]
  # The checks run every seed too: seed-to-seed spread is larger than the checks' margins.
  chosen = repro_report.choose_lrs(records, own + forks, args.lrs, capacity.NUM_KV_PAIRS,
                                   args.steps)
  specs += [capacity.RunSpec(m, chosen[m], seed, capacity.NUM_KV_PAIRS, args.steps)
            for m in own if m in chosen for seed in args.seeds if seed != 0]
  if args.control_steps:  # a fork's control is a fork of its parent's control
    controls = [capacity.RunSpec(m, chosen[m], 0, capacity.CONTROL_KV_PAIRS, args.control_steps)
                for m in args.models if m in capacity.CONTROL_MODELS and m in chosen]
    specs += list(dict.fromkeys(run for control in controls
                                for run in (capacity.fork_parent(control), control) if run))
  specs += [capacity.RunSpec(m, chosen[m], seed, capacity.NUM_KV_PAIRS, args.steps)
            for m in forks if m in chosen for seed in args.seeds]
  return specs


def has_checkpoint(directory: pathlib.Path) -> bool:
  """Whether a run directory holds a finished checkpoint (Orbax renames a save when done)."""
  return repro_state.checkpoint_step(directory) >= 0


class ForkUnavailable(ValueError):
  """The parent of a fork finished without the checkpoint the fork starts from."""


def make_fork(out: pathlib.Path, spec: capacity.RunSpec, smoke: bool) -> bool:
  """Starts the run of fork `spec` from its parent's checkpoint at `capacity.fork_step` once the
  parent has it: the checkpoint (copied under a temporary name, then renamed, so that a copy cut
  short is never taken for one), the parent's metrics up to that step and its probe there.
  True once the fork's directory holds a checkpoint (or the fork has finished), False while the
  parent has not reached that step; ForkUnavailable when it finished without it."""
  child = run_dir(out, spec)
  if has_checkpoint(child) or is_finished(out, spec):
    return True
  parent = run_dir(out, capacity.fork_parent(spec))
  step = capacity.fork_step(spec, smoke=smoke)
  source = parent / CHECKPOINT_DIR / str(step)
  if not source.is_dir():
    if (parent / repro_run.RECORDS_FILE).is_file():
      raise ForkUnavailable(f"{parent.name} finished without its step-{step} checkpoint")
    return False
  repro_run.write_spec(child, spec, smoke)
  partial = child / CHECKPOINT_DIR / f".{step}.copy"
  shutil.rmtree(partial, ignore_errors=True)
  shutil.copytree(source, partial)
  partial.rename(child / CHECKPOINT_DIR / str(step))
  # Whole lines only: the parent may still be appending to its log.
  lines = (parent / "metrics.jsonl").read_text().split("\n")[:-1]
  (child / "metrics.jsonl").write_text("".join(
      line + "\n" for line in lines if json.loads(line).get("step", 0) <= step))
  probe = parent / f"probe_step{step}.json"
  if probe.is_file():
    shutil.copy2(probe, child / probe.name)
  print(f"   fork {spec.name} from {parent.name} at step {step}", flush=True)
  return True


class Scheduler:
  """Starts the planned runs as child processes, `parallel` at once, within a time budget."""

  def __init__(self, args, out: pathlib.Path):
    self.args, self.out = args, out
    self.start = time.monotonic()
    self.running: dict[str, tuple[subprocess.Popen, object]] = {}
    self.device_of: dict[str, str] = {}  # run name -> GPU id, with --devices
    self.failed: set[str] = set()  # not retried in this invocation

  def time_left(self) -> float:
    if self.args.budget_s is None:
      return float("inf")
    return self.args.budget_s - (time.monotonic() - self.start)

  def planned(self) -> list[capacity.RunSpec]:
    return plan(self.args, repro_report.load_records(self.out))

  def pending(self, specs: list[capacity.RunSpec] | None = None) -> list[capacity.RunSpec]:
    """The runs of `specs` (default: the plan) that can start now (a fork once its directory
    holds the parent's checkpoint: `make_forks`)."""
    return [spec for spec in (self.planned() if specs is None else specs)
            if not is_finished(self.out, spec) and spec.name not in self.running
            and spec.name not in self.failed
            and (spec.model not in capacity.FORKS or has_checkpoint(run_dir(self.out, spec)))]

  def make_forks(self, specs: list[capacity.RunSpec]) -> None:
    """`make_fork` for every fork of `specs`, naming once each that cannot be made."""
    for spec in specs:
      if spec.model in capacity.FORKS and spec.name not in self.failed:
        try:
          make_fork(self.out, spec, self.args.smoke)
        except ForkUnavailable as error:
          self.failed.add(spec.name)
          print(f"   {spec.name}: cannot fork, {error}", flush=True)

  def next_device(self) -> str | None:
    """The GPU of `--devices` that runs the fewest runs now (the first of equals), or None."""
    if not self.args.devices:
      return None
    load = collections.Counter(self.device_of[name] for name in self.running)
    return min(self.args.devices, key=lambda device: load[device])

  def launch(self, spec: capacity.RunSpec) -> None:
    directory = run_dir(self.out, spec)
    repro_run.write_spec(directory, spec, self.args.smoke)
    log = (directory / "log.txt").open("a")
    command = [sys.executable, str(_TOOLS / "repro_run.py"), str(directory)]
    device = self.next_device()
    env = None if device is None else dict(os.environ, CUDA_VISIBLE_DEVICES=device)
    self.running[spec.name] = (
        subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    if device is not None:
      self.device_of[spec.name] = device
    print(f"   start {spec.name}" + ("" if device is None else f" on GPU {device}"), flush=True)

  def reap(self) -> None:
    for name, (process, log) in list(self.running.items()):
      if process.poll() is None:
        continue
      log.close()
      del self.running[name]
      finished = (self.directory(name) / repro_run.RECORDS_FILE).is_file()
      if process.returncode != 0:
        self.failed.add(name)
      print(f"   {name}: exit {process.returncode}"
            f" ({'finished' if finished else 'not finished'})", flush=True)

  def directory(self, name: str) -> pathlib.Path:
    return self.out / repro_report.RUNS_DIR / name

  def evaluating(self, name: str) -> bool:
    """Whether run `name` has trained its last step and is evaluating (no records yet)."""
    return (self.directory(name) / SUMMARY_FILE).is_file() and not (
        self.directory(name) / repro_run.RECORDS_FILE).is_file()

  def stop_all(self) -> None:
    """SIGTERM to every run that still trains (they save and exit), SIGKILL to those still going
    after the grace period. A run that is evaluating gets the grace period to finish: a stop would
    lose its evaluation and leave a finished run's checkpoint to carry to the next invocation."""
    for name, (process, _) in self.running.items():
      if self.evaluating(name):
        print(f"   {name}: evaluating, left to finish within the grace period", flush=True)
      else:
        process.terminate()
    end = time.monotonic() + self.args.grace_s
    while self.running and time.monotonic() < end:
      time.sleep(1)
      self.reap()
    for name, (process, log) in list(self.running.items()):
      process.kill()
      process.wait()
      log.close()
      del self.running[name]
      print(f"   {name}: killed after the grace period", flush=True)

  def run(self) -> None:
    try:
      self._schedule()
    finally:  # also on Ctrl-C or an error: no run is left behind
      if self.running:
        self.stop_all()
      self.make_forks(self.planned())  # from the stopped runs' checkpoints, for the next one

  def _schedule(self) -> None:
    while True:
      self.reap()
      specs = self.planned()
      self.make_forks(specs)
      if self.time_left() <= self.args.grace_s:
        if self.running:
          print(f"== budget: stopping {sorted(self.running)}", flush=True)
          self.stop_all()
        return
      pending = self.pending(specs)
      while pending and len(self.running) < self.args.parallel \
          and self.time_left() > self.args.min_start_s:
        self.launch(pending.pop(0))
      if not self.running:
        if pending:
          print(f"== budget: {len(pending)} runs not started", flush=True)
        return
      time.sleep(2)


def report(args, out: pathlib.Path) -> dict:
  """Writes results.json / results.md from the finished runs; returns the payload."""
  records = repro_report.load_records(out)
  payload = repro_report.summarize(
      records, models=[m for m in args.models if m in capacity.MODELS], lrs=args.lrs,
      seeds=args.seeds, steps=args.steps, control_steps=args.control_steps)
  device = ", ".join(sorted({r["device"] for r in records})) or "none yet"
  payload.update(device=device, smoke=args.smoke, models=list(args.models), lrs=list(args.lrs),
                 seeds=list(args.seeds), steps=args.steps, control_steps=args.control_steps,
                 pending=[s.name for s in plan(args, records) if not is_finished(out, s)])
  (out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
  (out / "results.md").write_text(repro_report.markdown(payload, device))
  runs = sorted(path for path in (out / repro_report.RUNS_DIR).glob("*") if path.is_dir())
  curves = {"what": repro_report.TRAJECTORY_FIELDS,
            "runs": {path.name: repro_report.trajectory(path) for path in runs}}
  (out / "trajectories.json").write_text(json.dumps(curves) + "\n")
  return payload


def main(argv=None) -> dict:
  args = parse_args(sys.argv[1:] if argv is None else list(argv))
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  try:
    if not args.report_only:
      Scheduler(args, out).run()
    payload = report(args, out)
  except OtherRunError as error:
    raise SystemExit(f"error: {error}") from None
  print((out / "results.md").read_text())
  print(f"{len(payload['runs'])} runs finished, {len(payload['pending'])} pending; wrote"
        f" {out / 'results.json'}, {out / 'results.md'}", flush=True)
  return payload


if __name__ == "__main__":
  main()
