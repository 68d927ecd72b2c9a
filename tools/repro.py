"""Reproduction study: trains the six small models of configs/repro one after another in this
process, evaluates each on long-gap MQAR and passkey (S-NIAH-1 in token ids) at lengths beyond
the attention windows, and writes `results.json`, `results.md` and per-model runs under --out.

    python tools/repro.py --out runs/repro                 # the study (GPU, ~8-10 minutes)
    python tools/repro.py --out /tmp/smoke --smoke         # pipeline check on a CPU
    python tools/plot_results.py --results runs/repro      # figures (see that script)

Why token-id tasks: at this scale a byte-level S-NIAH prompt is ~350 bytes of template before any
haystack, so 256-1024-token contexts would be mostly template; the passkey task keeps RULER's
S-NIAH-1 structure (repeated haystack, key, 7-digit value, depth from 40, answer prefix) on the
model's own vocabulary, and every model is trained on the same curriculum (short-gap MQAR,
long-gap MQAR, passkey; `lalte_jax.eval.recall.recall_curriculum`). Long-gap MQAR puts every
queried pair beyond every window (min_gap 63 for 64-key windows), so only the recurrent state,
LTE's kept tokens, NSA's selected blocks or full attention can answer.

Per model, under `--out/<model>`: the trainer's metrics.jsonl / summary.json, `export/` (the
params-only checkpoint, usable with `python -m lalte_jax.eval`). For laLTE, `retention.json`
holds the per-layer/per-head retention of the trained router (paper Fig. 5).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
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
  parser.add_argument("--steps", type=int, help="override the training steps of every model")
  parser.add_argument("--lengths", help="comma-separated eval lengths (default: the study's)")
  parser.add_argument("--num-examples", type=int, default=100, help="eval examples per length")
  parser.add_argument("--batch-size", type=int, default=16, help="eval batch size")
  parser.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                      help="kernel version of every token mixer (default: the platform's fastest)")
  parser.add_argument("--smoke", action="store_true", help="tiny models and steps (CPU check)")
  return parser.parse_args(argv)


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


def train_and_evaluate(variant: str, args, common) -> list[dict]:
  from train.export import export_state_params  # pylint: disable=import-outside-toplevel
  from train.trainer import Trainer  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(args.out)
  config = common.repro_config(variant, smoke=args.smoke, output_dir=str(out / variant))
  if args.steps is not None:
    config = config.replace(steps=args.steps, warmup_steps=min(config.warmup_steps,
                                                               args.steps - 1))
  if args.implementation is not None:
    from train import model_overrides  # pylint: disable=import-outside-toplevel
    extra = model_overrides.implementation_overrides(config.model_config(), args.implementation)
    config = config.replace(model_overrides=dict(config.model_overrides) | extra)
  long_gap = common.SMOKE_LONG_GAP if args.smoke else common.LONG_GAP
  lengths = (tuple(int(n) for n in args.lengths.split(",")) if args.lengths
             else common.SMOKE_EVAL_LENGTHS if args.smoke else common.EVAL_LENGTHS)
  model_config = config.model_config()
  curriculum = recall.recall_curriculum(
      seq_len=config.seq_len, vocab_size=model_config.vocab_size,
      num_kv_pairs=config.mqar_num_kv_pairs, long_gap=long_gap,
      num_examples=config.num_train_examples, seed=config.seed)
  print(f"== {variant}: {count_parameters(model_config):,} parameters, {config.steps} steps",
        flush=True)
  start = time.perf_counter()
  trainer = Trainer(config)
  trainer.data_iterator = make_dataset(
      curriculum, batch_size_per_process=config.global_batch_size // jax.process_count(),
      seed=config.seed, shuffle=True, process_index=jax.process_index(),
      process_count=jax.process_count())
  summary = trainer.run()
  train_seconds = time.perf_counter() - start
  export_dir = out / variant / "export"
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
    (out / variant / "retention.json").write_text(json.dumps(stats, indent=2) + "\n")
  for record in records:
    record.update(model=variant, params=count_parameters(model_config),
                  train_s=round(train_seconds, 1),
                  train_recall=summary.get("eval_recall_accuracy"))
  return records


def _write(args, common, models, records):
  payload = {"models": models, "smoke": args.smoke, "tasks": list(TASKS),
             "device": jax.devices()[0].device_kind, "results": records}
  markdown = ("# Reproduction study (configs/repro)\n\nAccuracy (%) on long-gap MQAR (teacher-"
              "forced, every queried pair beyond the windows) and passkey (S-NIAH-1 in token ids,"
              " greedy) at each evaluation length; training length "
              f"{common.repro_config(models[0], smoke=args.smoke).seq_len}."
              f" Device: {payload['device']}.\n\n"
              + report.comparison_table(records, "model", ("params", "train_s")))
  json_path, markdown_path = report.write_report(args.out, payload, markdown)
  return payload, json_path, markdown_path


def main(argv=None) -> dict:
  args = parse_args(argv)
  common = load_common()
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  unknown = [m for m in models if m not in common.MODELS]
  if unknown or not models:
    raise SystemExit(f"error: --models {unknown or models} not in {common.MODELS}")
  records = []
  for variant in models:
    records.extend(train_and_evaluate(variant, args, common))
    # Rewritten after every model, so that a run cut short still leaves its finished models.
    payload, json_path, markdown_path = _write(args, common, models, records)
  print(markdown_path.read_text())
  print(f"wrote {json_path}, {markdown_path}")
  return payload


if __name__ == "__main__":
  main()
