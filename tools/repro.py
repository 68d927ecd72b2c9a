"""Reproduction study: trains the six small models of lalte_jax/configs/repro one after another in this
process, evaluates each on long-gap MQAR and passkey (S-NIAH-1 in token ids) at lengths beyond
the attention windows, and writes `results.json`, `results.md` and per-model runs under --out.

    python tools/repro.py --out runs/repro --parallel 12    # the study (one GPU, ~8 minutes)
    python tools/repro.py --out /tmp/smoke --smoke         # pipeline check on a CPU
    python tools/plot_results.py --results runs/repro      # figures (see that script)

Why token-id tasks: at this scale a byte-level S-NIAH prompt is ~350 bytes of template before any
haystack, so 256-1024-token contexts would be mostly template; the passkey task keeps RULER's
S-NIAH-1 structure (repeated haystack, key, 7-digit value, depth from 40, answer prefix) on the
model's own vocabulary, and every model is trained on the same curriculum (short-gap MQAR,
long-gap MQAR, passkey; `lalte_jax.eval.recall.recall_curriculum`). Long-gap MQAR puts every
queried pair beyond every window (min_gap 31 for 32-key windows), so only the recurrent state,
LTE's kept tokens, NSA's selected blocks or full attention can answer.

Every model trains at each learning rate of the study's sweep (`LEARNING_RATES`); each (model,
lr) run lives in `--out/runs/<model>_lr<lr>/` (the trainer's metrics.jsonl / summary.json,
`export/` = the params-only checkpoint usable with `python -m lalte_jax.eval`, `records.json` = its
evaluation, `log.txt` when run as a child process). Per model, the run with the best held-out
long-gap recall during training (the trainer's own eval set, not the test examples) is reported;
its metrics.jsonl, summary.json and, for laLTE, `retention.json` (per-layer/per-head retention of
the trained router, paper Fig. 5) are copied to `--out/<model>/`. `--parallel N` runs N trainings
at once as child processes: the tiny models leave a GPU mostly idle, so sharing it is nearly free.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

if "xla_cpu_use_xnnpack" not in os.environ.get("XLA_FLAGS", ""):  # jaxlib 0.10.2 CPU deadlock
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=false"
                             ).strip()

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

import jax  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from lalte_jax.data import make_dataset  # pylint: disable=wrong-import-position
from lalte_jax.eval import recall, report, suite  # pylint: disable=wrong-import-position
from lalte_jax.inference import checkpoint  # pylint: disable=wrong-import-position
from lalte_jax.model import count_parameters  # pylint: disable=wrong-import-position

TASKS = ("mqar_long_gap", "passkey")


def load_common():
  spec = importlib.util.spec_from_file_location("_repro_common",
                                                _REPO_ROOT / "configs" / "repro" / "common.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def parse_args(argv):
  common = load_common()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--out", default="runs/repro", help="output directory")
  parser.add_argument("--models", default=",".join(common.MODELS),
                      help=f"comma-separated subset of {','.join(common.MODELS)}")
  parser.add_argument("--setting", default="base", choices=sorted(common.SETTINGS),
                      help="pairs per sequence and GDN state size (lalte_jax/configs/repro/common.py)")
  parser.add_argument("--steps", type=int, help="override the training steps of every model")
  parser.add_argument("--train-batch", type=int,
                      help="override the training batch (sequences per step) of every model")
  parser.add_argument("--lengths", help="comma-separated eval lengths (default: the study's)")
  parser.add_argument("--num-examples", type=int, default=100, help="eval examples per length")
  parser.add_argument("--batch-size", type=int, default=16, help="eval batch size")
  parser.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                      help="kernel version of every token mixer (default: the platform's fastest)")
  parser.add_argument("--lrs", help="comma-separated learning rates (default: the study's sweep)")
  parser.add_argument("--parallel", type=int, default=1,
                      help="trainings run at once as child processes (1: all in this process)")
  parser.add_argument("--deadline-s", type=float, default=None,
                      help="with --parallel: after this many seconds, stop the trainings still"
                           " going (they evaluate what they have) and start no new ones")
  parser.add_argument("--grace-s", type=float, default=150.0,
                      help="after --deadline-s: seconds left to the stopped runs to evaluate")
  parser.add_argument("--report-only", action="store_true",
                      help="train nothing: rebuild results.json/.md from the runs under --out"
                           " (e.g. runs of one study trained in several calls)")
  parser.add_argument("--smoke", action="store_true", help="tiny models and steps (CPU check)")
  parser.add_argument("--single-run", help=argparse.SUPPRESS)  # "<model>:<lr>", child mode
  args = parser.parse_args(argv)
  if args.parallel < 1:
    parser.error(f"--parallel must be >= 1, got {args.parallel}")
  if args.train_batch is not None and args.train_batch < 1:
    parser.error(f"--train-batch must be >= 1, got {args.train_batch}")
  return args


def retention_stats(model, curriculum, num_sequences: int = 16) -> dict:
  """Router retention of a trained LTE model on `num_sequences` curriculum sequences.

  rate_oow [L_lte, Hkv]: fraction of the positions that are out of the window of the last query
  (j < T - (w + 1)) whose score is > 0 (kept), averaged over sequences (paper App. B);
  count [L_lte, Hkv]: the model's retention count c (every position j < T - margin, §4.5).
  """
  tokens = np.stack([curriculum[i]["tokens"] for i in range(num_sequences)])
  _, aux = model(tokens, return_aux=True)
  scores_LBTH = np.asarray(aux.lte_scores)
  out_of_window = tokens.shape[1] - model.config.lte.window_keys
  rate_LH = (scores_LBTH[:, :, :out_of_window] > 0).mean(axis=(1, 2))
  return {"rate_oow": rate_LH.tolist(), "count": np.asarray(aux.lte_retained).mean(1).tolist(),
          "seq_len": int(tokens.shape[1]), "window": model.config.lte.window,
          "cap": model.config.lte.cap, "num_sequences": num_sequences}


def run_dir(out: pathlib.Path, variant: str, lr: float) -> pathlib.Path:
  return out / "runs" / f"{variant}_lr{lr:g}"


def train_and_evaluate(variant: str, lr: float, args, common) -> list[dict]:
  """Trains one (model, lr) run on the curriculum, evaluates it, writes its records.json."""
  from lalte_jax.train.export import export_state_params  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel
  directory = run_dir(pathlib.Path(args.out), variant, lr)
  config = common.repro_config(variant, smoke=args.smoke, output_dir=str(directory), lr=lr,
                               setting=args.setting)
  if args.steps is not None:
    config = config.replace(steps=args.steps, warmup_steps=min(config.warmup_steps,
                                                               args.steps - 1))
  if args.train_batch is not None:
    config = config.replace(global_batch_size=args.train_batch)
  if args.implementation is not None:
    from lalte_jax.train import model_overrides  # pylint: disable=import-outside-toplevel
    extra = model_overrides.implementation_overrides(config.model_config(), args.implementation)
    config = config.replace(model_overrides=dict(config.model_overrides) | extra)
  long_gap = common.SMOKE_LONG_GAP if args.smoke else common.LONG_GAP
  lengths = (tuple(int(n) for n in args.lengths.split(",")) if args.lengths
             else common.SMOKE_EVAL_LENGTHS if args.smoke else common.EVAL_LENGTHS)
  model_config = config.model_config()
  # Short-gap MQAR alone for the first SHORT_GAP_STEPS (scaled with --steps), read in order.
  short_gap_steps = common.SHORT_GAP_STEPS * config.steps // common.STEPS
  curriculum = recall.recall_curriculum(
      seq_len=config.seq_len, vocab_size=model_config.vocab_size,
      num_kv_pairs=config.mqar_num_kv_pairs, long_gap=long_gap,
      num_examples=config.num_train_examples, seed=config.seed,
      warmup_examples=short_gap_steps * config.global_batch_size)
  print(f"== {variant} lr {lr:g}: {count_parameters(model_config):,} parameters, {config.steps}"
        f" steps ({short_gap_steps} short-gap first)", flush=True)
  if args.single_run:
    # The parent's deadline SIGTERM must only cut training short: the trainer turns it into a stop
    # while its loop runs and restores this handler after, so the evaluation is never killed by
    # it (the parent kills the child outright after its grace period).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
  start = time.perf_counter()
  trainer = Trainer(config)
  trainer.data_iterator = make_dataset(
      curriculum, batch_size_per_process=config.global_batch_size // jax.process_count(),
      seed=config.seed, shuffle=False, process_index=jax.process_index(),
      process_count=jax.process_count())
  summary = trainer.run()
  if "stopped_at" in summary:  # cut by the deadline: the held-out recall of what it learned
    summary.update(trainer.evaluate())
  steps_trained = summary.get("stopped_at", config.steps)
  train_seconds = time.perf_counter() - start
  export_dir = directory / "export"
  if not (export_dir / "model.json").is_file():  # the trainer may export by itself
    export_state_params(trainer.state.params, trainer.model_config, export_dir)
  model = checkpoint.load_model(export_dir, dtype="float32")
  options = suite.EvalOptions(
      tasks=TASKS, lengths=lengths, num_examples=args.num_examples, batch_size=args.batch_size,
      mqar_num_kv_pairs=config.mqar_num_kv_pairs, mqar_min_gap=long_gap, progress=not args.smoke)
  records = suite.run_suite(model, options)
  if model.config.num_lte_layers:
    eval_curriculum = recall.recall_curriculum(
        seq_len=config.seq_len, vocab_size=model_config.vocab_size,
        num_kv_pairs=config.mqar_num_kv_pairs, long_gap=long_gap, num_examples=64,
        seed=recall.EVAL_SEED)
    stats = retention_stats(model, eval_curriculum)
    (directory / "retention.json").write_text(json.dumps(stats, indent=2) + "\n")
  for record in records:
    record.update(model=variant, lr=lr, params=count_parameters(model_config),
                  steps=steps_trained, train_s=round(train_seconds, 1),
                  train_recall=summary.get("eval_recall_accuracy"))
  (directory / "records.json").write_text(json.dumps(records, indent=2, default=str) + "\n")
  return records


def run_children(jobs, args, argv) -> None:
  """Runs each (model, lr) of `jobs` as `repro.py --single-run`, `args.parallel` at a time."""
  out = pathlib.Path(args.out)
  pending, running = list(jobs), []
  deadline = None if args.deadline_s is None else time.monotonic() + args.deadline_s
  while pending or running:
    if deadline is not None and time.monotonic() > deadline:
      # SIGTERM: the trainer saves and returns early, so the child still evaluates what it has
      # (records say how many steps it trained); a child still busy after the grace is killed.
      for _, _, process, _ in running:
        process.terminate()
      for variant, lr in pending:
        print(f"   {variant} lr {lr:g}: not started before the deadline", flush=True)
      pending, deadline = [], None
      grace_end = time.monotonic() + args.grace_s
    if deadline is None and args.deadline_s is not None and time.monotonic() > grace_end:
      for variant, lr, process, log in running:
        process.kill()
        process.wait()
        log.close()
        print(f"   {variant} lr {lr:g}: killed after the grace period", flush=True)
      return
    while pending and len(running) < args.parallel:
      variant, lr = pending.pop(0)
      directory = run_dir(out, variant, lr)
      directory.mkdir(parents=True, exist_ok=True)
      log = (directory / "log.txt").open("w")
      command = [sys.executable, __file__, *argv, "--single-run", f"{variant}:{lr!r}"]
      running.append((variant, lr, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT),
                      log))
    time.sleep(2)
    for job in list(running):
      variant, lr, process, log = job
      if process.poll() is not None:
        log.close()
        running.remove(job)
        print(f"   {variant} lr {lr:g}: exit {process.returncode}"
              f" (log {run_dir(out, variant, lr) / 'log.txt'})", flush=True)


def select_runs(out: pathlib.Path, models, lrs) -> tuple[list[dict], list[dict]]:
  """(records of each model's best run, records of every finished run). A model's best run has the
  highest held-out training recall; its small files are copied to `out/<model>/`."""
  chosen, every = [], []
  for variant in models:
    runs = []
    for lr in lrs:
      path = run_dir(out, variant, lr) / "records.json"
      if path.is_file():
        runs.append((lr, json.loads(path.read_text())))
    if not runs:
      continue
    for _, records in runs:
      every.extend(records)
    best_lr, best = max(runs, key=lambda run: run[1][0].get("train_recall") or 0.0)
    source, target = run_dir(out, variant, best_lr), out / variant
    target.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "summary.json", "retention.json"):
      if (source / name).is_file():
        shutil.copyfile(source / name, target / name)
    chosen.extend(best)
  return chosen, every


def _write(args, common, models, records, every):
  device = jax.devices()[0].device_kind
  previous = pathlib.Path(args.out) / "results.json"
  if args.report_only and previous.is_file():  # the device that trained, not this one
    device = json.loads(previous.read_text()).get("device", device)
  payload = {"models": models, "smoke": args.smoke, "setting": args.setting, "tasks": list(TASKS),
             "device": device, "results": records, "all_runs": every}
  config = common.repro_config(models[0], smoke=args.smoke, setting=args.setting)
  markdown = (f"# Reproduction study (lalte_jax/configs/repro, setting {args.setting})\n\nAccuracy (%) on"
              " long-gap MQAR (teacher-forced, every queried pair beyond the windows;"
              f" {config.mqar_num_kv_pairs} pairs) and passkey (S-NIAH-1 in token ids, greedy) at"
              f" each evaluation length; training length {config.seq_len}; per model the"
              " learning rate with the best held-out training recall (train_recall, a fraction)."
              f" Device: {payload['device']}.\n\n"
              + report.comparison_table(records, "model", ("params", "lr", "steps",
                                                           "train_recall", "train_s"))
              + "\n\nEvery run of the learning-rate sweep:\n\n"
              + report.comparison_table(
                  [dict(r, run=f"{r['model']} lr {r['lr']:g}") for r in every], "run",
                  ("steps", "train_recall", "train_s")))
  json_path, markdown_path = report.write_report(args.out, payload, markdown)
  return payload, json_path, markdown_path


def main(argv=None) -> dict | None:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  common = load_common()
  if args.single_run:
    variant, lr = args.single_run.split(":")
    train_and_evaluate(variant, float(lr), args, common)
    return None
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = [m for m in models if m not in common.MODELS]
  if unknown or not models:
    raise SystemExit(f"error: --models {unknown or models} not in {common.MODELS}")
  lrs = ([float(x) for x in args.lrs.split(",")] if args.lrs
         else list(common.LEARNING_RATES[:1] if args.smoke else common.LEARNING_RATES))
  out = pathlib.Path(args.out)
  jobs = [(variant, lr) for variant in models for lr in lrs]
  in_process = args.parallel == 1 and not args.report_only
  if args.parallel > 1 and not args.report_only:
    run_children(jobs, args, argv)
  for variant, lr in jobs:
    if in_process:
      train_and_evaluate(variant, lr, args, common)
    # Rewritten after every run, so that a run cut short still leaves its finished models.
    records, every = select_runs(out, models, lrs)
    if records:
      payload, json_path, markdown_path = _write(args, common, models, records, every)
  if not records:
    raise SystemExit(f"error: no run finished; see the logs under {out / 'runs'}")
  print(markdown_path.read_text())
  print(f"wrote {json_path}, {markdown_path}")
  return payload


if __name__ == "__main__":
  main()
