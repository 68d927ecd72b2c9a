"""tools/bench_attention.py: the ratio bookkeeping (CPU; the benchmark itself needs a GPU)."""

import json

from tests.tools import load_tool


def test_ratios_use_the_paired_anchor_time_when_there_is_one(tmp_path):
  bench = load_tool("bench_attention")
  results = {}
  bench.record(results, ("B8 T4096", "cuDNN SWA-1024", "fwd"), 2.0, "cuDNN SWA-1024")
  bench.record(results, ("B8 T4096", "ours paired", "fwd"), 3.0, "cuDNN SWA-1024", 1.5)
  bench.record(results, ("B8 T4096", "FLA unpaired", "fwd"), 3.0, "cuDNN SWA-1024")
  path = tmp_path / "bench.json"
  bench.write_json(str(path), results, ["--quick"])
  ratios = {t["kernel"]: t["ratio"] for t in json.loads(path.read_text())["timings"]}
  assert ratios == {"cuDNN SWA-1024": 1.0, "ours paired": 2.0, "FLA unpaired": 1.5}


def test_only_selects_by_substring_or_exact_name():
  bench = load_tool("bench_attention")
  names = list(bench.jax_variants())
  prefill = "ours LTE prefill (769 + 256 kept)"
  assert [n for n in names if bench.selected(n, ["=" + prefill])] == [prefill]
  assert len([n for n in names if bench.selected(n, ["LTE prefill"])]) > 1


def test_geometry_names_the_lte_variants_by_window_and_kept_count():
  bench = load_tool("bench_attention")
  default, small = bench.Geometry(), bench.Geometry(16, 16, 769, 512)
  assert default.lte_train == "ours LTE train (769 + 4 sinks + 256 kept)"
  assert small.lte_train in bench.jax_variants(geometry=small)
  assert "ours LTE prefill (769 + 512 kept)" in bench.jax_variants(geometry=small)
  assert any(blocks.kept_split(4096) for blocks in bench.SWEEP_BACKWARD)
