"""tools/bench_attention.py: the ratio bookkeeping (CPU; the benchmark itself needs a GPU)."""

import importlib.util
import json
import pathlib


REPO = pathlib.Path(__file__).resolve().parents[2]


def _load_module():
  spec = importlib.util.spec_from_file_location("bench_attention",
                                                REPO / "tools" / "bench_attention.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_ratios_use_the_paired_anchor_time_when_there_is_one(tmp_path):
  bench = _load_module()
  results = {}
  bench.record(results, ("B8 T4096", "cuDNN SWA-1024", "fwd"), 2.0, "cuDNN SWA-1024")
  bench.record(results, ("B8 T4096", "ours paired", "fwd"), 3.0, "cuDNN SWA-1024", 1.5)
  bench.record(results, ("B8 T4096", "FLA unpaired", "fwd"), 3.0, "cuDNN SWA-1024")
  path = tmp_path / "bench.json"
  bench.write_json(str(path), results, ["--quick"])
  ratios = {t["kernel"]: t["ratio"] for t in json.loads(path.read_text())["timings"]}
  assert ratios == {"cuDNN SWA-1024": 1.0, "ours paired": 2.0, "FLA unpaired": 1.5}


def test_only_selects_by_substring_or_exact_name():
  bench = _load_module()
  names = list(bench.jax_variants())
  prefill = "ours LTE prefill (769 + 256 kept)"
  assert [n for n in names if bench.selected(n, ["=" + prefill])] == [prefill]
  assert len([n for n in names if bench.selected(n, ["LTE prefill"])]) > 1
