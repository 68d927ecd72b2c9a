"""tools/bench_decode.py: a CPU run of a tiny preset with --profile and --json."""

import json

import pytest
from tests.tools import load_tool


@pytest.mark.slow
def test_tiny_preset_profiled_and_written(tmp_path, capsys):
  bench = load_tool("bench_decode")
  output = tmp_path / "decode.json"
  bench.main(["--presets", "lalte-tiny", "--contexts", "64", "--batch", "2", "--steps", "2",
              "--warmup", "1", "--profile", "--profile_steps", "2", "--json", str(output)])
  (row,) = json.loads(output.read_text())
  assert row["preset"] == "lalte-tiny" and row["context"] == 64 and row["status"] == "ok"
  assert row["ms"] > 0 and row["bytes"] > 0
  profile = row["profile"]  # the decode step's XLA thunks on the CPU, by class
  assert profile["source"] == "CPU thunks" and profile["steps"] == 2
  assert profile["mapped_share"] == 1.0
  assert {"matmul", "XLA: slice update / scatter"} <= {row["class"] for row in profile["classes"]}
  printed = capsys.readouterr().out
  assert "#### lalte-tiny decode step: context 64, batch 2" in printed
