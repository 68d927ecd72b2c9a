"""Decode attention and the fused LTE cache step: bandwidth against a copy measured in the same run.

    python tools/bench_decode_attention.py                  # B32, lalte-1.4b and lalte-0.4b shapes
    python tools/bench_decode_attention.py --sweep --json out.json

Decode attention is bandwidth-bound (each step reads the whole K/V cache once), so it is judged
against the copy bandwidth of this GPU, measured here with a jitted `x + 1` over a 1 GiB bf16 array
(bytes read + written). For each preset, one query per (row, query head) attends over the LTE
cache: W = w + 1 ring slots + b compacted slots, all valid (full ring, full OOW set: the most
bytes), bf16, through `decode_attention` with the ring-blank mask and per-(row, head) lengths that
`LTEAttention.decode` passes. GB/s = bytes of K + V + q + o / time; the ratio is to the copy GB/s.

Timing: `--sets` independent caches (more bytes than L2 holds, so every call reads HBM) are
attended one after another inside one jitted function; time per call = median over `--repeats`
of the wall time / sets, after warm-up, each Pallas config in alternation with the copy
(`pallas_kernels.benchmarking.paired_ms`), whose paired time gives that row's ratio. Each row also
reports GPU kernel time (profiler) and the wall time of `looped_timed`, which pays one dispatch of
a jitted call per `--rounds` x `--sets` calls as a decode loop does. The fused LTE
cache step (`evict_and_insert`) is timed as 32 steps in one jitted loop over a donated cache
with a full OOW set, XLA vs Pallas; the prefill compaction (`compact_top_scores`, top-b of the
T - W out-of-window tokens per row and KV head) at B8 T4096 and B2 T16384, XLA vs Pallas.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from lalte_jax.config import get_model_config
from pallas_kernels.benchmarking import (
    Timed, kernel_times, looped_copy, median_ms, paired_ms)
from pallas_kernels.decode_attention import DecodeBlockSizes, decode_attention
from pallas_kernels.lte_cache_ops import compact_top_scores, evict_and_insert


def median_seconds(fn, args, repeats: int, warmup: int = 3) -> float:
  return median_ms(fn, [args], warmup=warmup, repeats=repeats) / 1e3


def copy_case(mib: int = 1024):
  """(Timed jitted elementwise copy of a `mib` MiB (default 1 GiB) bf16 array, bytes it reads +
  writes)."""
  x = jnp.ones((mib, 512, 1024), jnp.bfloat16)
  copy = jax.jit(lambda x: x + 1)  # `x + 0` could be simplified away by XLA
  return Timed(copy, [(x,)]), 2 * x.size * x.dtype.itemsize


def lte_shapes(preset: str):
  lte = get_model_config(preset).lte
  return lte.num_heads, lte.num_kv_heads, lte.head_dim, lte.window_keys, lte.cap


def attention_case(preset: str, batch: int, sets: int, key):
  num_q_heads, num_kv_heads, head_dim, window, cap = lte_shapes(preset)
  slots = window + cap
  keys = jax.random.split(key, 3 * sets)
  qs = [jax.random.normal(keys[i], (batch, num_q_heads, head_dim), jnp.bfloat16)
        for i in range(sets)]
  ks = [jax.random.normal(keys[sets + i], (batch, slots, num_kv_heads, head_dim), jnp.bfloat16)
        for i in range(sets)]
  vs = [jax.random.normal(keys[2 * sets + i], (batch, slots, num_kv_heads, head_dim),
                          jnp.bfloat16) for i in range(sets)]
  length = jnp.full((batch, num_kv_heads), slots, jnp.int32)  # full OOW set
  valid = jnp.ones((batch, slots), bool)  # full ring, no blanks
  moved = sum(x.size * x.dtype.itemsize for x in (qs[0], ks[0], vs[0], qs[0]))
  return (qs, ks, vs, length, valid), moved


def attention_timed(inputs, implementation, block_sizes) -> Timed:
  """One jitted call that attends over every input set's cache (one pass = len(qs) decode calls)."""
  qs, ks, vs, length, valid = inputs

  @jax.jit
  def run_all(qs, ks, vs, length, valid):
    return [decode_attention(q, k, v, length_BK=length, key_valid=valid,
                             implementation=implementation, block_sizes=block_sizes)
            for q, k, v in zip(qs, ks, vs)]
  return Timed(run_all, [inputs])


