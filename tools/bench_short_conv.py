"""GDN's short convolution (SiLU of a causal depthwise conv, `pallas_kernels.short_conv`): XLA
against the fused Pallas kernels, by GPU kernel time, against the copy bandwidth measured in the
same run.

    python tools/bench_short_conv.py                     # the 0.4b and 1.4b GDN shapes, B8 T4096
    python tools/bench_short_conv.py --sweep             # also the Pallas launch candidates
    python tools/bench_short_conv.py --batch 1 --seq_len 64 --channels 64 --copy_mib 16 --passes 1

Per shape (channels C of the q/k and the v convolution of each size's GDN layers; bf16), modes
"fwd" (the convolution and SiLU) and "bwd" (the gradient of sum(y * dy) with respect to x and the
weight, whose forward XLA drops: the backward alone). Times are the summed GPU kernel time per call
(`pallas_kernels.benchmarking.kernel_times`, `--passes` traced passes after 2): these calls take
0.1-1 ms, where wall-clock timing of single calls measured launch overhead as much as the kernels.
`floor us` is the time to move the op's essential bytes at the copy bandwidth (a jitted `x + 1`
over 1 GiB, wall-clock): fwd reads x and writes y; bwd reads x and dy and writes dx. On the CPU the
XLA thunks stand in for the kernels. Prints one JSON line per row and a markdown table; `--json
PATH` writes them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp

from pallas_kernels.benchmarking import Timed, device_events, kernel_times, median_ms, traced_passes
from pallas_kernels.short_conv import ShortConvBlocks, short_conv_silu

# (name, channels): the q/k and v convolutions of the presets' GDN layers.
SHAPES = (("0.4b q/k", 1024), ("0.4b v", 2048), ("1.4b q/k", 2048), ("1.4b v", 4096))
TAPS = 4
SWEEP = (
    ShortConvBlocks(),
    ShortConvBlocks(block_t_dw=16, dw_steps=16),
    ShortConvBlocks(block_t_dw=32, dw_steps=8),
    ShortConvBlocks(block_c_dw=32),
    ShortConvBlocks(block_c_dw=128, num_warps_dw=8),
    ShortConvBlocks(dw_steps=16),
    ShortConvBlocks(dw_steps=64),
    ShortConvBlocks(num_warps_dw=2),
    ShortConvBlocks(block_t=64, num_warps=4),
    ShortConvBlocks(block_t=32, block_c=64, num_warps=4),
)


def copy_gbps(repeats: int, mib: int) -> float:
  x = jnp.ones((mib // 2, 1024, 1024), jnp.bfloat16)
  copy = jax.jit(lambda x: x + 1)
  ms = median_ms(copy, [(x,)], warmup=3, repeats=repeats)
  return 2 * x.size * x.dtype.itemsize / ms / 1e6


def variants(sweep: bool) -> dict:
  pallas = {"pallas": ShortConvBlocks()}
  if sweep:
    for blocks in SWEEP[1:]:
      changed = {f: getattr(blocks, f) for f in blocks.__dataclass_fields__
                 if getattr(blocks, f) != getattr(ShortConvBlocks(), f)}
      pallas[f"pallas {changed}"] = blocks
  return pallas


def timed_modes(implementation, blocks, sets):
  conv = lambda x, w: short_conv_silu(x, w, implementation=implementation, blocks=blocks)
  forward = jax.jit(conv)
  loss = lambda x, w, dy: jnp.sum(conv(x, w).astype(jnp.float32) * dy)
  backward = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return {"fwd": Timed(forward, [s[:2] for s in sets]), "bwd": Timed(backward, sets)}


def device_us(timed: Timed, passes: int) -> float:
  """Summed kernel time per call (CPU: the XLA thunks' time)."""
  if jax.default_backend() == "gpu":
    return kernel_times(timed, passes=passes).busy_us / len(timed.input_sets)
  profile, _ = traced_passes(timed, passes=passes)
  events = device_events(profile, cpu_thunks=True)
  return sum(e.duration_ns for e in events) / 1e3 / passes / len(timed.input_sets)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--passes", type=int, default=10, help="traced passes per variant")
  parser.add_argument("--channels", type=int, nargs="*",
                      help="time these channel counts instead of the presets' shapes")
  parser.add_argument("--copy_mib", type=int, default=1024, help="size of the timed copy (MiB)")
  parser.add_argument("--sweep", action="store_true", help="also the Pallas launch candidates")
  parser.add_argument("--json", help="write the rows to this path")
  args = parser.parse_args(argv)
  bandwidth = copy_gbps(20, args.copy_mib)
  print(f"devices: {jax.devices()}, jax {jax.__version__}, copy {bandwidth:.0f} GB/s", flush=True)
  rows = []
  shapes = [(f"C{c}", c) for c in args.channels] if args.channels else SHAPES
  for name, channels in shapes:
    keys = jax.random.split(jax.random.key(channels), 6)
    shape = (args.batch, args.seq_len, channels)
    sets = [(jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
             0.5 * jax.random.normal(keys[2 * i + 1], (channels, TAPS), jnp.float32),
             jax.random.normal(keys[-1], shape, jnp.float32).astype(jnp.bfloat16))
            for i in range(2)]
    tensor_bytes = args.batch * args.seq_len * channels * 2
    floors = {"fwd": 2 * tensor_bytes, "bwd": 3 * tensor_bytes}
    xla = timed_modes("xla", ShortConvBlocks(), sets)
    xla_us = {mode: device_us(timed, args.passes) for mode, timed in xla.items()}
    for label, blocks in {"xla": None, **variants(args.sweep)}.items():
      ours = xla if blocks is None else timed_modes("pallas", blocks, sets)
      for mode in ("fwd", "bwd"):
        try:
          us = xla_us[mode] if blocks is None else device_us(ours[mode], args.passes)
        except Exception as error:  # pylint: disable=broad-except
          print(f"  {name} {label} {mode}: failed: {str(error).splitlines()[0][:200]}", flush=True)
          continue
        floor_us = floors[mode] / bandwidth / 1e3
        row = {"shape": f"B{args.batch} T{args.seq_len} C{channels} ({name})", "variant": label,
               "mode": mode, "us": us, "vs_xla": us / xla_us[mode], "floor_us": floor_us,
               "of_floor": floor_us / us}
        rows.append(row)
        print(json.dumps(row), flush=True)
  print("\n| shape | variant | mode | GPU us | vs XLA | floor us | floor / time |")
  print("|---|---|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['shape']} | {r['variant']} | {r['mode']} | {r['us']:.1f} | {r['vs_xla']:.2f}x |"
          f" {r['floor_us']:.1f} | {r['of_floor']:.2f} |")
  print(f"\ncommand: python {' '.join(sys.argv)}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
         "copy_gbps": bandwidth, "command": " ".join(sys.argv), "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
