"""tools/bench_decode.py: a CPU run of a tiny preset with --profile and --json; XLA options."""

import json

import pytest
from tests.tools import load_tool


@pytest.mark.slow
def test_tiny_preset_profiled_and_written(tmp_path, capsys):
  bench = load_tool("bench_decode")
  output = tmp_path / "decode.json"
  bench.main(["--presets", "lalte-tiny", "--contexts", "64", "--batch", "2", "--steps", "2",
              "--warmup", "1", "--profile", "--profile_steps", "2", "--json", str(output),
              "--compiler-option", "xla_gpu_graph_min_graph_size=5"])
  (row,) = json.loads(output.read_text())
  assert row["compiler_options"] == {"xla_gpu_graph_min_graph_size": 5}
  assert row["preset"] == "lalte-tiny" and row["context"] == 64 and row["status"] == "ok"
  assert row["ms"] > 0 and row["bytes"] > 0
  profile = row["profile"]  # the decode step's XLA thunks on the CPU, by class
  assert profile["source"] == "CPU thunks" and profile["steps"] == 2
  assert profile["mapped_share"] == 1.0
  assert {"matmul", "XLA: slice update / scatter"} <= {row["class"] for row in profile["classes"]}
  printed = capsys.readouterr().out
  assert "#### lalte-tiny decode step: context 64, batch 2" in printed


def test_compiler_options_parse_and_bad_ones_are_refused():
  bench = load_tool("bench_decode")
  assert bench.compiler_option("a=5") == ("a", 5)
  assert bench.compiler_option("a=0.5") == ("a", 0.5)
  assert bench.compiler_option("a=False") == ("a", False)
  assert bench.compiler_option("a=x,y") == ("a", "x,y")
  with pytest.raises(SystemExit):
    bench.main(["--compiler-option", "no_value"])