def looped_timed(inputs, implementation, block_sizes, rounds: int) -> Timed:
  """One jitted call that runs `rounds` rounds over every input set's cache in a lax.fori_loop.

  `attention_timed`'s pass pays one dispatch of a jitted call per len(qs) decode calls: ~330 us
  of host time per pass with 8 caches (2026-11-23 host trace: ~165 us before the CUDA graph launch,
  ~150 us from the GPU's end to block_until_ready), while the GPU ran the 8 decode kernels back
  to back in one graph. Here that cost is spread over rounds x len(qs) calls, as in a decode loop
  (many small launches are timed as replays). Each call's query is chained to the last
  output (q + 0 * o; XLA keeps x * 0 for floats), so XLA can neither hoist nor merge the calls;
  that adds one tiny elementwise kernel per call.
  """
  qs, ks, vs, length, valid = inputs

  @jax.jit
  def run_rounds(qs, ks, vs, length, valid):
    def one_round(_, o):
      for q, k, v in zip(qs, ks, vs):
        o = decode_attention(q + 0 * o, k, v, length_BK=length, key_valid=valid,
                             implementation=implementation, block_sizes=block_sizes)
      return o
    return jax.lax.fori_loop(0, rounds, one_round, jnp.zeros_like(qs[0]))
  return Timed(run_rounds, [inputs])


def time_attention(timed: Timed, calls: int, repeats: int, copy=None):
  """Seconds per decode call of `attention_timed`'s `timed` (`calls` per pass); with copy
  (`copy_case()[0]`), (that, seconds per copy) timed in alternation
  (pallas_kernels.benchmarking.paired_ms)."""
  if copy is None:
    return median_seconds(timed.fn, timed.input_sets[0], repeats) / calls
  attention_ms, copy_ms = paired_ms(timed, copy, warmup=3, rounds=repeats)
  return attention_ms / 1e3 / calls, copy_ms / 1e3


def device_seconds(timed: Timed, calls_per_pass: int, passes: int = 5) -> float:
  """GPU kernel seconds per call (every kernel of the call, from a profiler trace)."""
  return kernel_times(timed, passes=passes).busy_us / 1e6 / calls_per_pass


