"""Runs the attention forwards of the prefill target once each, for Nsight Compute to profile.

    ncu --kernel-name regex:"masked_attention_fwd|fprop" --launch-skip 2 --launch-count 3 \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section SpeedOfLight python tools/ncu_attention.py

Each call runs three times (the first compiles): cuDNN SWA-1024, our SWA-769 (the prefill's
window part) and our LTE prefill (window 769 + 256 kept keys per row and KV head), forward only,
at B8 T4096 Hq32 Hkv8 D64 bf16 (`bench_attention.py`'s inputs). What ncu says (registers per
thread, achieved occupancy, why warps stall) explains the per-tile gap that wall-clock ratios
only measure.
"""

from __future__ import annotations

import sys

import jax

import bench_attention


def main() -> int:
  fwd_sets, _ = bench_attention.input_sets(8, 4096, sets=1)
  variants = bench_attention.jax_variants()
  for name in ("cuDNN SWA-1024", "ours SWA-769 (the prefill without its kept list)",
               "ours LTE prefill (769 + 256 kept)"):
    attention = jax.jit(variants[name][0])
    for _ in range(3):
      jax.block_until_ready(attention(*fwd_sets[0]))
    print(f"ran {name}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
