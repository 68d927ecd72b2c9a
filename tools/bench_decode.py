"""Decode latency and cache memory vs context length (paper §4.3, the protocol of §9.5).

    python tools/bench_decode.py                      # 1.4b laLTE, GDN+SWA, GDN+Attn; B=32; 1K..64K
    python tools/bench_decode.py --presets lalte-tiny gdn_attn-tiny --contexts 64 128 --batch 2
    python tools/bench_decode.py --presets lansa-1.4b lansa-0.4b --contexts 4096 16384 65536
    python tools/bench_decode.py --presets lalte-1.4b --contexts 4096 --profile  # GPU time by op
    python tools/bench_decode.py --presets lalte-1.4b --contexts 4096 \
        --compiler-option xla_gpu_graph_min_graph_size=5   # XLA's default, against ours (1)

The process runs with the serving XLA flags of `lalte-generate` (`lalte_jax.xla_flags.SERVING_GPU`;
XLA_FLAGS can override them and is recorded in the JSON). Random weights: float32, or with
`--param-dtype bfloat16` bfloat16 matrices as a server holds them
(`lalte_jax.inference.param_dtype`). For each preset and context length L the cache is set directly
to the state after L tokens instead of running a prefill (a 64K prefill of full attention at batch
32 is not what is measured): the GDN states and the SWA / LTE rings are full, full attention and NSA
hold L keys (NSA also the means of the L / 64 complete blocks), and the LTE out-of-window set is
half full (b/2 kept keys per head, as the paper's kernel benchmark). Cache values are constants or
random numbers; no step's cost depends on them.

Reports the median wall time of `--steps` decode steps (one token for each of the B rows, the whole
model incl. the LM head) after `--warmup` steps, the batch's tokens/s, and the cache bytes per
sequence (every laLTE step does the same work: it scores one settled token, §5.4). Prints a markdown
table and the command line; an out-of-memory context prints "OOM" and the run continues.
`--json PATH` also writes the rows. `--profile` traces `--profile_steps` more steps per row and
breaks their GPU time down by op class (Pallas kernels, matmuls, XLA fusions, copies such as a
whole cache copied per step, host gaps: tools/step_profile.py), printed as a table per row and
written to the JSON ("profile").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from lalte_jax import xla_flags

xla_flags.apply_serving()  # before JAX creates a backend; as `generate`'s CLI runs

# pylint: disable=wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference.caches import GDNCache, cache_bytes
from lalte_jax.inference.param_dtype import (PARAM_DTYPE_HELP, PARAM_DTYPES,
                                             cast_params_for_inference)
from lalte_jax.model import HybridLM

import step_profile  # tools/step_profile.py
from lalte_jax.train.metrics import is_out_of_memory

DEFAULT_PRESETS = ("lalte-1.4b", "gdn_swa-1.4b", "gdn_attn-1.4b")
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def filled(x: jax.Array, value: float) -> jax.Array:
  return jnp.full_like(x, value)


def synthetic_layer_cache(kind: str, config, layer_cache, context: int, key: jax.Array):
  """The layer cache (stacked over groups) after `context` tokens, with placeholder values."""
  if kind == "gdn":
    return GDNCache(conv_q_BKC=filled(layer_cache.conv_q_BKC, 0.01),
                    conv_k_BKC=filled(layer_cache.conv_k_BKC, 0.01),
                    conv_v_BKC=filled(layer_cache.conv_v_BKC, 0.01),
                    state_BHVK=filled(layer_cache.state_BHVK, 0.001))
  if kind in ("attention", "nsa"):
    # SWA ring (full once context >= window), full cache (first L slots valid) or NSA's keys and
    # block means: the zeros of init_cache serve as keys (a step's cost does not depend on them;
    # NSA always selects block_count blocks); a filled copy would double the peak memory of a
    # 64K cache.
    return layer_cache
  if kind == "lte":
    lte = config.lte
    window, cap = lte.window_keys, lte.cap
    score = jax.random.uniform(key, layer_cache.score.shape, jnp.float32, -0.5, 0.5)
    slot = jnp.arange(window + cap)[None, None, :, None]
    half = cap // 2
    # Ring: the last min(L, W) tokens, token p in slot p mod W (slots beyond L blank when L <
    # W, as after a prefill); OOW: b/2 kept.
    score = jnp.where(slot >= min(context, window), jnp.where(
        (slot >= window) & (slot < window + half), jnp.abs(score) + 1e-3, -jnp.inf), score)
    return layer_cache.replace(
        score=score,  # keys and values: init_cache's zeros
        past_len=jnp.full_like(layer_cache.past_len, half if context > window else 0))
  raise ValueError(f"bench_decode: no synthetic cache for {kind!r} layers")


def synthetic_cache(model, batch: int, context: int, extra: int):
  config = model.config
  cache = gen.init_cache(model, batch, max_length=context + extra)
  kinds = config.layer_pattern[:config.pattern_period]
  keys = jax.random.split(jax.random.key(0), len(kinds))
  layers = tuple(synthetic_layer_cache(kind, config, layer, context, key)
                 for kind, layer, key in zip(kinds, cache.layers, keys))
  return cache.replace(layers=layers, position=jnp.asarray(context, jnp.int32))


def timed_steps(step, token_B, cache, count: int):
  times = []
  for _ in range(count):
    start = time.perf_counter()
    logits, cache = step(token_B, cache)
    logits.block_until_ready()
    times.append(time.perf_counter() - start)
  return times, cache


def bench_one(model, batch: int, context: int, steps: int, warmup: int,
              profile_steps: int = 0, compiler_options: dict | None = None) -> dict:
  config = model.config
  step = gen.decode_step_fn(model, compiler_options)
  # Room for every step this row runs (the profile's adds one warm-up step).
  cache = synthetic_cache(model, batch, context, extra=warmup + steps + profile_steps + 1)
  per_sequence = cache_bytes(cache) / batch
  token_B = jnp.asarray(np.arange(batch) % config.vocab_size, jnp.int32)
  _, cache = timed_steps(step, token_B, cache, warmup)
  times, cache = timed_steps(step, token_B, cache, steps)
  result = {"ms": 1e3 * statistics.median(times), "bytes": per_sequence}
  if profile_steps:  # the same step traced, after one more warm-up step (profile_step's)
    hlo_text = step.lower(token_B, cache).compile().as_text()
    result["profile"], cache = step_profile.profile_step(
        lambda carried: step(token_B, carried)[1], cache, hlo_text, steps=profile_steps)
  del cache
  return result


def compiler_option(text: str) -> tuple[str, int | float | bool | str]:
  """`KEY=VALUE` of --compiler-option: VALUE as an int, float or bool where it reads as one."""
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
  if value.lower() in ("true", "false"):
    return key, value.lower() == "true"
  for kind in (int, float):
    try:
      return key, kind(value)
    except ValueError:
      pass
  return key, value


def build_model(name: str, dtype: str, param_dtype: str) -> HybridLM:
  config = get_model_config(name).replace(dtype=dtype)
  model = nnx.jit(lambda: HybridLM(config, rngs=nnx.Rngs(0)))()  # parameters made on the device
  return cast_params_for_inference(model, param_dtype)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
  parser.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS))
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
  parser.add_argument("--param-dtype", default="float32", choices=PARAM_DTYPES,
                      help=PARAM_DTYPE_HELP)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--profile", action="store_true",
                      help="also trace --profile_steps steps per row and break their GPU time"
                           " down by op class (tools/step_profile.py)")
  parser.add_argument("--profile_steps", type=int, default=10, help="steps traced by --profile")
  parser.add_argument("--compiler-option", type=compiler_option, action="append", default=[],
                      metavar="KEY=VALUE",
                      help="an XLA option for the decode step on top of"
                           " generate.DECODE_COMPILER_OPTIONS (repeatable)")
  parser.add_argument("--json", default="", help="also write the rows (a JSON list) here")
  args = parser.parse_args(argv)
  options = dict(args.compiler_option)
  if args.profile_steps <= 0:
    parser.error(f"--profile_steps must be positive, got {args.profile_steps}")

  rows = []
  for name in args.presets:
    model = build_model(name, args.dtype, args.param_dtype)
    for context in args.contexts:
      try:
        result = bench_one(model, args.batch, context, args.steps, args.warmup,
                           args.profile_steps if args.profile else 0, options)
      except Exception as error:  # pylint: disable=broad-except
        if not is_out_of_memory(error):
          raise
        result = None
      rows.append((name, context, result))
      status = "OOM" if result is None else f"{result['ms']:.2f} ms"
      print(f"# {name} L={context}: {status}", file=sys.stderr, flush=True)
    del model

  device = jax.devices()[0]
  print(f"\nDevice: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__},"
        f" batch {args.batch}, {args.dtype} activations, {args.param_dtype} parameters, random"
        f" weights; median of {args.steps}"
        f" steps after {args.warmup} warm-up; XLA options"
        f" {dict(gen.DECODE_COMPILER_OPTIONS, **options)}; XLA_FLAGS"
        f" {os.environ.get('XLA_FLAGS', '')!r}.")
  print(f"Command: python tools/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}"
        "\n")
  print("| model | context | decode ms / step | tokens/s (batch) | cache MiB / sequence |")
  print("|---|---:|---:|---:|---:|")
  for name, context, result in rows:
    if result is None:
      print(f"| {name} | {context} | OOM | | |")
      continue
    print(f"| {name} | {context} | {result['ms']:.2f} | {args.batch / result['ms'] * 1e3:.0f} |"
          f" {result['bytes'] / 2**20:.2f} |")
  for name, context, result in rows:
    if result is not None and "profile" in result:
      print("\n" + step_profile.markdown(
          result["profile"], f"{name} decode step: context {context}, batch {args.batch},"
          f" {args.dtype} activations, {args.param_dtype} parameters, {device.device_kind}"))
  if args.json:
    common = {"batch": args.batch, "dtype": args.dtype, "param_dtype": args.param_dtype,
              "compiler_options": dict(gen.DECODE_COMPILER_OPTIONS, **options),
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "device_kind": device.device_kind, "steps": args.steps, "warmup": args.warmup}
    with open(args.json, "w") as f:
      json.dump([{"preset": name, "context": context, **common,
                  **({"status": "oom"} if result is None else {"status": "ok", **result})}
                 for name, context, result in rows], f, indent=1)


if __name__ == "__main__":
  main()
