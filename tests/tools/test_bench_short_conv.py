"""tools/bench_short_conv.py: a CPU run gives XLA's and the Pallas kernels' rows in both modes, each
with its ratio to XLA and to the copy floor."""

import json

from tests.tools import load_tool


def test_cpu_rows_and_json(tmp_path, capsys):
  bench = load_tool("bench_short_conv")
  output = tmp_path / "short_conv.json"
  assert bench.main(["--batch", "1", "--seq_len", "40", "--channels", "32", "--copy_mib", "16",
                     "--passes", "1", "--json", str(output)]) == 0
  result = json.loads(output.read_text())
  rows = result["rows"]
  assert [(r["variant"], r["mode"]) for r in rows] == [
      ("xla", "fwd"), ("xla", "bwd"), ("pallas", "fwd"), ("pallas", "bwd")]
  assert all(r["us"] > 0 and r["floor_us"] > 0 and r["shape"] == "B1 T40 C32 (C32)" for r in rows)
  assert [r["vs_xla"] for r in rows[:2]] == [1.0, 1.0]
  assert result["copy_gbps"] > 0
  assert "| B1 T40 C32 (C32) | pallas | bwd |" in capsys.readouterr().out
