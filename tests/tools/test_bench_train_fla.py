"""tools/bench_train_fla.py: its arguments, the comparison with bench_train's rows and the table
(the FLA training itself needs a CUDA GPU with PyTorch and FLA; it runs in the GPU benchmarks)."""

import importlib.util
import json

import pytest
from tests.tools import load_tool


@pytest.fixture(scope="module")
def bench():
  return load_tool("bench_train_fla")


def row(preset, mode, tokens_per_s, batch=4, **extra):
  return {"preset": preset, "mode": mode, "seq_len": 4096, "batch": batch, "status": "ok",
          "tokens_per_s": tokens_per_s, **extra}


def ours_row(preset, tokens_per_s, batch, **extra):
  return {"preset": preset, "tokens_per_s": tokens_per_s, "seq_len": 4096, "global_batch": batch,
          **extra}


def test_each_side_at_its_fastest_batch_and_at_the_same_batch(bench):
  rows = [row("gdn-0.4b", "eager", 60_000.0), row("gdn-0.4b", "eager", 90_000.0, batch=8,
                                                  peak_memory_gib=40.0),
          row("gdn-0.4b", "compile", 70_000.0), row("gdn_swa-0.4b", "eager", 85_000.0),
          {**row("gdn_swa-0.4b", "compile", None), "status": "oom"},
          row("transformer-0.4b", "eager", 90_000.0)]
  ours = [ours_row("gdn-0.4b", 120_000.0, 4, peak_memory_gib=9.5),
          ours_row("gdn-0.4b", 135_000.0, 8, peak_memory_gib=19.0),
          {**ours_row("gdn-0.4b", None, 12), "status": "oom"},
          ours_row("gdn_swa-0.4b", 110_000.0, 8, peak_memory_gib=10.0),
          {**ours_row("gdn_swa-0.4b", 999_999.0, 4), "seq_len": 2048}]  # another length
  comparisons = {c["preset"]: c for c in bench.compare_with_ours(rows, ours)}
  assert sorted(comparisons) == ["gdn-0.4b", "gdn_swa-0.4b"]  # no row of ours: no comparison
  gdn = comparisons["gdn-0.4b"]
  assert (gdn["ours_batch"], gdn["best_fla_mode"], gdn["best_fla_batch"]) == (8, "eager", 8)
  assert gdn["ours_over_best_fla"] == pytest.approx(1.5)  # 135,000 / 90,000
  # At 4 sequences FLA's faster mode is compile (70,000); at 8 only eager ran.
  assert gdn["same_batch"] == {4: pytest.approx(120 / 70), 8: pytest.approx(1.5)}
  swa = comparisons["gdn_swa-0.4b"]  # FLA ran 4 only, ours 8 only: no same-batch ratio
  assert swa["ours_over_best_fla"] == pytest.approx(110 / 85) and swa["same_batch"] == {}
  table = bench.markdown_table(rows, list(comparisons.values()))
  assert "| gdn-0.4b | 135,000 (8, 19.0) | 90,000 (eager, 8, 40.0) | 1.50 | 1.71 at 4, 1.50 at 8 |" \
      in table
  assert "| gdn_swa-0.4b | compile | oom |" in table
  assert "| gdn_swa-0.4b | 110,000 (8, 10.0) | 85,000 (eager, 4, -) | 1.29 | - |" in table


def test_a_mode_stops_at_its_first_batch_out_of_memory(bench, monkeypatch, tmp_path):
  ran = []

  def fake_child(preset, mode, batch, args):
    ran.append((mode, batch))
    status = "oom" if (mode, batch) == ("eager", 8) else "ok"
    return {**row(preset, mode, None if status == "oom" else 1000.0 * batch, batch=batch),
            "status": status}

  monkeypatch.setattr(bench, "child_row", fake_child)
  monkeypatch.setattr(bench, "load_fla", lambda parser: None)
  assert bench.main(["--presets", "gdn-0.4b", "--batch", "16", "4", "8",
                     "--json", str(tmp_path / "fla.json")]) == 0
  assert ran == [("eager", 4), ("eager", 8), ("compile", 4), ("compile", 8), ("compile", 16)]
  assert len(json.loads((tmp_path / "fla.json").read_text())["rows"]) == 5


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
  assert bench.child_row("gdn-0.4b", "eager", 2, args)["tokens_per_s"] == 50_000.0
  (command,) = commands
  assert command[1].endswith("bench_train_fla.py")
  assert command[2:] == ["--presets", "gdn-0.4b", "--modes", "eager", "--seq_len", "4096",
                         "--batch", "2", "--steps", "3", "--warmup", "2", "--peak_tflops", "0.0",
                         "--child_row", command[-1]]

  monkeypatch.setattr(bench.subprocess, "run",
                      lambda command, check: bench.subprocess.CompletedProcess(command, -11))
  crashed = bench.child_row("gdn-0.4b", "compile", 2, args)
  assert crashed["status"] == "crashed" and crashed["mode"] == "compile"
  assert crashed["error"] == "its child process ended with signal SIGSEGV before its row"
  assert "| gdn-0.4b | compile | crashed |" in bench.markdown_table([crashed], [])
