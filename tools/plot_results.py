"""Figures of the capacity study and of evaluation results (matplotlib, written as PNG files).

    python tools/plot_results.py --results runs/capacity [--out runs/capacity/figures]

From a study directory of `tools/repro.py` (results.json with the chosen learning rates, the
main-table rows and every run's records) it draws
- `accuracy_by_model.png`: long-gap MQAR test accuracy (%) per model at its chosen lr, capped
  and uncapped (bars: mean over the seeds, dots: each seed), and the P = 8 control;
- `availability.png`: for the LTE models, the share of queried values visible at their query
  (availability, capped and uncapped) and the retention of queried values and of fillers (%);
- `retention_heatmap.png`: per LTE model (seed 0 at its lr), the retention of queried values and
  of fillers per LTE layer and KV head (score > 0 among the out-of-window candidates);
- `lte_controller.png`: the sparsity weight lambda and the retention count c of every LTE layer
  and head over training for each LTE model (seed 0 at its lr), with the cap b;
- `training_loss.png`: each model's training loss against the step (seed 0 at its lr);
- `router_switch.png`: for each model with a router warm-up, every seed's training loss (top)
  and kept tokens per KV head (bottom) from 100 steps before to 3000 after the end of the
  warm-up (from trajectories.json).
From a results directory of `python -m lalte_jax.eval` (records with lengths) it draws
`accuracy_vs_length.png`; with `--kernel-bench FILE` (the `--json` output of
tools/bench_attention.py) `kernel_speed_vs_length.png`: time of each attention kernel against
the sequence length at a fixed token count (paper Fig. 3 analogue). Figures whose inputs are
missing are skipped with a message. Needs matplotlib (`pip install matplotlib`).
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


def read_metrics(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
          if line.strip()]


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


# ------------------------------------------------------------------------------------------------
# The capacity study (results.json of tools/repro.py)


def _save(figure, plt, path: pathlib.Path) -> pathlib.Path:
  figure.tight_layout()
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def chosen_runs(results: dict) -> dict[str, dict]:
  """{model: records of its seed-0 run at the chosen lr with the study's main pairs}."""
  pairs = max((r["pairs"] for r in results["runs"]), default=None)
  return {model: record for model, lr in results["chosen_lr"].items() for record in
          results["runs"] if record["model"] == model and record["lr"] == lr
          and record["seed"] == 0 and record["pairs"] == pairs and record["steps"] ==
          results["steps"]}


def _grouped_bars(rows: list[dict], kinds, path: pathlib.Path, *, ylabel: str,
                  tick_labels: list[str]) -> pathlib.Path:
  """One group of bars per row, one bar per (key, label) of `kinds`: the mean of `row[key]`
  (stats of tools/repro_report.py), with a dot for each of its values (the seeds)."""
  plt = _pyplot()
  figure, axis = plt.subplots(figsize=(2.0 + 0.45 * len(kinds) * len(rows), 3.8))
  width = 0.8 / len(kinds)
  for k, (key, label) in enumerate(kinds):
    xs = [i + (k - (len(kinds) - 1) / 2) * width for i in range(len(rows))]
    axis.bar(xs, [row[key]["mean"] if row.get(key) else 0.0 for row in rows], width,
             label=label)
    for x, row in zip(xs, rows):
      values = (row.get(key) or {}).get("values", [])
      axis.scatter([x] * len(values), values, color="k", s=8, zorder=3)
  axis.set_xticks(range(len(rows)))
  # Slanted: the fork models' names are wider than a group of bars.
  axis.set_xticklabels(tick_labels, fontsize=8, rotation=20, ha="right")
  axis.set_ylim(0, 102)
  axis.set_ylabel(ylabel)
  axis.grid(axis="y", alpha=0.3)
  axis.legend(fontsize="x-small")
  return _save(figure, plt, path)


def plot_accuracy_by_model(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Per model with a finished run: capped, uncapped and control accuracy (bars: means, dots:
  every seed)."""
  rows = [row for row in results["rows"].values() if row.get("capped") or row.get("control")]
  if not rows:
    raise ValueError("results: no model has a finished run yet")
  return _grouped_bars(
      rows, (("capped", "capped (cache)"), ("uncapped", "uncapped"), ("control", "P=8 control")),
      path, ylabel="long-gap MQAR accuracy (%)",
      tick_labels=[f"{row['model']}\nlr {row['lr']:g}" for row in rows])


def plot_availability(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Per LTE model: availability (capped, uncapped) and value / filler retention (%)."""
  rows = [row for row in results["rows"].values() if "availability_capped" in row]
  if not rows:
    raise ValueError("results: no LTE model with diagnostics yet")
  kinds = (("availability_capped", "availability, capped"),
           ("availability_uncapped", "availability, uncapped"),
           ("value_retention", "value retention"), ("filler_retention", "filler retention"))
  return _grouped_bars(rows, kinds, path, ylabel="% (bars: mean over seeds)",
                       tick_labels=[row["model"] for row in rows])


def plot_retention_heatmap(results: dict, path: pathlib.Path) -> pathlib.Path:
  """Value and filler retention [LTE layer, KV head] of each LTE model's seed-0 run."""
  plt = _pyplot()
  runs = {m: r for m, r in chosen_runs(results).items() if "value_retention" in r["test"]}
  if not runs:
    raise ValueError("results: no LTE run with diagnostics yet")
  panels = [(f"{model}: {kind}", record["test"][f"{kind}_retention"])
            for model, record in runs.items() for kind in ("value", "filler")]
  figure, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 2.6), squeeze=False)
  for axis, (title, rates) in zip(axes[0], panels):
    image = axis.imshow(rates, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    for layer, row in enumerate(rates):
      for head, value in enumerate(row):  # dark text on the bright end of viridis
        axis.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=8,
                  color="k" if value > 0.6 else "w")
    axis.set_xticks(range(len(rates[0])))
    axis.set_yticks(range(len(rates)))
    axis.set_xlabel("KV head")
    axis.set_title(title, fontsize=8)
  axes[0][0].set_ylabel("LTE layer")
  figure.colorbar(image, ax=axes[0].tolist())
  figure.savefig(path, dpi=150)
  plt.close(figure)
  return path


