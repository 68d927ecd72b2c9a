"""Serving speed end to end: prefill tokens/s and decode time per step for each preset, batch and
prompt length, the decode step against the bound its HBM bytes set at the copy bandwidth timed in
the same run, the compiled programs' memory; with `--compare-fla`, FLA's PyTorch prefill and
decode of the same shapes in the same process.

    python tools/bench_serving.py                      # every preset, batch and prompt below
    python tools/bench_serving.py --presets lalte-1.4b gdn_swa-1.4b gdn-1.4b --batches 32 1 \\
        --prompts 4096
    python tools/bench_serving.py --presets gdn_swa-1.4b gdn-1.4b --batches 32 --prompts 4096 \\
        --compare-fla                                  # + FLA 0.6.0's models, eager PyTorch
    python tools/bench_serving.py --presets lalte-tiny --batches 2 --prompts 32 --steps 2 \\
        --warmup 1 --prefill-iters 1                   # CPU smoke run
    python tools/bench_serving.py --presets lalte-1.4b --batches 32 --prompts 4096 \\
        --generate 129 256 --profile-generate          # where a token of `generate` goes

The process runs with the serving XLA flags that `lalte-generate` sets
(`lalte_jax.xla_flags.SERVING_GPU`; a setting of the same flag in XLA_FLAGS wins, e.g.
`XLA_FLAGS=--xla_gpu_graph_enable_concurrent_region=false` for the step without concurrent
CUDA-graph regions); the report records XLA_FLAGS. For each preset, prompt length P and batch B
(in that order, so one preset's compiled programs are reused): B random prompts of P tokens
(tools/bench_prefill.py's) run through the prefill that `generate` runs (`generate.prefill_fn`)
into an empty cache with room for the decode steps; the median of `--prefill-iters` calls after
one warm-up call gives the prefill tokens/s. From the
last prefill's cache, `--warmup` and then `--steps` greedy decode steps (`generate.decode_step_fn`,
the step `generate` runs, with its compiler options; the argmax token fed back) give the median
ms per step and the batch's tokens/s, each step waited for before the next is sent. Then
`--steps` more steps go back to back with one wait at the end ("pipelined": the host sends step
n + 1 while the device runs step n, as a server that reads each token a step late does); the
difference between the two is the host's share of a synchronous step.

The decode step's HBM bytes (`step_bytes`), from the shapes: every parameter read once (the
embedding table only for the B rows it gathers, unless it is also the LM head); every cache leaf
read once, except where a step reads part of it (full attention: its P + 1 filled slots; NSA:
its selected blocks and window, and the means of its complete blocks); the GDN recurrent state
also written back. The bound is these bytes at the copy bandwidth, measured here as a jitted
`x + 1` over 1 GiB of bf16 (`--copy-mib`; read and written; tools/bench_decode_attention.py's)
timed the way the pipelined steps are: `--steps` copies sent back to back, one wait at the end.
A synchronous copy also pays the dispatch and the wait (~0.3 ms), which on an H200 is a third of
a 1 GiB copy; its bandwidth is reported too (`copy_gb_per_s_synchronous`) but sets no bound.
"of bound" is the bound over the step's time, synchronous and pipelined (1.0: the step moves its
bytes at the copy's speed).

`--generate SHORT LONG` adds `generate` itself (the prefill and the greedy decode loop in one
program, as a user calls it): the difference of its times for LONG and SHORT new tokens over
LONG - SHORT, in ms per token (e.g. 129 and 256 new tokens), which shows whether
the loop runs at the pipelined steps' pace. `--profile-generate` then traces one call of each
(tools/step_profile.py) and gives the GPU time per token by op class, the same difference: where
a token of the loop spends what a pipelined step does not (a whole cache or the weights copied
per step show as copies: 1.45 ms a token of lalte-1.4b at B32 before `generate` split the layer
groups' parameters before its loop, 2026-11-29).

Memory: each compiled program's footprint from XLA's memory analysis (arguments + outputs -
donated + temporaries), the prefill's and the decode step's (and with `--generate`, generate's
whole program, compiled once more for it; with JAX_COMPILATION_CACHE_DIR set, as
tools/gpu_stages.sh sets it, the second compile is a lookup): what the row needs at its peak.

`--compare-fla` adds, for every preset FLA 0.6.0 has a model of (GDN, GDN+SWA, GDN+Attn;
tools/fla_models.py: the same config, random init, its attention on FLA's `parallel_attn`), a row
"FLA <preset>": the prefill as `model(input_ids, use_cache=True, logits_to_keep=1)` and decode
steps as `model(token, past_key_values=..., use_cache=True)`, eager under torch.no_grad, synced
with torch.cuda.synchronize; no bytes or bound (its memory: torch's peak allocated for the row).
FLA autotunes its kernels on the first call of a shape, for minutes: the warm-up calls absorb it.

Prints one JSON line per row, then the device, the copy bandwidth, the command and a markdown
table; `--json PATH` also writes the report, rewritten after every row. An out-of-memory row gets
status "oom" and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

# pylint: disable=wrong-import-position
from lalte_jax import xla_flags

xla_flags.apply_serving()  # before JAX creates a backend; as `generate`'s CLI runs

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference import caches, prompts
from lalte_jax.inference.param_dtype import PARAM_DTYPES
from pallas_kernels.benchmarking import median_ms

from bench_decode import build_model  # tools/bench_decode.py
from bench_decode_attention import copy_case  # tools/bench_decode_attention.py
from bench_prefill import fla_prefill, random_prompts  # tools/bench_prefill.py
from lalte_jax.train.metrics import is_out_of_memory
import step_profile  # tools/step_profile.py
from fla_models import fla_model, has_fla_model, load_fla  # tools/fla_models.py

DEFAULT_PRESETS = tuple(f"{variant}-{size}" for size in ("1.4b", "0.4b")
                        for variant in ("gdn", "gdn_swa", "lalte", "lansa", "gdn_attn"))
DEFAULT_BATCHES = (1, 8, 32, 128)
DEFAULT_PROMPTS = (4096, 32768)


def _layer_cache_bytes(kind: str, config, layer_cache, context: int) -> int:
  """Bytes one decode step moves for one layer's cache (all groups, all rows) after `context`
  tokens: reads, plus the GDN state's write."""
  if isinstance(layer_cache, caches.GDNCache):
    return caches.cache_bytes(layer_cache) + caches.cache_bytes(layer_cache.state_BHVK)
  if isinstance(layer_cache, caches.NSACache):
    nsa = config.nsa
    slots = layer_cache.k_BSKD.shape[-3]
    read_keys = min(slots, nsa.block_count * nsa.block_size + nsa.window_size)
    blocks = layer_cache.k_cmp_BNKD.shape[-3]
    complete = min(blocks, (context + 1) // nsa.block_size)
    keys_and_values = caches.cache_bytes((layer_cache.k_BSKD, layer_cache.v_BSKD))
    block_means = caches.cache_bytes((layer_cache.k_cmp_BNKD, layer_cache.v_cmp_BNKD))
    return keys_and_values * read_keys // slots + block_means * complete // blocks
  if isinstance(layer_cache, caches.KVCache) and kind == "attention" \
      and config.attention.window_size is None:  # full attention: the filled slots
    slots = layer_cache.k_BSKD.shape[-3]
    return caches.cache_bytes(layer_cache) * min(slots, context + 1) // slots
  return caches.cache_bytes(layer_cache)  # SWA ring, LTE ring and kept set: read whole


def step_bytes(model, cache: caches.ModelCache, batch: int, context: int) -> dict:
  """HBM bytes of one decode step after `context` tokens, from the shapes (module doc):
  {"weights", "cache", "total"}."""
  config = model.config
  params = nnx.state(model, nnx.Param)
  weights = caches.cache_bytes(params)
  if not config.tie_embeddings:  # the table is only gathered from; untied, the head is separate
    table = model.embed.embedding.get_value()
    weights += batch * table.shape[-1] * table.dtype.itemsize - caches.cache_bytes(table)
  kinds = config.layer_pattern[:config.pattern_period]
  cache_moved = sum(_layer_cache_bytes(kind, config, layer, context)
                    for kind, layer in zip(kinds, cache.layers))
  return {"weights": weights, "cache": cache_moved, "total": weights + cache_moved}


def memory_footprint(compiled) -> int | None:
  """Arguments + outputs - donated + temporaries of a compiled program (None where the backend
  gives no memory analysis)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def ours_row(model, batch: int, prompt: int, args) -> dict:
  config = model.config
  max_length = prompt + args.warmup + 2 * args.steps + 1
  tokens_BT = jnp.asarray(random_prompts(batch, prompt, config.vocab_size))
  valid_BT = jnp.ones((batch, prompt), bool)
  empty = jax.jit(lambda: gen.init_cache(model, batch, max_length=max_length))
  prefill = gen.prefill_fn(model, args.prefill_chunk_tokens)
  prefill_memory = memory_footprint(prefill.lower(tokens_BT, valid_BT, empty()).compile())
  times = []
  for _ in range(1 + args.prefill_iters):  # the first call compiles and is not counted
    cache = empty()
    jax.block_until_ready(cache)
    start = time.perf_counter()
    logits_BV, cache = prefill(tokens_BT, valid_BT, cache)
    jax.block_until_ready((logits_BV, cache))
    times.append(time.perf_counter() - start)
  prefill_s = statistics.median(times[1:])
  moved = step_bytes(model, cache, batch, prompt)
  step = gen.decode_step_fn(model)
  token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  decode_memory = memory_footprint(step.lower(token_B, cache).compile())
  step_times = []
  for _ in range(args.warmup + args.steps):
    start = time.perf_counter()
    logits_BV, cache = step(token_B, cache)
    token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    token_B.block_until_ready()
    step_times.append(time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(args.steps):
    logits_BV, cache = step(token_B, cache)
    token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  token_B.block_until_ready()
  pipelined_ms = 1e3 * (time.perf_counter() - start) / args.steps
  del cache
  row = {"prefill_s": prefill_s, "decode_ms": 1e3 * statistics.median(step_times[args.warmup:]),
         "decode_pipelined_ms": pipelined_ms, "step_bytes": moved,
         "prefill_memory": prefill_memory, "decode_memory": decode_memory,
         "prefill_chunk_tokens": args.prefill_chunk_tokens}
  if args.generate:
    row["generate_memory"] = memory_footprint(
        gen.lower_generate(model, tokens_BT, args.generate[1]).compile())
    row["generate_ms_per_token"] = generate_ms_per_token(model, tokens_BT, args.generate)
  if args.profile_generate:
    row["generate_profile"] = profile_generate(model, tokens_BT, args.generate)
  return row


def generate_ms_per_token(model, tokens_BT, new_tokens: tuple[int, int]) -> float:
  """ms per generated token of `generate` (greedy; its prefill and decode loop in one program):
  the difference of its median times (of 2 calls after one untimed) for the two counts of new
  tokens, over their difference, so the prefill cancels. `generate` runs one decode step per
  token (no stop tokens here), so this is also its time per step. Both counts lie in one bucket
  of `generate`'s new-token lengths, so one program runs both."""
  seconds = []
  for count in new_tokens:
    times = []
    for _ in range(3):
      start = time.perf_counter()
      jax.block_until_ready(gen.generate(model, tokens_BT, count).tokens)
      times.append(time.perf_counter() - start)
    seconds.append(statistics.median(times[1:]))
  return 1e3 * (seconds[1] - seconds[0]) / (new_tokens[1] - new_tokens[0])


def profile_generate(model, tokens_BT, new_tokens: tuple[int, int]) -> dict:
  """GPU time of one `generate` token by op class: tools/step_profile.py's breakdown of a traced
  call for LONG new tokens minus that of a call for SHORT, over LONG - SHORT (the prefill
  cancels, as in `generate_ms_per_token`). One program runs both counts; its HLO classifies the
  kernels. The tracer launches kernels one by one (no CUDA graphs), so compare the classes and the
  GPU's idle time per token with tools/bench_decode.py --profile of the step alone, not the wall
  time with the untraced runs."""
  text = gen.lower_generate(model, tokens_BT, new_tokens[1]).compile().as_text()
  profiles = []
  for count in new_tokens:
    run = lambda _, count=count: jax.block_until_ready(gen.generate(model, tokens_BT, count).tokens)
    profiles.append(step_profile.profile_step(run, None, text, steps=2, warmup=1)[0])
  short, long = profiles
  tokens = new_tokens[1] - new_tokens[0]
  per_token = {key: (long[key] - short[key]) / tokens
               for key in ("wall_ms", "busy_ms", "idle_ms", "kernel_ms")}
  by_class = lambda profile: {row["class"]: row for row in profile["classes"]}
  short_classes, long_classes = by_class(short), by_class(long)
  classes = [{"class": name,
              "ms": (row["ms"] - short_classes.get(name, {}).get("ms", 0.0)) / tokens,
              "launches": (row["launches"] - short_classes.get(name, {}).get("launches", 0.0))
                          / tokens,
              "top": row["top"][:3]}
             for name, row in long_classes.items()]
  classes.sort(key=lambda row: row["ms"], reverse=True)
  return {**per_token, "source": long["source"], "new_tokens": list(new_tokens),
          "classes": classes}


def profile_markdown(row: dict) -> str:
  """One row's `generate_profile` as a heading, a summary line and a table per token."""
  profile = row["generate_profile"]
  lines = [f"#### `generate` per token: {row['model']}, batch {row['batch']}, prompt"
           f" {row['prompt']} (new tokens {profile['new_tokens'][1]} - {profile['new_tokens'][0]})",
           "", f"{profile['source']}: wall {profile['wall_ms']:.3f} ms, busy"
           f" {profile['busy_ms']:.3f} ms, idle {profile['idle_ms']:.3f} ms, kernel sum"
           f" {profile['kernel_ms']:.3f} ms per token (traced).", "",
           "| class | ms / token | launches / token | top kernels of the longer call |",
           "|---|---:|---:|---|"]
  for entry in profile["classes"]:
    top = "; ".join(f"`{k['kernel'][:50]}`" for k in entry["top"])
    lines.append(f"| {entry['class']} | {entry['ms']:.3f} | {entry['launches']:.1f} | {top} |")
  return "\n".join(lines)


def fla_row(torch, model, batch: int, prompt: int, args) -> dict:
  torch.cuda.reset_peak_memory_stats()
  prefill = fla_prefill(torch, model, batch, prompt)
  prefill_s = median_ms(prefill.fn, prefill.input_sets, warmup=1, repeats=args.prefill_iters,
                        sync=prefill.sync) / 1e3
  ids_BT = torch.as_tensor(random_prompts(batch, prompt, model.config.vocab_size),
                           dtype=torch.long, device="cuda")
  step_times = []
  with torch.no_grad():
    out = model(input_ids=ids_BT, use_cache=True, logits_to_keep=1)
    token_B1 = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(args.warmup + args.steps):  # timed as ours: the step and the argmax
      torch.cuda.synchronize()
      start = time.perf_counter()
      out = model(input_ids=token_B1, past_key_values=out.past_key_values, use_cache=True)
      token_B1 = out.logits[:, -1].argmax(-1, keepdim=True)
      torch.cuda.synchronize()
      step_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(args.steps):  # pipelined, as ours
      out = model(input_ids=token_B1, past_key_values=out.past_key_values, use_cache=True)
      token_B1 = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    pipelined_ms = 1e3 * (time.perf_counter() - start) / args.steps
  return {"prefill_s": prefill_s, "decode_ms": 1e3 * statistics.median(step_times[args.warmup:]),
          "decode_pipelined_ms": pipelined_ms, "peak_memory": torch.cuda.max_memory_allocated()}


def pipelined_call_ms(fn, x, calls: int) -> float:
  """ms per call of `x = fn(x)` sent `calls` times back to back with one wait at the end, after
  one waited-for call. `x` is donated to each call, as the decode step donates its cache: without
  it every call in flight holds a new output, and the allocator's growth is what gets timed
  (848 GB/s for a 1 GiB copy on an H200, against 1,959 GB/s for the same copy synchronous)."""
  fn = jax.jit(fn, donate_argnums=0)
  x = fn(x)
  jax.block_until_ready(x)
  start = time.perf_counter()
  for _ in range(calls):
    x = fn(x)
  jax.block_until_ready(x)
  return 1e3 * (time.perf_counter() - start) / calls


def finish(row: dict, copy_gbs: float) -> dict:
  """Adds throughputs and, where the step's bytes are known, the bound and the share of it."""
  if row.get("status") != "ok":
    return row
  row["prefill_tokens_per_s"] = row["batch"] * row["prompt"] / row["prefill_s"]
  row["decode_tokens_per_s"] = row["batch"] / row["decode_ms"] * 1e3
  if "step_bytes" in row:
    row["bound_ms"] = row["step_bytes"]["total"] / (copy_gbs * 1e9) * 1e3
    row["of_bound"] = row["bound_ms"] / row["decode_ms"]
    row["pipelined_of_bound"] = row["bound_ms"] / row["decode_pipelined_ms"]
    if "generate_ms_per_token" in row:
      row["generate_of_bound"] = row["bound_ms"] / row["generate_ms_per_token"]
  return row


def _gib(value) -> str:
  return "–" if value is None else f"{value / 2**30:.2f}"


def markdown_table(rows: list[dict]) -> str:
  timed_generate = any("generate_ms_per_token" in r for r in rows)
  lines = ["| model | batch | prompt | prefill tok/s | decode ms / step | pipelined ms / step"
           + (" | generate ms / token" if timed_generate else "")
           + " | decode tok/s | step GB | bound ms | of bound (pipelined) |"
           " memory GiB (prefill / decode" + (" / generate" if timed_generate else "") + ") |",
           "|---|---:|---:|---:|---:|---:|" + ("---:|" if timed_generate else "")
           + "---:|---:|---:|---:|---|"]
  for r in rows:
    head = f"| {r['model']} | {r['batch']} | {r['prompt']} |"
    if r["status"] != "ok":
      lines.append(f"{head} {r['status']} |" + " |" * (8 + timed_generate))
      continue
    cells = [f"{r['prefill_tokens_per_s']:,.0f}", f"{r['decode_ms']:.3f}",
             f"{r['decode_pipelined_ms']:.3f}"]
    if timed_generate:
      cells.append(f"{r['generate_ms_per_token']:.3f}" if "generate_ms_per_token" in r else "–")
    cells.append(f"{r['decode_tokens_per_s']:,.0f}")
    moved = r.get("step_bytes")
    if moved:
      cells += [f"{moved['total'] / 1e9:.3f}", f"{r['bound_ms']:.3f}",
                f"{r['of_bound']:.2f} ({r['pipelined_of_bound']:.2f})",
                f"{_gib(r['prefill_memory'])} / {_gib(r['decode_memory'])}"
                + (f" / {_gib(r.get('generate_memory'))}" if timed_generate else "")]
    else:
      cells += ["–", "–", "–", f"peak {_gib(r.get('peak_memory'))}"]
    lines.append(f"{head} {' | '.join(cells)} |")
  return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
  parser.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
  parser.add_argument("--prompts", nargs="+", type=int, default=list(DEFAULT_PROMPTS))
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--param-dtype", default="bfloat16", choices=PARAM_DTYPES)
  parser.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
  parser.add_argument("--warmup", type=int, default=3, help="decode steps before the timed ones")
  parser.add_argument("--prefill-iters", type=int, default=3,
                      help="timed prefill calls per row (after one untimed)")
  parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                      help="prefill's chunk_tokens (lalte_jax.inference.chunking); default: the"
                           " whole prompt at once")
  parser.add_argument("--compare-fla", action="store_true",
                      help="also FLA's PyTorch models of the presets it has (GPU)")
  parser.add_argument("--copy-mib", type=int, default=1024,
                      help="size of the copy that measures the bandwidth (MiB)")
  parser.add_argument("--generate", nargs=2, type=int, metavar=("SHORT", "LONG"), default=None,
                      help="also time `generate` per token: the difference of its times for"
                           " LONG and SHORT new tokens (one bucket, e.g. 129 256)")
  parser.add_argument("--profile-generate", action="store_true",
                      help="also trace `generate` at SHORT and LONG (--generate) and give its GPU"
                           " time per token by op class")
  parser.add_argument("--json", default="", help="also write the report here")
  args = parser.parse_args(argv)
  if args.profile_generate and args.generate is None:
    parser.error("--profile-generate: needs --generate SHORT LONG")
  if args.generate is not None:
    short, long = args.generate
    if not 1 <= short < long or prompts.bucket_length(short) != prompts.bucket_length(long):
      parser.error(f"--generate: need 1 <= SHORT < LONG in one bucket of new-token lengths, got"
                   f" {short} {long} (buckets {prompts.bucket_length(short)},"
                   f" {prompts.bucket_length(long)})")
  if min(args.batches + args.prompts) < 1 or args.steps < 1 or args.warmup < 0 \
      or args.prefill_iters < 1 or args.copy_mib < 1 \
      or (args.prefill_chunk_tokens is not None and args.prefill_chunk_tokens < 1):
    parser.error("--batches, --prompts, --steps, --prefill-iters, --copy-mib,"
                 " --prefill-chunk-tokens must be >= 1, --warmup >= 0")
  for name in args.presets:
    try:
      get_model_config(name)
    except ValueError as error:
      parser.error(f"--presets: {error}")
  args.torch = load_fla(parser) if args.compare_fla else None
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  copy, copy_bytes = copy_case(args.copy_mib)
  synchronous_gbs = copy_bytes / (median_ms(copy.fn, copy.input_sets, warmup=3, repeats=10) * 1e6)
  copy_gbs = copy_bytes / (pipelined_call_ms(copy.fn, copy.input_sets[0][0], args.steps) * 1e6)
  del copy
  report = {"command": "python tools/bench_serving.py " + " ".join(argv or sys.argv[1:]),
            "device_kind": jax.devices()[0].device_kind, "copy_gb_per_s": copy_gbs,
            "copy_gb_per_s_synchronous": synchronous_gbs,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}

  def write() -> None:
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(report, indent=1))

  implementations = [("lalte_jax", name) for name in args.presets]
  if args.torch is not None:
    implementations += [("FLA", name) for name in args.presets if has_fla_model(name)]
  for implementation, preset in implementations:
    torch = args.torch
    model = (build_model(preset, args.dtype, args.param_dtype) if implementation == "lalte_jax"
             else fla_model(torch, preset, args.dtype).eval())
    for prompt in args.prompts:
      for batch in args.batches:
        row = {"model": preset if implementation == "lalte_jax" else f"FLA {preset}",
               "preset": preset, "implementation": implementation, "batch": batch,
               "prompt": prompt, "dtype": args.dtype, "param_dtype": args.param_dtype,
               "steps": args.steps, "warmup": args.warmup}
        try:
          row.update(ours_row(model, batch, prompt, args) if implementation == "lalte_jax"
                     else fla_row(torch, model, batch, prompt, args), status="ok")
        except Exception as error:  # pylint: disable=broad-except
          if not (is_out_of_memory(error) or "CUDA out of memory" in str(error)):
            raise
          row["status"] = "oom"
          if torch is not None:
            torch.cuda.empty_cache()
        report["rows"].append(finish(row, copy_gbs))
        print(json.dumps(row), flush=True)
        write()
    del model
  print(f"device {report['device_kind']}; copy bandwidth (x + 1, {args.copy_mib} MiB bf16):"
        f" {copy_gbs:.0f} GB/s pipelined (the bound's), {synchronous_gbs:.0f} GB/s synchronous")
  print(f"Command: {report['command']}")
  print(markdown_table(report["rows"]))
  for row in report["rows"]:
    if "generate_profile" in row:
      print("\n" + profile_markdown(row))
  return 0


if __name__ == "__main__":
  sys.exit(main())
