"""tools/bench_prefill.py on the CPU: tiny presets, failures reported as rows, --fla's checks."""

import importlib.util
import json

import pytest
from tests.tools import load_tool

from lalte_jax.config import get_model_config
from lalte_jax.model import count_parameters

# Every test prefills gdn_swa-tiny at these shapes, so that they share its compiled prefill.
SHAPES = ["--lengths", "32", "64", "--tokens", "128"]
QUICK = ["--warmup", "1", "--iters", "2", "--warmup-s", "0"]


def table_rows(printed: str) -> list[list[str]]:
  """The cells of the markdown table's body rows."""
  lines = [line for line in printed.splitlines() if line.startswith("| ")]
  return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


@pytest.mark.slow
def test_tiny_presets_rows_and_table(tmp_path, capsys):
  bench = load_tool("bench_prefill")
  output = tmp_path / "prefill.json"
  assert bench.main(["--presets", "lalte-tiny", "gdn_swa-tiny", *SHAPES, *QUICK,
                     "--json", str(output)]) == 0
  rows = json.loads(output.read_text())
  assert [(r["model"], r["length"], r["batch"]) for r in rows] == [
      ("lalte-tiny", 32, 4), ("gdn_swa-tiny", 32, 4), ("lalte-tiny", 64, 2),
      ("gdn_swa-tiny", 64, 2)]
  for r in rows:
    assert r["status"] == "ok" and r["implementation"] == "lalte_jax"
    assert r["parameters"] == count_parameters(get_model_config(r["preset"]))
    assert r["dtype"] == r["param_dtype"] == "bfloat16" and r["device_kind"]
    assert r["ms"] > 0 and r["first_call_s"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["length"] / r["ms"] * 1e3)
    assert r["vs_baseline"] == 1.0 if r["preset"] == "gdn_swa-tiny" else r["vs_baseline"] > 0
  printed = capsys.readouterr().out
  assert "| model | parameters | prompt length | batch | ms / call | tokens/s | vs gdn_swa-tiny |" \
      in printed
  cells = table_rows(printed)
  assert [row[:4] for row in cells] == [
      [r["model"], f"{r['parameters']:,}", str(r["length"]), str(r["batch"])] for r in rows]
  assert [row[6] for row in cells] == [f"{r['vs_baseline']:.2f}" for r in rows]
  assert "Command: python tools/bench_prefill.py --presets lalte-tiny gdn_swa-tiny" in printed
  # One JSON line per row, as each is timed: the baseline first within a length.
  lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
  assert [(r["model"], r["length"]) for r in lines] == [
      ("gdn_swa-tiny", 32), ("lalte-tiny", 32), ("gdn_swa-tiny", 64), ("lalte-tiny", 64)]


@pytest.mark.slow
def test_failures_are_rows_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
  bench = load_tool("bench_prefill")
  build = bench.build_model

  def build_or_fail(name, dtype, param_dtype):
    if name == "lalte-tiny":
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
    if name == "gdn-tiny":
      raise ValueError("a failure that is no lack of memory")
    return build(name, dtype, param_dtype)
  monkeypatch.setattr(bench, "build_model", build_or_fail)
  output = tmp_path / "prefill.json"
  assert bench.main(["--presets", "lalte-tiny", "gdn-tiny", "gdn_swa-tiny", "--lengths", "32",
                     "--tokens", "128", *QUICK, "--json", str(output)]) == 1
  rows = json.loads(output.read_text())
  assert [r["status"] for r in rows] == ["oom", "error", "ok"]
  assert rows[0]["error"].startswith("RESOURCE_EXHAUSTED") and rows[0]["parameters"] > 0
  assert rows[1]["error"] == "a failure that is no lack of memory"
  assert rows[2]["vs_baseline"] == 1.0
  captured = capsys.readouterr()
  assert [row[4] for row in table_rows(captured.out)] == ["OOM", "ERROR", f"{rows[2]['ms']:.1f}"]
  assert "ValueError: a failure that is no lack of memory" in captured.err  # the traceback


@pytest.mark.parametrize("argv, message", [
    (["--presets", "lalte-huge"], "--presets: "),
    (["--presets", "lalte-tiny", "--baseline", "gdn_swa-tiny"], "--baseline 'gdn_swa-tiny'"),
    (["--lengths", "0"], "--lengths must be positive"),
    (["--tokens", "-1"], "--tokens must be positive"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    load_tool("bench_prefill").main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_fla_without_its_packages_says_what_is_missing(capsys):
  bench = load_tool("bench_prefill")
  missing = [name for name in load_tool("fla_models").FLA_PACKAGES
             if importlib.util.find_spec(name) is None]
  if not missing:
    pytest.skip("PyTorch, transformers and FLA are installed here")
  with pytest.raises(SystemExit) as exit_info:
    bench.main(["--fla", "--presets", "gdn_swa-tiny", "--lengths", "32"])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert "FLA rows need PyTorch, transformers 5 and FLA 0.6.0" in error
  assert f"not importable here: {', '.join(missing)}" in error


def test_fla_rows_are_the_presets_fla_has():
  bench = load_tool("bench_prefill")
  assert [name for name in bench.DEFAULT_PRESETS if bench.has_fla_model(name)] == [
      "gdn_swa-1.4b", "gdn-1.4b"]
  assert bench.has_fla_model("transformer-0.4b") and not bench.has_fla_model("lansa-1.4b")