def plot_lte_controller(curves: dict[str, list[dict]], path: pathlib.Path,
                        cap: float | None = None) -> pathlib.Path:
  """lambda (top) and retention count c (bottom) per (LTE layer, head) against the step, one
  column per run of `curves` ({label: metrics.jsonl records})."""
  plt = _pyplot()
  curves = {label: [r for r in records if r.get("lte_lambda")]
            for label, records in curves.items()}
  curves = {label: records for label, records in curves.items() if records}
  if not curves:
    raise ValueError("metrics: no record with lte_lambda (not an LTE run?)")
  figure, axes = plt.subplots(2, len(curves), figsize=(5.5 * len(curves), 6), sharex="col",
                              squeeze=False)
  for column, (label, records) in enumerate(curves.items()):
    top, bottom = axes[0][column], axes[1][column]
    steps = [r["step"] for r in records]
    num_layers, num_heads = len(records[0]["lte_lambda"]), len(records[0]["lte_lambda"][0])
    for layer in range(num_layers):
      for head in range(num_heads):
        name = f"layer {layer} head {head}"
        top.plot(steps, [r["lte_lambda"][layer][head] for r in records], label=name)
        bottom.plot(steps, [r["lte_retained"][layer][head] for r in records], label=name)
    top.set_yscale("symlog", linthresh=1e-9)
    top.set_title(label, fontsize=9)
    top.set_ylabel("lambda")
    bottom.set_ylabel("retention count c")
    bottom.set_xlabel("step")
    if cap is not None:
      bottom.axhline(cap, color="k", linestyle="--", linewidth=1, label=f"cap b={cap:g}")
    bottom.legend(fontsize="x-small", ncol=2)
    for axis in (top, bottom):
      axis.grid(alpha=0.3)
  return _save(figure, plt, path)


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
  return _save(figure, plt, path)


def plot_router_switch(switches: dict[str, list[tuple[int, list[dict]]]],
                       path: pathlib.Path) -> pathlib.Path:
  """Training loss (top) and kept tokens per (LTE layer, KV head) (bottom) against the steps since
  the end of the router warm-up, one column per model of `switches` ({model: [(seed, trajectory
  rows with a "since_switch" step)]}), one colour per seed, one line style per head."""
  plt = _pyplot()
  switches = {model: runs for model, runs in switches.items() if runs}
  if not switches:
    raise ValueError("trajectories: no run with a router warm-up")
  figure, axes = plt.subplots(2, len(switches), figsize=(4.5 * len(switches), 6), sharex=True,
                              squeeze=False)
  styles = ("-", "--", ":", "-.")
  for column, (model, runs) in enumerate(switches.items()):
    top, bottom = axes[0][column], axes[1][column]
    for index, (seed, rows) in enumerate(sorted(runs)):
      colour = f"C{index}"
      steps = [r["since_switch"] for r in rows]
      top.plot(steps, [r["ce_loss"] for r in rows], color=colour, label=f"seed {seed}")
      kept = [[count for layer in r["lte_retained"] for count in layer] for r in rows]
      for head in range(len(kept[0]) if kept else 0):
        bottom.plot(steps, [k[head] for k in kept], color=colour,
                    linestyle=styles[head % len(styles)],
                    label=f"seed {seed} head {head}")
    top.set_title(model, fontsize=9)
    top.set_ylabel("training CE")
    bottom.set_ylabel("kept tokens per sequence")
    bottom.set_xlabel("steps since the end of the warm-up")
    top.legend(fontsize="x-small")
    bottom.legend(fontsize="xx-small", ncol=2)
    for axis in (top, bottom):
      axis.axvline(0, color="k", linewidth=0.8)
      axis.grid(alpha=0.3)
  return _save(figure, plt, path)


