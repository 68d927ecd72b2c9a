"""tools/bench_nsa.py --smoke: the whole benchmark (parity, training timings, decode bandwidth) on
tiny shapes in interpret mode, so that the GPU run's code paths are exercised on CPU."""

import dataclasses
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


@pytest.mark.slow
def test_sweep_reports_every_candidate_and_keeps_going_after_a_failure(tmp_path, capsys,
                                                                     monkeypatch):
  """--sweep times each candidate (here the smoke blocks with 1 and 2 warps per selected
  forward program); one whose kernels fail is reported as failed and the next one still runs."""
  bench = load_tool("bench_nsa")
  good = bench.SMOKE.blocks
  two_warps = dataclasses.replace(good, slc_num_warps=2)
  failing = dataclasses.replace(good, num_warps=8)
  ours = bench.ours

  def ours_failing_for(shape):
    if shape.blocks == failing:
      def fail(*_):
        raise RuntimeError("this candidate does not compile")
      return fail, fail
    return ours(shape)

  monkeypatch.setattr(bench, "ours", ours_failing_for)
  monkeypatch.setattr(bench, "SWEEP", (good, failing, two_warps))
  path = tmp_path / "sweep.json"
  bench.main(["--smoke", "--sweep", "--no-parity", "--no-decode", "--json", str(path)])
  rows = json.loads(path.read_text())["rows"]
  assert [("failed" in row, row["mode"]) for row in rows] == [
      (False, "fwd"), (False, "fwd+bwd"), (True, "fwd"), (True, "fwd+bwd"), (False, "fwd"),
      (False, "fwd+bwd")]
  assert "slc_num_warps" in rows[-1]["blocks"] and "FAILED" in capsys.readouterr().out
