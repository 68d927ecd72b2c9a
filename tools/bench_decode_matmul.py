"""The MLP half of a decode step at a few rows: `decode_matmul`'s fused kernels against XLA's
unfused ops, chained over a preset's layers, against the copy bandwidth measured in the same run.

    python tools/bench_decode_matmul.py                          # lalte-1.4b, 2 rows (one prompt)
    python tools/bench_decode_matmul.py --rows 1 2 8 16 --sweep --json out.json

Each layer: h = h + delta; gate|up = RMSNorm(h) @ [W_gate | W_up]; delta = (SiLU(gate) * up) @
W_down, as two `decode_matmul` calls (the add and norm in the first projection's kernel, the
SwiGLU product in the second's), against the same math as XLA runs it ("xla": the add, norm and
product as their own kernels; the decode step's path while decode_matmul's GPU default is XLA). The layers are
unrolled in one jitted call (weights as separate arrays, as `generate` holds its layer groups'),
the output of each feeding the next, so launches follow one another as in a decode step. The two
versions are timed in alternation (`pallas_kernels.benchmarking.paired_ms`), then the looped copy
of 1 GiB; "/ copy" is the weights' bytes per second over the copy's. With a GPU the kernels' GPU
time and launches per call come from a profile.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from lalte_jax.config import get_model_config
from pallas_kernels.benchmarking import Timed, kernel_times, paired_ms
from pallas_kernels.decode_matmul import DecodeMatmulConfig, decode_matmul
from tools.bench_decode_attention import copy_case, report_command_and_json

SWEEP = tuple(DecodeMatmulConfig(block_n=n, block_k=k)
              for n in (32, 64, 128) for k in (128, 256, 512) if (n, k) != (64, 256)) + (
    DecodeMatmulConfig(num_warps=2), DecodeMatmulConfig(num_warps=8),
    DecodeMatmulConfig(num_stages=2), DecodeMatmulConfig(num_stages=4))


def mlp_weights(preset: str, key, dtype=jnp.bfloat16):
  """(per layer (norm weight [D], [W_gate | W_up] [D, 2I], W_down [I, D]), weight bytes)."""
  config = get_model_config(preset)
  hidden, inner = config.hidden_size, config.intermediate_size
  layers = []
  for layer_key in jax.random.split(key, config.num_layers):
    keys = jax.random.split(layer_key, 3)
    layers.append((1.0 + 0.1 * jax.random.normal(keys[0], (hidden,), dtype),
                   (jax.random.normal(keys[1], (hidden, 2 * inner)) * hidden ** -0.5).astype(dtype),
                   (jax.random.normal(keys[2], (inner, hidden)) * inner ** -0.5).astype(dtype)))
  weight_bytes = sum(w.size * w.dtype.itemsize for layer in layers for w in layer)
  return tuple(layers), weight_bytes


def mlp_chain(implementation: str, config: DecodeMatmulConfig, eps: float):
  """jitted (h, delta, layers) -> the residual stream after every layer's MLP."""
  def run(h_MD, delta_MD, layers):
    for norm_D, w_gate_up, w_down in layers:
      gate_up_M2I, h_MD = decode_matmul(
          h_MD, w_gate_up, residual_MK=delta_MD, norm_weight_K=norm_D, eps=eps,
          implementation=implementation, config=config)
      delta_MD, _ = decode_matmul(gate_up_M2I, w_down, swiglu=True,
                                  implementation=implementation, config=config)
    return h_MD + delta_MD
  return jax.jit(run)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="lalte-1.4b")
  parser.add_argument("--rows", type=int, nargs="+", default=[2])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copy anchor")
  parser.add_argument("--sweep", action="store_true", help="also time other DecodeMatmulConfigs")
  parser.add_argument("--json", default=None, help="write all numbers here")
  args = parser.parse_args(argv)

  model = get_model_config(args.preset)
  layers, weight_bytes = mlp_weights(args.preset, jax.random.key(0))
  copy, copy_bytes = copy_case(args.copy_mib)
  on_gpu = jax.default_backend() == "gpu"
  configs = (DecodeMatmulConfig(),) + (SWEEP if args.sweep else ())
  results = {"device": jax.devices()[0].device_kind, "preset": args.preset,
             "layers": model.num_layers, "weight_bytes": weight_bytes, "rows": []}
  print(f"device {results['device']}; {args.preset}: {model.num_layers} MLPs,"
        f" {weight_bytes / 1e9:.3f} GB of bf16 weights a call")
  print("| rows | block_n | block_k | warps | stages | fused ms | xla ms | fused / xla |"
        " fused / copy | xla / copy | fused GPU us (launches) | xla GPU us (launches) |"
        "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for rows in args.rows:
    keys = jax.random.split(jax.random.key(rows), 2)
    h, delta = (jax.random.normal(key, (rows, model.hidden_size), jnp.bfloat16) for key in keys)
    xla = Timed(mlp_chain("xla", DecodeMatmulConfig(), model.norm_eps), [(h, delta, layers)])
    for config in configs:
      fused = Timed(mlp_chain("pallas", config, model.norm_eps), [(h, delta, layers)])
      try:
        fused_ms, xla_ms = paired_ms(fused, xla, warmup=3, rounds=args.repeats)
        _, copy_ms = paired_ms(fused, copy, warmup=1, rounds=args.repeats)
      except Exception as error:  # pylint: disable=broad-except
        print(f"| {rows} | {config.block_n} | {config.block_k} | {config.num_warps} |"
              f" {config.num_stages} | FAILED {str(error)[:300]} |", flush=True)
        continue
      copy_gbps = copy_bytes / (copy_ms * 1e-3) / 1e9
      of_copy = lambda ms: weight_bytes / (ms * 1e-3) / 1e9 / copy_gbps
      row = dict(rows=rows, block_n=config.block_n, block_k=config.block_k,
                 num_warps=config.num_warps, num_stages=config.num_stages, fused_ms=fused_ms,
                 xla_ms=xla_ms, copy_GBps=copy_gbps, fused_of_copy=of_copy(fused_ms),
                 xla_of_copy=of_copy(xla_ms))
      gpu = {"fused": "", "xla": ""}
      if on_gpu:
        for name, timed in (("fused", fused), ("xla", xla)):
          kernels = kernel_times(timed, passes=3).kernels
          launches = sum(count for count, _ in kernels.values())
          row[f"{name}_gpu_us"] = sum(us for _, us in kernels.values())
          row[f"{name}_launches"] = launches
          gpu[name] = f"{row[f'{name}_gpu_us']:.0f} ({launches:.0f})"
      results["rows"].append(row)
      print(f"| {rows} | {config.block_n} | {config.block_k} | {config.num_warps} |"
            f" {config.num_stages} | {fused_ms:.3f} | {xla_ms:.3f} | {fused_ms / xla_ms:.3f} |"
            f" {row['fused_of_copy']:.2f} | {row['xla_of_copy']:.2f} | {gpu['fused']} |"
            f" {gpu['xla']} |", flush=True)
  report_command_and_json(results, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
