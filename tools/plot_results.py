"""Figures of the reproduction study (matplotlib, written as PNG files).

    python tools/plot_results.py --results runs/repro [--out runs/repro/figures]

From a results directory of `tools/repro.py` (or of `python -m lalte_jax.eval`) it draws
- `accuracy_vs_length.png`: accuracy (%) against evaluation length, one panel per task, one line
  per model (from `results.json`);
- `retention_heatmap.png`: the trained laLTE router's per-layer / per-head retention rate over the
  out-of-window positions (paper Fig. 5; from `<results>/lalte/retention.json`, or `--retention`);
- `lte_controller.png`: the sparsity weight lambda and the retention count c of every LTE layer
  and head over training, with the cap b (from `<results>/lalte/metrics.jsonl`, or `--metrics`).
- `training_loss.png`: every model's training loss against the step (from
  `<results>/<model>/metrics.jsonl` for each model of results.json);
- `kernel_speed_vs_length.png` (with `--kernel-bench FILE`, the `--json` output of
  tools/bench_attention.py): time of each attention kernel against the sequence length at a fixed
  token count, forward and forward+backward (paper Fig. 3 analogue).
Figures whose inputs are missing are skipped with a message. Needs matplotlib
(`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def _pyplot():
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise SystemExit("error: tools/plot_results.py needs matplotlib (pip install matplotlib)"
                     ) from None
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_accuracy_vs_length(results: dict, path: pathlib.Path) -> pathlib.Path:
  """One panel per task with a length, accuracy (%) against length, a line per model."""
  plt = _pyplot()
  default_model = results.get("model", "model")
  records = [r for r in results["results"] if r.get("length") is not None]
  if not records:
    raise ValueError("results: no record with a length to plot")
  tasks = list(dict.fromkeys(r["task"] for r in records))
  figure, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
  for axis, task in zip(axes[0], tasks):
    by_model: dict[str, list[tuple[int, float]]] = {}
    for record in records:
      if record["task"] == task:
        by_model.setdefault(record.get("model", default_model), []).append(
            (record["length"], record["value"]))
    for model, points in by_model.items():
      points.sort()
      axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model)
    axis.set_xscale("log", base=2)
    axis.set_xticks(sorted({r["length"] for r in records}))
    axis.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    axis.set_ylim(-2, 102)
    axis.set_title(task)
    axis.set_xlabel("evaluation length (tokens)")
    axis.set_ylabel("accuracy (%)")
    axis.grid(alpha=0.3)
  axes[0][-1].legend(fontsize="small")
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def plot_retention_heatmap(retention: dict, path: pathlib.Path) -> pathlib.Path:
  """Heatmap of `rate_oow` [L_lte, Hkv] with the values written in the cells."""
  plt = _pyplot()
  rates = retention["rate_oow"]
  figure, axis = plt.subplots(figsize=(1.2 + 1.1 * len(rates[0]), 1.2 + 0.7 * len(rates)))
  top = max(1e-6, max(max(row) for row in rates))
  image = axis.imshow(rates, vmin=0.0, vmax=top, cmap="viridis", aspect="auto")
  for layer, row in enumerate(rates):
    for head, value in enumerate(row):  # dark text on the bright end of viridis
      axis.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8,
                color="k" if value > 0.6 * top else "w")
  axis.set_xticks(range(len(rates[0])))
  axis.set_yticks(range(len(rates)))
  axis.set_xlabel("KV head")
  axis.set_ylabel("LTE layer")
  axis.set_title(f"out-of-window retention (w={retention.get('window')},"
                 f" b={retention.get('cap')})", fontsize=9)
  figure.colorbar(image, ax=axis)
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def read_metrics(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
          if line.strip()]


def plot_lte_controller(records: list[dict], path: pathlib.Path,
                        cap: float | None = None) -> pathlib.Path:
  """lambda and retention count per (LTE layer, head) against the step."""
  plt = _pyplot()
  records = [r for r in records if "lte_lambda" in r and r["lte_lambda"]]
  if not records:
    raise ValueError("metrics: no record with lte_lambda (not an LTE run?)")
  steps = [r["step"] for r in records]
  figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  num_layers, num_heads = len(records[0]["lte_lambda"]), len(records[0]["lte_lambda"][0])
  for layer in range(num_layers):
    for head in range(num_heads):
      label = f"layer {layer} head {head}"
      top.plot(steps, [r["lte_lambda"][layer][head] for r in records], label=label)
      bottom.plot(steps, [r["lte_retained"][layer][head] for r in records], label=label)
  top.set_yscale("symlog", linthresh=1e-9)
  top.set_ylabel("lambda")
  bottom.set_ylabel("retention count c")
  bottom.set_xlabel("step")
  if cap is not None:
    bottom.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"cap b={cap:g}")
  bottom.legend(fontsize="x-small", ncol=2)
  for axis in (top, bottom):
    axis.grid(alpha=0.3)
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def plot_training_loss(losses: dict[str, list[tuple[int, float]]],
                       path: pathlib.Path) -> pathlib.Path:
  """Training loss against the step, one line per model."""
  plt = _pyplot()
  figure, axis = plt.subplots(figsize=(7, 4))
  for model, points in losses.items():
    axis.plot([p[0] for p in points], [p[1] for p in points], label=model, linewidth=1)
  axis.set_xlabel("step")
  axis.set_ylabel("training loss (cross-entropy on the answers)")
  axis.grid(alpha=0.3)
  axis.legend(fontsize="small")
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def plot_kernel_speed(bench: dict, path: pathlib.Path) -> pathlib.Path:
  """ms against sequence length per kernel, one panel per mode (fwd, fwd+bwd)."""
  plt = _pyplot()
  timings = bench["timings"]
  if not timings:
    raise ValueError("kernel bench: no timings")
  modes = list(dict.fromkeys(t["mode"] for t in timings))
  figure, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
  for axis, mode in zip(axes[0], modes):
    by_kernel: dict[str, list[tuple[int, float]]] = {}
    for timing in timings:
      if timing["mode"] == mode:
        by_kernel.setdefault(timing["kernel"], []).append((timing["length"], timing["ms"]))
    for kernel, points in by_kernel.items():
      points.sort()
      axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=kernel)
    lengths = sorted({t["length"] for t in timings})
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths)
    axis.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    axis.set_xlabel("sequence length T (batch x T fixed)")
    axis.set_ylabel("ms per call")
    axis.set_title(f"{mode} ({bench.get('device', '')})", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize="x-small")
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def main(argv=None) -> list[pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--results", required=True, help="directory holding results.json")
  parser.add_argument("--out", help="figure directory (default: <results>/figures)")
  parser.add_argument("--lte-model", default="lalte", help="sub-directory of the LTE run")
  parser.add_argument("--retention", help="retention.json (default: <results>/<lte-model>/)")
  parser.add_argument("--metrics", help="metrics.jsonl (default: <results>/<lte-model>/)")
  parser.add_argument("--kernel-bench", help="JSON of tools/bench_attention.py --json")
  args = parser.parse_args(argv)
  results_dir = pathlib.Path(args.results)
  out = pathlib.Path(args.out) if args.out else results_dir / "figures"
  out.mkdir(parents=True, exist_ok=True)
  written = []
  results_path = results_dir / "results.json"
  if results_path.is_file():
    written.append(plot_accuracy_vs_length(json.loads(results_path.read_text()),
                                           out / "accuracy_vs_length.png"))
  else:
    print(f"skipped accuracy_vs_length: {results_path} does not exist", file=sys.stderr)
  retention_path = pathlib.Path(args.retention or results_dir / args.lte_model / "retention.json")
  cap = None
  if retention_path.is_file():
    retention = json.loads(retention_path.read_text())
    cap = retention.get("cap")
    written.append(plot_retention_heatmap(retention, out / "retention_heatmap.png"))
  else:
    print(f"skipped retention_heatmap: {retention_path} does not exist", file=sys.stderr)
  metrics_path = pathlib.Path(args.metrics or results_dir / args.lte_model / "metrics.jsonl")
  if metrics_path.is_file():
    written.append(plot_lte_controller(read_metrics(metrics_path), out / "lte_controller.png",
                                       cap=cap))
  else:
    print(f"skipped lte_controller: {metrics_path} does not exist", file=sys.stderr)
  losses = {}
  if results_path.is_file():
    for model in json.loads(results_path.read_text()).get("models", []):
      path = results_dir / model / "metrics.jsonl"
      if path.is_file():
        losses[model] = [(r["step"], r["ce_loss"]) for r in read_metrics(path) if "ce_loss" in r]
  if losses:
    written.append(plot_training_loss(losses, out / "training_loss.png"))
  else:
    print("skipped training_loss: no <results>/<model>/metrics.jsonl", file=sys.stderr)
  if args.kernel_bench:
    written.append(plot_kernel_speed(json.loads(pathlib.Path(args.kernel_bench).read_text()),
                                     out / "kernel_speed_vs_length.png"))
  for path in written:
    print(f"wrote {path}")
  return written


if __name__ == "__main__":
  main()