def router_switches(results: dict, trajectories: dict) -> dict[str, list[tuple[int, list]]]:
  """{model: [(seed, rows)]} for every run of a warm-up model in `trajectories` (its rows from
  SWITCH_SPAN[0] before to SWITCH_SPAN[1] after its warm-up's end, with "since_switch")."""
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  import repro_report  # pylint: disable=import-outside-toplevel  # tools/repro_report.py
  switches = {}
  for record in results["runs"]:
    rows = trajectories.get(record["name"])
    if record["model"] not in capacity.WARMUP_MODELS or not rows:
      continue
    freeze = repro_report.warmup_end(repro_report.record_spec(record),
                                     record.get("smoke", False))
    near = [dict(r, since_switch=r["step"] - freeze) for r in rows
            if repro_report.near_switch(r["step"], freeze)]
    if near:
      switches.setdefault(record["model"], []).append((record["seed"], near))
  return switches


def plot_study(results: dict, results_dir: pathlib.Path, out: pathlib.Path) -> list:
  """Every figure of the capacity study whose inputs exist (skipped ones are named on stderr)."""
  written = []
  for name, draw in (("accuracy_by_model", plot_accuracy_by_model),
                     ("availability", plot_availability),
                     ("retention_heatmap", plot_retention_heatmap)):
    try:
      written.append(draw(results, out / f"{name}.png"))
    except ValueError as error:
      print(f"skipped {name}: {error}", file=sys.stderr)
  runs = chosen_runs(results)
  metrics = {model: results_dir / "runs" / record["name"] / "metrics.jsonl"
             for model, record in runs.items()}
  metrics = {model: read_metrics(path) for model, path in metrics.items() if path.is_file()}
  caps = [r["test"]["cap"] for r in runs.values() if "cap" in r["test"]]
  try:
    written.append(plot_lte_controller(metrics, out / "lte_controller.png",
                                       cap=caps[0] if caps else None))
  except ValueError as error:
    print(f"skipped lte_controller: {error}", file=sys.stderr)
  losses = {model: [(r["step"], r["ce_loss"]) for r in records if "ce_loss" in r]
            for model, records in metrics.items()}
  if losses:
    written.append(plot_training_loss(losses, out / "training_loss.png"))
  else:
    print("skipped training_loss: no run's metrics.jsonl", file=sys.stderr)
  trajectories_path = results_dir / "trajectories.json"
  try:
    if not trajectories_path.is_file():
      raise ValueError(f"{trajectories_path} does not exist")
    trajectories = json.loads(trajectories_path.read_text())["runs"]
    written.append(plot_router_switch(router_switches(results, trajectories),
                                      out / "router_switch.png"))
  except ValueError as error:
    print(f"skipped router_switch: {error}", file=sys.stderr)
  return written


def main(argv=None) -> list[pathlib.Path]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--results", required=True, help="directory holding results.json")
  parser.add_argument("--out", help="figure directory (default: <results>/figures)")
  parser.add_argument("--kernel-bench", help="JSON of tools/bench_attention.py --json")
  args = parser.parse_args(argv)
  results_dir = pathlib.Path(args.results)
  out = pathlib.Path(args.out) if args.out else results_dir / "figures"
  out.mkdir(parents=True, exist_ok=True)
  written = []
  results_path = results_dir / "results.json"
  if not results_path.is_file():
    print(f"skipped the results figures: {results_path} does not exist", file=sys.stderr)
  else:
    results = json.loads(results_path.read_text())
    if "rows" in results:
      written += plot_study(results, results_dir, out)
    else:
      written.append(plot_accuracy_vs_length(results, out / "accuracy_vs_length.png"))
  if args.kernel_bench:
    written.append(plot_kernel_speed(json.loads(pathlib.Path(args.kernel_bench).read_text()),
                                     out / "kernel_speed_vs_length.png"))
  for path in written:
    print(f"wrote {path}")
  return written


if __name__ == "__main__":
  main()
