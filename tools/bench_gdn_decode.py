"""The GDN decode step (`fused_recurrent_gated_delta_rule`, T = 1) against the copy bandwidth.

    python tools/bench_gdn_decode.py                      # lalte-1.4b and gdn-1.4b shapes, B32
    python tools/bench_gdn_decode.py --sweep --json out.json

A decoding step of a GDN layer reads and writes its float32 recurrent state [B, H, K, V] once:
2 B H K V 4 bytes, far more than its q, k, v, o. The state is stacked over the model's GDN layers,
[G, B, H, K, V], and stepped in place, one layer after another, as the model's decode step does.
One jitted call runs `--rounds` rounds over the G layers in a `lax.fori_loop` on a donated state
(each step's q chained to the last output, so XLA can neither hoist nor merge the steps), timed in
alternation with a jitted 1 GiB copy looped the same way (`pallas_kernels.benchmarking`); the
ratio is the state's bytes per second over the copy's. The GPU time of the kernels (profiler) is
reported beside it. Both state layouts are timed (the decode caches' "vk", [G, B, H, V, K], and "kv"), each at its
default config; `--sweep` times other `RecurrentConfig`s (columns per program, warps).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from lalte_jax.config import get_model_config
from pallas_kernels.benchmarking import Timed, kernel_times, looped_copy, paired_ms
from pallas_kernels.gated_delta_rule.pallas_recurrent import (
    DEFAULT_CONFIGS, RecurrentConfig, fused_recurrent_gated_delta_rule_pallas)
from tools.bench_decode_attention import copy_case, report_command_and_json


def gdn_shapes(preset: str) -> tuple[int, int, int, int]:
  """(GDN layers, heads, K, V) of a preset."""
  config = get_model_config(preset)
  layers = sum(kind == "gdn" for kind in config.layer_pattern)
  return layers, config.gdn.num_heads, config.gdn.head_dim, config.gdn.value_dim


def step_inputs(preset: str, batch: int, key):
  """(q, k, v, g, beta for one token, stacked state, bytes a step moves)."""
  layers, heads, key_dim, value_dim = gdn_shapes(preset)
  keys = jax.random.split(key, 5)
  q = jax.random.normal(keys[0], (batch, 1, heads, key_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, 1, heads, key_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, 1, heads, value_dim), jnp.float32)
  g = -jax.random.uniform(keys[3], (batch, 1, heads), jnp.float32, 0.01, 0.1)
  beta = jax.random.uniform(keys[4], (batch, 1, heads), jnp.float32)
  state = jax.random.normal(key, (layers, batch, heads, key_dim, value_dim), jnp.float32) * 0.01
  state_bytes = 2 * batch * heads * key_dim * value_dim * 4
  token_bytes = sum(x.size * x.dtype.itemsize for x in (q, k, v, v, g, beta))
  return (q, k, v, g, beta), state, state_bytes + token_bytes


def looped_steps(token, state, config: RecurrentConfig, rounds: int, state_layout: str = "kv"
                 ) -> Timed:
  """`rounds` rounds of one step per layer group over the donated stacked [G, B, H, K, V] state
  (transposed first for the "vk" layout)."""
  q, k, v, g, beta = token
  layers = state.shape[0]
  if state_layout == "vk":
    state = jnp.swapaxes(state, -1, -2)

  def run(state, q):
    def one_step(i, carry):
      state, o = carry
      q_step = q + 0 * o[..., :q.shape[-1]]  # chained: no hoisting or merging of steps
      o, state = fused_recurrent_gated_delta_rule_pallas(
          q_step, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=state,
          output_final_state=True, use_qk_l2norm=True, group=i % layers,
          state_layout=state_layout, config=config)
      return state, o.astype(jnp.float32)
    o0 = jnp.zeros(v.shape, jnp.float32)
    return jax.lax.fori_loop(0, rounds * layers, one_step, (state, o0))

  run = jax.jit(run, donate_argnums=0)
  # Each call donates the state it is given, so the next call must get the state just returned:
  # Timed passes the same arguments every time, so the state lives here instead.
  holder = {"state": state}

  def call(q):
    holder["state"], o = run(holder["state"], q)
    return o
  return Timed(call, [(q,)])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["lalte-1.4b", "gdn-1.4b"])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copy anchor")
  parser.add_argument("--sweep", action="store_true", help="also time other RecurrentConfigs")
  parser.add_argument("--json", default=None, help="write all numbers here")
  args = parser.parse_args(argv)

  device = jax.devices()[0].device_kind
  copy, copy_bytes = copy_case(args.copy_mib)
  copy_rounds = looped_copy(copy, args.rounds)
  on_gpu = jax.default_backend() == "gpu"
  # (state layout, config): each layout's default first.
  configs = [(layout, DEFAULT_CONFIGS[layout]) for layout in ("vk", "kv")]
  if args.sweep:
    configs += [(layout, RecurrentConfig(block_v=b, num_warps=w))
                for layout, blocks, warps in (("vk", (16, 32, 64), (1, 2, 4)),
                                              ("kv", (16, 32, 64, 128), (1, 2, 4, 8)))
                for b in blocks for w in warps
                if RecurrentConfig(block_v=b, num_warps=w) != DEFAULT_CONFIGS[layout]]
  results = {"device": device, "batch": args.batch, "rounds": args.rounds, "rows": []}
  print(f"device {device}; B{args.batch}; each ratio is to a {args.copy_mib} MiB copy looped"
        f" {args.rounds} times per call, timed in alternation")
  print("| preset | layout | block_v | warps | us/step | state GB/s | / copy | GPU us/step |"
        "\n|---|---|---:|---:|---:|---:|---:|---:|")
  for preset in args.presets:
    token, state, moved = step_inputs(preset, args.batch, jax.random.key(0))
    steps = args.rounds * state.shape[0]
    for layout, config in configs:
      try:
        timed = looped_steps(token, state + 0, config, args.rounds, layout)
        call_ms, copy_ms = paired_ms(timed, copy_rounds, warmup=3, rounds=args.repeats)
      except Exception as error:  # pylint: disable=broad-except
        print(f"| {preset} | {layout} | {config.block_v} | {config.num_warps} |"
              f" FAILED {str(error)[:300]} |", flush=True)
        continue
      step_us = call_ms * 1e3 / steps
      gbs = moved / (step_us * 1e-6) / 1e9
      copy_gbs = copy_bytes * args.rounds / (copy_ms * 1e-3) / 1e9
      gpu_step_us = float("nan")
      if on_gpu:  # the kernels' GPU time, without the chaining's tiny elementwise kernels
        kernels = kernel_times(timed, passes=3).kernels
        gpu_step_us = sum(us for name, (_, us) in kernels.items()
                          if "gdn_fused_recurrent" in name) / steps
      row = dict(preset=preset, state_layout=layout, block_v=config.block_v,
                 num_warps=config.num_warps,
                 step_us=step_us, state_GBps=gbs, copy_GBps=copy_gbs, ratio=gbs / copy_gbs,
                 gpu_step_us=gpu_step_us, bytes=moved)
      results["rows"].append(row)
      print(f"| {preset} | {layout} | {config.block_v} | {config.num_warps} |"
            f" {step_us:.1f} | {gbs:.0f} |"
            f" {gbs / copy_gbs:.2f} | {gpu_step_us:.1f} |", flush=True)
  report_command_and_json(results, args.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
