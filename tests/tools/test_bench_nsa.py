"""tools/bench_nsa.py --smoke: the whole benchmark (parity, training timings, decode bandwidth) on
tiny shapes in interpret mode, so that the GPU run's code paths are exercised on CPU."""

import json

import pytest
from tests.tools import load_tool


@pytest.mark.slow
def test_smoke_run_reports_every_part(tmp_path, capsys):
  path = tmp_path / "nsa.json"
  assert load_tool("bench_nsa").main(["--smoke", "--json", str(path)]) == 0
  result = json.loads(path.read_text())
  modes = [(row["kind"], row.get("mode")) for row in result["rows"]]
  assert modes == [("train", "fwd"), ("train", "fwd+bwd"), ("decode", None)]
  assert all(row.get("ours_ms", row.get("step_us", 0)) > 0 for row in result["rows"])
  decode = result["rows"][-1]
  assert decode["looped_us"] > 0 and decode["looped_ratio"] > 0 and decode["rounds"] == 2
  (parity,) = result["parity"]
  errors = [float(part.split()[-1]) for part in parity.split(": ")[1].split(", ")]
  assert len(errors) == 5 and max(errors) < 2e-2, parity  # bf16 inputs vs float32 reference
  assert "| train fwd+bwd | B1 T48 |" in capsys.readouterr().out
