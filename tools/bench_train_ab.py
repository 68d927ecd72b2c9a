"""The training step of two trees of the code, in alternation on one machine: a change's effect.

    git archive REV lalte_jax pallas_kernels tools | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python tools/bench_train_ab.py --base /tmp/base --rounds 2 -- \\
        --presets gdn_swa-0.4b lalte-0.4b --batch 4 --steps 5 --warmup 2 --lte_kept_fraction 0.125

Each round runs `tools/bench_train.py` with the arguments after `--` from both trees, the base
first in even rounds and this checkout first in odd ones (each preset in its own child process,
as bench_train does unless given `--in_process`); each tree imports its own `lalte_jax` and
`pallas_kernels` (bench_train puts its tree first on the path). The order base, this, this, base
cancels a GPU's steady drift over an even number of rounds; single rounds still scatter (two A/Bs
on one H200, 2026-11-30, base first in every round: 0.997 / 0.973 and 1.000 / 0.985). The ratio
of the two step times of one round compares moments close together: per preset, the
table gives each round's step times and `this / base`, then the median ratio (< 1: this tree's
step is shorter). The trees' tokens/s ratios to another preset of the same run (e.g. lalte-0.4b
over gdn_swa-0.4b) are in the JSON (`--json`), which holds every bench_train result with its tree
and round. Both trees get the same arguments, so a default that differs between them (e.g.
`--remat` or `--scan_layers`, both changed on 2026-11-29) makes the trees run different
settings: the settings each tree recorded are compared per preset, and any that differ are
listed under the table and in the JSON (`settings_differ`); give them after `--` to pin them.
So is the share of tokens laLTE's routers kept in each tree's timed steps, where the two differ by
more than 0.01 (the cost of laLTE's attention follows it).
Exit status: 0 when every run of both trees succeeded.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

THIS_TREE = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--" not in argv:
    raise SystemExit("bench_train_ab: give bench_train's arguments after '--'")
  split = argv.index("--")
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, type=pathlib.Path,
                      help="the other tree: a directory holding lalte_jax, pallas_kernels, tools")
  parser.add_argument("--rounds", type=int, default=2,
                      help="rounds of both trees (base first in even rounds, this in odd ones)")
  parser.add_argument("--json", default="", help="also write every result (a JSON list) here")
  args = parser.parse_args(argv[:split])
  if args.rounds <= 0:
    parser.error(f"--rounds must be positive, got {args.rounds}")
  script = args.base / "tools" / "bench_train.py"
  if not script.is_file():
    parser.error(f"--base {args.base}: no tools/bench_train.py there")
  if args.base.resolve() == THIS_TREE:
    parser.error(f"--base {args.base} is this checkout; give the other tree")
  bench_argv = argv[split + 1:]
  if any(arg == "--json" or arg.startswith("--json=") for arg in bench_argv):
    parser.error("bench_train's --json is set by this tool; use --json before '--'")
  return args, bench_argv


def run_tree(tree: pathlib.Path, bench_argv: list[str]) -> list[dict]:
  """bench_train's results (its JSON list) from `tree`'s script; a run without results raises."""
  with tempfile.TemporaryDirectory() as directory:
    output = pathlib.Path(directory) / "results.json"
    command = [sys.executable, str(tree / "tools" / "bench_train.py"), *bench_argv,
               "--json", str(output)]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    if not output.is_file():
      raise RuntimeError(f"bench_train in {tree} wrote no results (exit {done.returncode}):"
                         f" {(done.stderr or done.stdout)[-2000:]}")
    return json.loads(output.read_text())


# bench_train's result fields that say what was run; a tree that does not record one (an older
# bench_train) shows None.
SETTINGS = ("seq_len", "grad_accum", "remat", "scan_layers", "dtype", "implementation",
            "lte_kept_fraction_set", "loss_chunk_tokens", "mesh_fsdp", "xla_flags")
# laLTE's attention cost follows the share of tokens its routers keep, which each tree measures
# in its timed steps: shares further apart than this (e.g. a calibration that changed) are
# listed with the settings, as the mean of each tree's rounds.
KEPT_SHARE_TOLERANCE = 0.01


def summary(results: list[dict]) -> list[dict]:
  """Per (preset, batch): each round's step times of both trees, the ratio this / base, the
  median ratio over the rounds where both ran, and the settings whose recorded values differ
  between the trees ({name: [base, this]})."""
  rows, settings, kept = {}, {}, {}
  for r in results:
    key = (r["preset"], str(r.get("batch_per_device")))
    row = rows.setdefault(key, {"preset": r["preset"], "batch": r.get("batch_per_device"),
                                "rounds": {}})
    row["rounds"].setdefault(r["round"], {})[r["tree"]] = (
        r.get("step_time_s") if r.get("status") == "ok" else None)
    settings.setdefault(key, {}).setdefault(r["tree"], {name: r.get(name) for name in SETTINGS})
    if r.get("lte_kept_fraction") is not None:
      kept.setdefault(key, {}).setdefault(r["tree"], []).append(r["lte_kept_fraction"])
  for key, row in rows.items():
    ratios = [times["this"] / times["base"] for times in row["rounds"].values()
              if times.get("this") and times.get("base")]
    row["ratios"] = ratios
    row["median_ratio"] = statistics.median(ratios) if ratios else None
    base, this = settings[key].get("base"), settings[key].get("this")
    row["settings_differ"] = {} if base is None or this is None else {
        name: [base[name], this[name]] for name in SETTINGS if base[name] != this[name]}
    shares_by_tree = kept.get(key, {})
    if "base" in shares_by_tree and "this" in shares_by_tree:
      shares = [round(statistics.mean(shares_by_tree[tree]), 4) for tree in ("base", "this")]
      if abs(shares[0] - shares[1]) > KEPT_SHARE_TOLERANCE:
        row["settings_differ"]["lte_kept_fraction"] = shares
  return list(rows.values())


def markdown(rows: list[dict]) -> str:
  lines = ["| preset | batch | round | base step ms | this step ms | this / base |",
           "|---|---:|---:|---:|---:|---:|"]
  fmt = lambda seconds: "-" if seconds is None else f"{1e3 * seconds:.2f}"
  for row in rows:
    for round_, times in sorted(row["rounds"].items()):
      base, this = times.get("base"), times.get("this")
      ratio = f"{this / base:.4f}" if base and this else "-"
      lines.append(f"| {row['preset']} | {row['batch']} | {round_} | {fmt(base)} | {fmt(this)} |"
                   f" {ratio} |")
    median = "-" if row["median_ratio"] is None else f"**{row['median_ratio']:.4f}**"
    lines.append(f"| {row['preset']} | {row['batch']} | median | | | {median} |")
  for row in rows:
    if row.get("settings_differ"):
      differ = "; ".join(f"{name} {base!r} / {this!r}"
                         for name, (base, this) in row["settings_differ"].items())
      lines.append(f"\n{row['preset']} (batch {row['batch']}): the trees ran different settings"
                   f" (base / this): {differ}; pin them after '--' to time the code alone")
  return "\n".join(lines)


def round_order(round_: int) -> tuple[str, str]:
  """The trees in the order round `round_` runs them: base, this, then this, base, and so on."""
  return ("base", "this") if round_ % 2 == 0 else ("this", "base")


def main(argv: list[str] | None = None) -> int:
  args, bench_argv = parse_args(argv)
  trees = {"base": args.base.resolve(), "this": THIS_TREE}
  results, ok = [], True
  for round_ in range(args.rounds):
    for tree_name in round_order(round_):
      tree = trees[tree_name]
      for result in run_tree(tree, bench_argv):
        ok &= result.get("status") == "ok"
        results.append({**result, "tree": tree_name, "tree_path": str(tree), "round": round_})
      print(f"round {round_}, {tree_name}: done", flush=True)
  rows = summary(results)
  print(markdown(rows))
  print(f"command: python tools/bench_train_ab.py --base {args.base} --rounds {args.rounds} -- "
        + " ".join(bench_argv))
  if args.json:
    pathlib.Path(args.json).write_text(
        json.dumps({"summary": rows, "results": results}, indent=2) + "\n")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
