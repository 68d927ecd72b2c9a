"""tools/bench_attention.py: the paired timing and the ratio bookkeeping (CPU; the benchmark
itself needs a GPU)."""

import importlib.util
import json
import pathlib

import jax.numpy as jnp

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load_module():
  spec = importlib.util.spec_from_file_location("bench_attention",
                                                REPO / "tools" / "bench_attention.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_paired_ms_times_both_functions_in_alternation():
  bench = _load_module()
  calls = []
  slow = lambda x: (calls.append("slow"), jnp.sum(jnp.ones((400, 400)) @ jnp.ones((400, 400))))[1]
  fast = lambda x: (calls.append("fast"), x + 1)[1]
  sets = [(jnp.float32(i),) for i in range(3)]
  slow_ms, fast_ms = bench.paired_ms(slow, fast, sets, warmup=1, rounds=4)
  assert slow_ms > 0 and fast_ms > 0
  # warm-up: anchor then fn once; each round: the anchor over all sets, then fn over all sets.
  assert calls == ["fast", "slow"] + (["fast"] * 3 + ["slow"] * 3) * 4


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
