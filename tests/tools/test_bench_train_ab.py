"""tools/bench_train_ab.py: a CPU run of a tiny preset from two trees (each importing its own
packages), the per-round ratios and their median, and the arguments it refuses."""

import json
import pathlib
import shutil
import sys

import pytest
from tests.tools import load_tool
from tests.child_processes import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench_train_ab.py"


def _base_tree(tmp_path):
  """A copy of this checkout's code whose bench_train records where lalte_jax came from."""
  base = tmp_path / "base"
  for name in ("lalte_jax", "pallas_kernels", "tools"):
    shutil.copytree(REPO / name, base / name, ignore=shutil.ignore_patterns("__pycache__"))
  script = base / "tools" / "bench_train.py"
  text = script.read_text()
  anchor = '  result = {"preset": preset,'
  assert anchor in text
  script.write_text(text.replace(
      anchor, '  result = {"lalte_jax_file": __import__("lalte_jax").__file__, "preset": preset,'))
  return base


@pytest.mark.slow
def test_two_trees_alternate_and_each_imports_its_own_code(tmp_path, children):
  base = _base_tree(tmp_path)
  output = tmp_path / "ab.json"
  done = children.run(
      [sys.executable, str(SCRIPT), "--base", str(base), "--rounds", "1", "--json", str(output),
       "--", "--presets", "gdn_swa-tiny", "--seq_len", "32", "--steps", "1", "--warmup", "0",
       "--in_process"],
      cwd=tmp_path, env=child_env(), timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(output.read_text())
  trees = [(r["tree"], r["round"], r["status"]) for r in report["results"]]
  assert trees == [("base", 0, "ok"), ("this", 0, "ok")]
  base_result, this_result = report["results"]
  assert pathlib.Path(base_result["lalte_jax_file"]).is_relative_to(base)
  assert "lalte_jax_file" not in this_result  # this checkout's bench_train ran
  (row,) = report["summary"]
  assert row["preset"] == "gdn_swa-tiny" and row["median_ratio"] == pytest.approx(
      this_result["step_time_s"] / base_result["step_time_s"])
  assert "| gdn_swa-tiny | 1 | median | | |" in done.stdout


def test_rounds_alternate_which_tree_runs_first():
  """base, this | this, base | base, this: a steady drift of the GPU cancels over two rounds."""
  tool = load_tool("bench_train_ab")
  assert [tool.round_order(r) for r in range(3)] == [
      ("base", "this"), ("this", "base"), ("base", "this")]


def test_summary_pairs_the_rounds_and_takes_the_median_ratio():
  ab = load_tool("bench_train_ab")
  results = [
      {"preset": "p", "batch_per_device": 4, "round": r, "tree": t, "status": "ok",
       "step_time_s": s}
      for r, t, s in ((0, "base", 0.100), (0, "this", 0.090), (1, "base", 0.100),
                      (1, "this", 0.095), (2, "base", 0.100), (2, "this", 0.080))]
  results.append({"preset": "p", "batch_per_device": 4, "round": 3, "tree": "base",
                  "status": "oom", "step_time_s": None})
  (row,) = ab.summary(results)
  assert row["ratios"] == pytest.approx([0.9, 0.95, 0.8])
  assert row["median_ratio"] == pytest.approx(0.9)
  table = ab.markdown([row])
  assert "| p | 4 | 0 | 100.00 | 90.00 | 0.9000 |" in table
  assert "| p | 4 | 3 | - | - | - |" in table and "| p | 4 | median | | | **0.9000** |" in table


def test_summary_names_the_settings_the_trees_ran_differently():
  ab = load_tool("bench_train_ab")
  common = {"preset": "p", "batch_per_device": 4, "round": 0, "status": "ok", "seq_len": 4096,
            "dtype": "bfloat16"}
  base = {**common, "tree": "base", "step_time_s": 0.100, "remat": "dots_attention"}
  this = {**common, "tree": "this", "step_time_s": 0.090, "remat": "none", "scan_layers": False}
  (row,) = ab.summary([base, this])
  assert row["settings_differ"] == {"remat": ["dots_attention", "none"],
                                    "scan_layers": [None, False]}
  assert ("p (batch 4): the trees ran different settings (base / this): remat 'dots_attention'"
          " / 'none'; scan_layers None / False" in ab.markdown([row]))
  (same,) = ab.summary([base, {**this, "remat": "dots_attention", "scan_layers": None}])
  assert same["settings_differ"] == {} and "different settings" not in ab.markdown([same])


def test_summary_names_a_kept_share_that_differs_between_the_trees():
  """laLTE's kept share is measured, not set: shares more than 0.01 apart are listed."""
  ab = load_tool("bench_train_ab")
  row = lambda tree, round_, share: {"preset": "lalte", "batch_per_device": 8, "round": round_,
                                     "tree": tree, "status": "ok", "step_time_s": 0.2,
                                     "lte_kept_fraction": share}
  (differ,) = ab.summary([row("base", 0, 0.17), row("this", 0, 0.125), row("base", 1, 0.18),
                          row("this", 1, 0.126)])
  assert differ["settings_differ"] == {"lte_kept_fraction": [0.175, 0.1255]}
  (close,) = ab.summary([row("base", 0, 0.125), row("this", 0, 0.13)])
  assert close["settings_differ"] == {}


@pytest.mark.parametrize("argv, message", [
    (["--base", "x"], "after '--'"),
    (["--base", str(REPO), "--", "--presets", "p"], "is this checkout"),
    (["--base", "/nonexistent", "--", "--presets", "p"], "no tools/bench_train.py"),
])
def test_refuses_bad_arguments(argv, message, capsys):
  ab = load_tool("bench_train_ab")
  with pytest.raises(SystemExit) as exit_info:
    ab.parse_args(argv)
  assert message in str(exit_info.value.code) + capsys.readouterr().err


def test_refuses_bench_trains_own_json(tmp_path, capsys):
  ab = load_tool("bench_train_ab")
  base = tmp_path / "base" / "tools"
  base.mkdir(parents=True)
  (base / "bench_train.py").write_text("")
  with pytest.raises(SystemExit):
    ab.parse_args(["--base", str(tmp_path / "base"), "--", "--json", "x.json"])
  assert "set by this tool" in capsys.readouterr().err
