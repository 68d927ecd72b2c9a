"""One run of the capacity study: train (resuming from its checkpoint), evaluate, diagnose.

    python tools/repro_run.py RUN_DIR      # RUN_DIR/run.json: {"model", "lr", "seed", "pairs",
                                           #                    "steps", "smoke"}

`tools/repro.py` writes run.json and starts this as a child process. The run trains with
checkpoints in RUN_DIR/checkpoints, so it continues from the newest one when started again; a
SIGTERM saves the current step and exits 0 without evaluating (the next start resumes). After
the last step it evaluates the exported float32 parameters and writes RUN_DIR/records.json, the
mark of a finished run:
- "select" / "test": `lalte_jax.eval.eviction_diagnostics.mqar_diagnostics` on the study's
  held-out long-gap MQAR splits (capped and uncapped accuracy; for LTE models availability,
  retention and kept counts). A run whose router was off throughout is evaluated with every token
  kept (uncapped only): that is the model it trained;
- "probes": for LTE models, dCE/dscore and retention of the queried values and of the fillers
  (`gradient_summary` on the first examples of "select") after step 1, at the end of the router
  warm-up (when there is one) and after the last step;
- "train": the trainer's summary and the median step time from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time


_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # before JAX creates a backend

import jax  # pylint: disable=wrong-import-position
from flax import nnx  # pylint: disable=wrong-import-position

from lalte_jax.configs.repro import capacity  # pylint: disable=wrong-import-position
from lalte_jax.eval import eviction_diagnostics  # pylint: disable=wrong-import-position
from lalte_jax.inference import checkpoint  # pylint: disable=wrong-import-position
from lalte_jax.model import count_parameters  # pylint: disable=wrong-import-position
from lalte_jax.train.checkpointing import RunCheckpoints  # pylint: disable=wrong-import-position
from lalte_jax.train.trainer import Trainer  # pylint: disable=wrong-import-position

from repro_report import RUN_FILE, read_spec  # pylint: disable=wrong-import-position  # tools/

RECORDS_FILE = "records.json"


def write_spec(run_dir: pathlib.Path, spec: capacity.RunSpec, smoke: bool) -> None:
  run_dir.mkdir(parents=True, exist_ok=True)
  data = {"model": spec.model, "lr": spec.lr, "seed": spec.seed, "pairs": spec.pairs,
          "steps": spec.steps, "smoke": smoke}
  (run_dir / RUN_FILE).write_text(json.dumps(data, indent=2) + "\n")


def _pace(stopped: dict, steps: int) -> str:
  """How fast a stopped run went in this invocation (compilation included) and how long the rest
  of its `steps` takes at that pace: what the next invocation's budget must hold to finish it."""
  done = stopped["stopped_at"] - stopped["started_at"]
  rate = done / stopped["elapsed_s"] if stopped["elapsed_s"] > 0 else 0.0
  left = steps - stopped["stopped_at"]
  finish = f"~{left / rate:,.0f} s" if rate > 0 else "unknown"
  return f"{done:,} steps at {rate:.1f} steps/s, {left:,} left ({finish} at that pace)"


def _median_step_time(metrics_path: pathlib.Path) -> float | None:
  if not metrics_path.is_file():
    return None
  times = [record["step_time_s"] for record in map(json.loads, metrics_path.read_text(
      ).splitlines()) if "step_time_s" in record]
  return statistics.median(times) if times else None


class _Probes:
  """A trainer callback that records `gradient_summary` after the steps in `steps`."""

  def __init__(self, run_dir: pathlib.Path, source, num_examples: int, steps):
    self.run_dir, self.source, self.steps = run_dir, source, set(steps)
    self.indices = range(num_examples)

  def measure(self, model) -> dict:
    return eviction_diagnostics.gradient_summary(model, self.source, self.indices)

  def __call__(self, trainer, step: int) -> None:
    if step in self.steps:
      model = nnx.merge(trainer.graphdef, trainer.state.params)
      path = self.run_dir / f"probe_step{step}.json"
      path.write_text(json.dumps(self.measure(model), indent=2) + "\n")

  def collected(self) -> dict:
    return {int(path.stem.removeprefix("probe_step")): json.loads(path.read_text())
            for path in sorted(self.run_dir.glob("probe_step*.json"))}


def run(run_dir: pathlib.Path) -> int:
  """Trains and evaluates the run of `run_dir`; 0 when finished or stopped by a signal."""
  if (run_dir / RECORDS_FILE).is_file():
    print(f"{run_dir}: already finished", flush=True)
    return 0
  spec, smoke = read_spec(run_dir)
  config = capacity.study_config(spec, output_dir=str(run_dir), smoke=smoke)
  model_config = config.model_config()
  is_lte = model_config.num_lte_layers > 0
  router_off = spec.model == capacity.ROUTER_OFF
  scale = capacity.SMOKE if smoke else capacity.FULL
  select = capacity.eval_source(spec, "select", smoke=smoke)
  probe_steps = {1, config.lte_routing_freeze_steps} - {0} if is_lte and not router_off else set()
  probes = _Probes(run_dir, select, scale.probe_examples, probe_steps)
  print(f"== {spec.name}: {count_parameters(model_config):,} parameters, {config.steps} steps,"
        f" router warm-up {config.lte_routing_freeze_steps}", flush=True)
  start = time.perf_counter()
  checkpoints = RunCheckpoints.for_run(config)
  try:
    trainer = Trainer(config, checkpoints=checkpoints)
    trainer.callbacks.append(probes)
    summary = trainer.run()
  finally:
    checkpoints.close()
  if "stopped_at" in summary:
    print(f"{spec.name}: stopped after step {summary['stopped_at']}; checkpoint saved;"
          f" {_pace(summary, config.steps)}", flush=True)
    return 0
  train_s = time.perf_counter() - start
  model = checkpoint.load_model(summary["export"], dtype="float32")
  if router_off:
    model = eviction_diagnostics.router_off_model(model)
  records = {"name": spec.name, "model": spec.model, "lr": spec.lr, "seed": spec.seed,
             "pairs": spec.pairs, "steps": spec.steps, "smoke": smoke,
             "trained_steps": config.steps, "trained_pairs": config.mqar_num_kv_pairs,
             "device": jax.devices()[0].device_kind,
             "params": count_parameters(model_config), "router_off": router_off,
             "train": dict(summary, train_s=round(train_s, 1),
                           step_time_s=_median_step_time(run_dir / "metrics.jsonl"))}
  for split in ("select", "test"):
    source = select if split == "select" else capacity.eval_source(spec, split, smoke=smoke)
    records[split] = eviction_diagnostics.mqar_diagnostics(model, source, capped=not router_off)
  if probe_steps:
    records["probes"] = probes.collected() | {config.steps: probes.measure(model)}
  records["eval_s"] = round(time.perf_counter() - start - train_s, 1)
  (run_dir / RECORDS_FILE).write_text(json.dumps(records, indent=2) + "\n")
  print(f"{spec.name}: test accuracy capped {records['test'].get('capped_accuracy')}, uncapped"
        f" {records['test']['uncapped_accuracy']:.1f}", flush=True)
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("run_dir", help="directory holding run.json")
  args = parser.parse_args(argv)
  run_dir = pathlib.Path(args.run_dir)
  if not (run_dir / RUN_FILE).is_file():
    print(f"error: {run_dir / RUN_FILE} does not exist", file=sys.stderr)
    return 2
  return run(run_dir)


if __name__ == "__main__":
  sys.exit(main())
