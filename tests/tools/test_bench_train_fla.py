"""tools/bench_train_fla.py: its arguments, the comparison with bench_train's rows and the table
(the FLA training itself needs a CUDA GPU with PyTorch and FLA; it runs in the GPU benchmarks)."""

import importlib.util
import json

import pytest
from tests.tools import load_tool


@pytest.fixture(scope="module")
def bench():
  return load_tool("bench_train_fla")


def row(preset, mode, tokens_per_s, **extra):
  return {"preset": preset, "mode": mode, "seq_len": 4096, "batch": 4, "status": "ok",
          "tokens_per_s": tokens_per_s, **extra}


def test_ours_over_the_faster_fla_mode(bench):
  rows = [row("gdn-0.4b", "eager", 60_000.0), row("gdn-0.4b", "compile", 44_000.0),
          row("gdn_swa-0.4b", "eager", 85_000.0), {**row("gdn_swa-0.4b", "compile", None),
                                                    "status": "oom"},
          row("transformer-0.4b", "eager", 90_000.0)]
  ours = [{"preset": "gdn-0.4b", "tokens_per_s": 120_000.0, "seq_len": 4096, "global_batch": 4,
           "peak_memory_gib": 9.5},
          {"preset": "gdn_swa-0.4b", "tokens_per_s": 110_000.0, "seq_len": 4096,
           "global_batch": 8, "peak_memory_gib": 10.0}]
  comparisons = {c["preset"]: c for c in bench.compare_with_ours(rows, ours)}
  assert sorted(comparisons) == ["gdn-0.4b", "gdn_swa-0.4b"]  # no row of ours: no comparison
  gdn = comparisons["gdn-0.4b"]
  assert gdn["best_fla_mode"] == "eager" and gdn["ours_over_best_fla"] == pytest.approx(2.0)
  swa = comparisons["gdn_swa-0.4b"]
  assert swa["same_shape"] is False and swa["ours_over_best_fla"] is None  # batch 8 against 4
  table = bench.markdown_table(rows, list(comparisons.values()))
  assert "| gdn-0.4b | 120,000 | 9.5 | 60,000 (eager) | 2.00 |" in table
  assert "| gdn_swa-0.4b | compile | oom |" in table
  assert "| gdn_swa-0.4b | 110,000 | 10.0 | 85,000 (eager) | - (other shape) |" in table


@pytest.mark.parametrize("argv, message", [
    (["--presets", "gdn-9b"], "--presets: unknown gdn-9b"),
    (["--batch", "0"], "--batch must be positive"),
    (["--modes", "jit"], "invalid choice: 'jit'"),
])
def test_bad_arguments_name_the_flag(bench, argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    bench.parse_args(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_ours_must_be_bench_trains_rows(bench, tmp_path, capsys):
  broken = tmp_path / "ours.json"
  broken.write_text("{not json")
  with pytest.raises(SystemExit):
    bench.parse_args(["--ours", str(broken)])
  assert f"--ours {broken}: not a readable JSON file" in capsys.readouterr().err
  broken.write_text(json.dumps({"preset": "gdn-0.4b"}))
  with pytest.raises(SystemExit):
    bench.parse_args(["--ours", str(broken)])
  assert "expected tools/bench_train.py's list of rows" in capsys.readouterr().err
  good = tmp_path / "good.json"
  good.write_text(json.dumps([{"preset": "gdn-0.4b", "tokens_per_s": 1.0}]))
  assert bench.parse_args(["--ours", str(good)]).ours_rows[0]["preset"] == "gdn-0.4b"


def test_without_fla_it_says_what_is_missing(bench, capsys):
  missing = [name for name in load_tool("fla_models").FLA_PACKAGES
             if importlib.util.find_spec(name) is None]
  if not missing:
    pytest.skip("PyTorch, transformers and FLA are installed here")
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--presets", "gdn-tiny", "lalte-tiny"])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert "lalte-tiny: FLA has no model of this variant, skipped" in error
  assert f"not importable here: {', '.join(missing)}" in error


def test_each_row_comes_from_a_child_and_a_crash_becomes_a_row(bench, monkeypatch):
  args = bench.parse_args(["--presets", "gdn-0.4b", "--batch", "2", "--steps", "3"])
  commands = []

  def child_writes_its_row(command, check):
    commands.append(command)
    path = command[command.index("--child_row") + 1]
    bench.write(path, row("gdn-0.4b", command[command.index("--modes") + 1], 50_000.0))
    return bench.subprocess.CompletedProcess(command, 0)

  monkeypatch.setattr(bench.subprocess, "run", child_writes_its_row)
  assert bench.child_row("gdn-0.4b", "eager", args)["tokens_per_s"] == 50_000.0
  (command,) = commands
  assert command[1].endswith("bench_train_fla.py")
  assert command[2:] == ["--presets", "gdn-0.4b", "--modes", "eager", "--seq_len", "4096",
                         "--batch", "2", "--steps", "3", "--warmup", "2", "--peak_tflops", "0.0",
                         "--child_row", command[-1]]

  monkeypatch.setattr(bench.subprocess, "run",
                      lambda command, check: bench.subprocess.CompletedProcess(command, -11))
  crashed = bench.child_row("gdn-0.4b", "compile", args)
  assert crashed["status"] == "crashed" and crashed["mode"] == "compile"
  assert crashed["error"] == "its child process ended with signal SIGSEGV before its row"
  assert "| gdn-0.4b | compile | crashed |" in bench.markdown_table([crashed], [])
