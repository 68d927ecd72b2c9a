"""Per-kernel GPU time of the attention and decode kernels, from the JAX profiler.

    python tools/profile_kernels.py                       # decode cases, then attention at 4K/16K
    python tools/profile_kernels.py --cases decode --json out.json

Wall-clock medians (bench_attention.py, bench_decode_attention.py) say how long a jitted call
takes; this says which kernels of it take the time and how long the GPU sits idle between them
(launch gaps, host dispatch). For each case, `--passes` passes over the bench's own input sets
are traced (`pallas_kernels.benchmarking.kernel_times`, CUPTI events of the GPU streams) and a
table lists, per pass: host wall time, GPU span (first kernel start to last kernel end), the sum
of kernel times, and each kernel's launches and time. The profiler adds its own overhead to
walls and spans; kernel times are what to compare.

Cases: decode attention at the lalte-1.4b and lalte-0.4b caches (B32; the default config, without
the ring-blank mask, one split, two splits) and the attention targets at B8 T4096 and B2 T16384
(cuDNN SWA-1024 and our SWA-1024 and LTE prefill forward; cuDNN SWA-1024, our SWA-1024 and LTE
training forward + backward).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax

import bench_attention
import bench_decode_attention
from pallas_kernels.benchmarking import Timed, kernel_times
from pallas_kernels.decode_attention import DecodeBlockSizes

DECODE_CONFIGS = {
    "default": (None, True),
    "default, no key_valid": (None, False),
    "1 split, 128 slots, 2 stages": (DecodeBlockSizes(block_slots=128, num_splits=1,
                                                      num_stages=2), True),
    "2 splits, 64 slots (the default before 4aeec18)": (
        DecodeBlockSizes(block_slots=64, num_splits=2), True),
    "4 splits, 64 slots": (DecodeBlockSizes(block_slots=64, num_splits=4), True),
}
ATTENTION_CASES = (  # (variant of bench_attention.jax_variants, mode)
    ("cuDNN SWA-1024", "fwd"),
    ("ours SWA-1024", "fwd"),
    ("ours LTE prefill (769 + 256 kept)", "fwd"),
    ("ours SWA-769 (the prefill without its kept list)", "fwd"),
    ("cuDNN SWA-1024", "fwd+bwd"),
    ("ours SWA-1024", "fwd+bwd"),
    ("ours LTE train (769 + 4 sinks + 256 kept)", "fwd+bwd"),
)


def decode_cases(presets, batch, sets, configs=tuple(DECODE_CONFIGS)):
  for preset in presets:
    inputs, _ = bench_decode_attention.attention_case(preset, batch, sets, jax.random.key(0))
    for label in configs:
      block_sizes, mask = DECODE_CONFIGS[label]
      timed = bench_decode_attention.attention_timed(inputs if mask else inputs[:4] + (None,),
                                                     "pallas", block_sizes)
      yield f"decode {preset} B{batch}: {label}", timed, sets


def attention_cases(shapes):
  variants = bench_attention.jax_variants()
  for batch, length in shapes:
    fwd_sets, bwd_sets = bench_attention.input_sets(batch, length)
    for name, mode in ATTENTION_CASES:
      attn = variants[name][0]
      if mode == "fwd":
        yield f"B{batch} T{length} {name} {mode}", Timed(jax.jit(attn), fwd_sets), len(fwd_sets)
      else:
        yield (f"B{batch} T{length} {name} {mode}",
               Timed(bench_attention.fwd_and_bwd(attn), bwd_sets), len(bwd_sets))


def print_case(name, times, calls_per_pass, top):
  per_call = lambda us: us / calls_per_pass
  print(f"\n## {name}\nper call: wall {per_call(times.wall_us):.1f} us, GPU span"
        f" {per_call(times.span_us):.1f} us, kernels {per_call(times.busy_us):.1f} us")
  print("| kernel | launches per call | us per call | share |\n|---|---|---|---|")
  for kernel, (launches, us) in list(times.kernels.items())[:top]:
    print(f"| {kernel[:90]} | {launches / calls_per_pass:.2f} | {per_call(us):.2f} |"
          f" {us / times.busy_us:.0%} |")
  sys.stdout.flush()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", nargs="+", default=["decode", "attention"],
                      choices=["decode", "attention"])
  parser.add_argument("--presets", nargs="+", default=["lalte-1.4b", "lalte-0.4b"])
  parser.add_argument("--batch", type=int, default=32, help="decode batch")
  parser.add_argument("--sets", type=int, default=8, help="decode caches per jitted call")
  parser.add_argument("--lengths", nargs="+", type=int, default=[4096, 16384],
                      help="attention lengths (B x T = 32768 tokens, as bench_attention.py)")
  parser.add_argument("--passes", type=int, default=10)
  parser.add_argument("--top", type=int, default=8, help="kernels listed per case")
  parser.add_argument("--decode-configs", nargs="+", default=list(DECODE_CONFIGS),
                      choices=list(DECODE_CONFIGS), help="labels of DECODE_CONFIGS to trace")
  parser.add_argument("--json", default=None)
  parser.add_argument("--trace-dir", default=None,
                      help="also keep each case's trace here (CASE_NUMBER.xplane.pb; host threads"
                      " and CUDA API calls included, for a look at what the host does)")
  args = parser.parse_args(argv)

  print(f"device {jax.devices()[0].device_kind}; times per call (a pass = one call per input set)")
  cases = []
  if "decode" in args.cases:
    cases.append(decode_cases(args.presets, args.batch, args.sets, args.decode_configs))
  if "attention" in args.cases:
    cases.append(attention_cases([(32768 // length, length) for length in args.lengths]))
  if args.trace_dir:
    os.makedirs(args.trace_dir, exist_ok=True)
  results = []
  for generator in cases:
    for name, timed, calls_per_pass in generator:
      try:
        trace = None
        if args.trace_dir:
          trace = os.path.join(args.trace_dir, f"case{len(results)}.xplane.pb")
        times = kernel_times(timed, passes=args.passes, keep_trace=trace)
      except Exception as error:  # pylint: disable=broad-except
        print(f"\n## {name}: FAILED {str(error)[:1000]}", flush=True)
        continue
      print_case(name, times, calls_per_pass, args.top)
      results.append(dict(case=name, calls_per_pass=calls_per_pass, **dataclasses.asdict(times)))
      if args.json:  # after every case: a cut run keeps what it measured
        with open(args.json, "w") as f:
          json.dump(dict(command="python " + " ".join(sys.argv), results=results), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