def check_parity(inputs, window):
  """Relative error of Pallas vs XLA with a half-full OOW set and blanks in the ring."""
  qs, ks, vs, length, valid = inputs
  slots = ks[0].shape[1]
  half_length = (window + slots) // 2 + jnp.arange(length.shape[1])[None]
  blanks = (jnp.arange(slots)[None] >= window // 8) | (jnp.arange(slots)[None] >= window)
  valid = valid & blanks
  results = [decode_attention(qs[0], ks[0], vs[0], length_BK=half_length + 0 * length,
                              key_valid=valid, implementation=name).astype(jnp.float32)
             for name in ("xla", "pallas")]
  return float(jnp.max(jnp.abs(results[1] - results[0])) / jnp.max(jnp.abs(results[0])))


def time_cache_step(preset, batch, implementation, repeats, steps_per_call=32):
  num_q_heads, num_kv_heads, head_dim, window, cap = lte_shapes(preset)
  del num_q_heads
  slots = window + cap
  key = jax.random.key(1)
  k = jax.random.normal(key, (batch, slots, num_kv_heads, head_dim), jnp.bfloat16)
  v = jnp.ones_like(k)
  score = jax.random.uniform(key, (batch, slots, num_kv_heads), jnp.float32, -0.5, 0.5)
  past_len = jnp.full((batch, num_kv_heads), cap, jnp.int32)  # full set: the minimum search
  new_k = jnp.ones((batch, num_kv_heads, head_dim), jnp.bfloat16)
  new_score = jnp.full((batch, num_kv_heads), 0.3, jnp.float32)

  def steps(k, v, score, past_len, ptr):
    def body(_, state):
      k, v, score, past_len, ptr = state
      k, v, score, past_len = evict_and_insert(
          k, v, score, past_len, ptr, new_k, new_k, new_score, window_keys=window,
          implementation=implementation)
      return k, v, score, past_len, (ptr + 1) % window
    return jax.lax.fori_loop(0, steps_per_call, body, (k, v, score, past_len, ptr))
  # Donated: the cache is updated in place, as in a decode loop.
  steps = jax.jit(steps, donate_argnums=(0, 1, 2, 3))
  state = (k, v, score, past_len, jnp.int32(0))
  for _ in range(3):
    state = jax.block_until_ready(steps(*state))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    state = jax.block_until_ready(steps(*state))
    times.append(time.perf_counter() - start)
  return statistics.median(times) / steps_per_call


def time_compaction(preset, batch, length, implementation, repeats, sets=4):
  """Seconds per prefill compaction (top-cap of the T - W out-of-window tokens per row, KV head)."""
  _, num_kv_heads, head_dim, window, cap = lte_shapes(preset)
  keys = jax.random.split(jax.random.key(2), 2 * sets)
  ks = [jax.random.normal(keys[i], (batch, length, num_kv_heads, head_dim), jnp.bfloat16)
        for i in range(sets)]
  scores = [jax.random.normal(keys[sets + i], (batch, length, num_kv_heads), jnp.float32)
            for i in range(sets)]

  @jax.jit
  def run_all(ks, scores):
    return [compact_top_scores(k, k, score, num_candidates=length - window, cap=cap,
                               implementation=implementation) for k, score in zip(ks, scores)]
  return median_seconds(run_all, (ks, scores), repeats) / sets


def report_command_and_json(results: dict, json_path: str) -> None:
  """The end of a decode benchmark's run: its command line, and the results as JSON at
  `json_path` when one is given."""
  print("command: python " + " ".join(sys.argv))
  if json_path:
    with open(json_path, "w") as f:
      json.dump(results, f, indent=1)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["lalte-1.4b", "lalte-0.4b"])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--sets", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--rounds", type=int, default=8,
                      help="rounds over the sets per jitted call in the looped timing")
  parser.add_argument("--sweep", action="store_true", help="also time other block sizes")
  parser.add_argument("--json", default=None, help="write all numbers here")
  args = parser.parse_args(argv)

  device = jax.devices()[0].device_kind
  copy, copy_bytes = copy_case()
  copy_gbs = copy_bytes / median_seconds(copy.fn, copy.input_sets[0], args.repeats) / 1e9
  print(f"device {device}; copy bandwidth (x + 1, 1 GiB bf16): {copy_gbs:.0f} GB/s (alone);"
        " each row's ratio is to the copy timed in alternation with it")
  configs = [None]
  if args.sweep:
    configs += [DecodeBlockSizes(block_slots=n, num_splits=s, num_stages=st)
                for n in (64, 128) for s in (1, 2, 4) for st in (2, 3)]
    # Several KV heads per program: each step reads a [block_slots, heads, D] slab (1 KiB rows at
    # Hkv 8, D 64) instead of 128-byte rows; splits default to ~target_programs programs.
    configs += [DecodeBlockSizes(block_slots=n, kv_heads_per_program=h, num_stages=st)
                for h, n, st in ((2, 64, 3), (2, 32, 3), (4, 64, 2), (4, 32, 3), (8, 16, 3),
                                 (8, 32, 2), (8, 32, 3))]
    configs += [DecodeBlockSizes(block_slots=32, kv_heads_per_program=8, num_stages=2,
                                 num_splits=s, num_warps=w) for s, w in ((4, 4), (8, 4), (8, 8))]
  results = {"device": device, "copy_GBps": copy_gbs, "attention": [], "cache_step": [],
             "compaction": []}
  # Three times per row: wall time per call (one jitted call per pass over the sets, paired with
  # the copy), GPU kernel time (profiler traces), and wall time per call of `looped_timed`. On
  # 2026-11-23 the decode kernels of a B32 1.4b pass ran back to back in one CUDA graph, 34 us
  # each, and the rest of the ~73 us per call was the pass's dispatch (host trace, H100).
  on_gpu = jax.default_backend() == "gpu"
  copy_gpu_gbs = copy_bytes / device_seconds(copy, 1) / 1e9 if on_gpu else float("nan")
  results["copy_GBps_gpu_time"] = copy_gpu_gbs
  print(f"copy bandwidth by GPU kernel time: {copy_gpu_gbs:.0f} GB/s")
  copy_rounds = looped_copy(copy, args.rounds)
  header = ("| cache | pallas config | us/call | GB/s | / copy | copy GB/s (paired) | xla us/call |"
            " rel err vs xla | GPU us/call | GPU GB/s / copy GPU GB/s | looped us/call |"
            " looped GB/s / looped copy GB/s |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|---|")
  print(header)
  rows = []
  for preset in args.presets:
    inputs, moved = attention_case(preset, args.batch, args.sets, jax.random.key(0))
    error = check_parity(inputs, lte_shapes(preset)[3])
    xla_s = time_attention(attention_timed(inputs, "xla", None), args.sets, args.repeats)
    # The last row drops the ring-blank mask (a diagnostic, not a decode step: its per-call bool
    # -> int8 conversion and mask loads are what it leaves out). Measured 2026-11-23: no difference
    # in GPU time.
    for block_sizes, mask in [(c, True) for c in configs] + [(None, False)]:
      label = "default" if block_sizes is None else (
          f"n{block_sizes.block_slots} s{block_sizes.num_splits} st{block_sizes.num_stages}"
          f" w{block_sizes.num_warps} kvh{block_sizes.kv_heads_per_program}")
      label += "" if mask else ", no key_valid"
      try:
        # In alternation with the copy: on 2026-11-22 the first config timed (the default) read
        # 0.58 of a copy timed apart and the same config timed later 0.68, the clocks ramping up.
        case_inputs = inputs if mask else inputs[:4] + (None,)
        timed = attention_timed(case_inputs, "pallas", block_sizes)
        seconds, copy_s = time_attention(timed, args.sets, args.repeats, copy)
      except Exception as error:  # pylint: disable=broad-except
        # One config that fails to compile (e.g. shared memory) must not hide the others.
        print(f"| {preset} B{args.batch} | {label} | FAILED {str(error)[:300]} |", flush=True)
        continue
      gbs, paired_copy_gbs = moved / seconds / 1e9, copy_bytes / copy_s / 1e9
      gpu_s = float("nan")
      if on_gpu:
        gpu_s = device_seconds(timed, args.sets)
      gpu_ratio = moved / gpu_s / 1e9 / copy_gpu_gbs
      # Wall time again with the dispatch cost spread over rounds x sets calls, in alternation
      # with the copy looped the same way.
      looped_ms, looped_copy_ms = paired_ms(
          looped_timed(case_inputs, "pallas", block_sizes, args.rounds), copy_rounds, warmup=2,
          rounds=args.repeats)
      looped_s = looped_ms / 1e3 / (args.rounds * args.sets)
      looped_copy_gbs = copy_bytes * args.rounds / (looped_copy_ms / 1e3) / 1e9
      looped_ratio = moved / looped_s / 1e9 / looped_copy_gbs
      results["attention"].append(dict(preset=preset, config=label, us=seconds * 1e6,
                                       GBps=gbs, ratio=gbs / paired_copy_gbs,
                                       copy_GBps_paired=paired_copy_gbs, xla_us=xla_s * 1e6,
                                       parity_rel_err=error, bytes=moved, gpu_us=gpu_s * 1e6,
                                       gpu_time_ratio=gpu_ratio, looped_us=looped_s * 1e6,
                                       looped_ratio=looped_ratio, rounds=args.rounds,
                                       looped_copy_GBps=looped_copy_gbs))
      rows.append(f"| {preset} B{args.batch} | {label} | {seconds * 1e6:.1f} | {gbs:.0f} |"
                  f" {gbs / paired_copy_gbs:.2f} | {paired_copy_gbs:.0f} | {xla_s * 1e6:.1f} |"
                  f" {error:.1e} | {gpu_s * 1e6:.1f} | {gpu_ratio:.2f} | {looped_s * 1e6:.1f} |"
                  f" {looped_ratio:.2f} |")
      print(rows[-1], flush=True)
    for implementation in ("xla", "pallas"):
      seconds = time_cache_step(preset, args.batch, implementation, args.repeats)
      results["cache_step"].append(dict(preset=preset, implementation=implementation,
                                        us=seconds * 1e6))
      print(f"{preset} evict_and_insert B{args.batch} {implementation}: {seconds * 1e6:.1f} us"
            " per step (32 steps per jitted call, cache donated)")
    for batch, length in ((8, 4096), (2, 16384)):
      for implementation in ("xla", "pallas"):
        try:
          seconds = time_compaction(preset, batch, length, implementation, args.repeats)
        except Exception as error:  # pylint: disable=broad-except
          print(f"{preset} compact_top_scores B{batch} T{length} {implementation}: FAILED"
                f" {str(error)[:300]}", flush=True)
          continue
        results["compaction"].append(dict(preset=preset, batch=batch, length=length,
                                          implementation=implementation, us=seconds * 1e6))
        print(f"{preset} compact_top_scores (prefill) B{batch} T{length} {implementation}:"
              f" {seconds * 1e6:.1f} us", flush=True)
  print(header)
  print("\n".join(rows))
  report_command_and_json(results, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
