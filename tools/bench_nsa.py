"""NSA on the GPU: parity with FLA's parallel_nsa and the reference, training-kernel timings
against FLA in the same process, and decode bandwidth against a copy.

    python tools/bench_nsa.py --json nsa.json                  # everything below
    python tools/bench_nsa.py --lengths 16384 --no-decode      # one length
    python tools/bench_nsa.py --sweep --no-fla --no-parity --no-decode --lengths 8192
    python tools/bench_nsa.py --smoke                          # CPU: tiny shapes, interpret mode

Each part catches its own failure and the table is printed last; a GPU run too long for one
call splits with --lengths and --no-* (compiling each length's kernels takes most of the time).

Shape (the paper's laNSA): Hq 32, Hkv 2, D 64, block 64, 16 selected blocks, window 512, bf16.
1. Parity at B1 T2048: ours (`implementation="pallas"`) and FLA against the float32 reference,
   output and gradients (q, k, v, gates), relative to the reference's largest magnitude.
2. Training: B x T = 32K tokens at T 4K, 8K, 16K; "fwd" is one jitted call, "fwd+bwd" one that
   also returns the gradients of q, k, v and the gates; ours and FLA timed in alternation
   (`pallas_kernels.benchmarking.paired_ms`, FLA synced with torch.cuda.synchronize), and the
   first call's seconds (compilation included); on a GPU also our kernels' GPU time per call
   (a profiler trace). `--sweep` times ours alone for each NSABlockSizes candidate of SWEEP
   instead.
3. Decode: B32, the cache full up to T 4K, 16K, 64K; `--sets` independent caches per jitted call
   (more bytes than L2 holds); GB/s = the bytes a step must read (the complete blocks' means, the
   selected blocks, the window, q) / time, against a jitted `x + 1` over 1 GiB (read + written)
   timed in alternation. Three times: one jitted call over the sets per dispatch; the looped
   decode (`--rounds` rounds over the sets in one call compiled as the model's decode step, so
   a dispatch is paid once per rounds x sets steps, as in a decode loop; the copy looped alike);
   and the kernels' GPU time from a profiler trace, with the kernels of a step in the JSON.

FLA 0.6.0's parallel_nsa computes the same semantics (mean-pooled 64-token blocks, compressed
attention over complete blocks, top-16 with the first, previous and current blocks forced, shared
by a GQA group, a 512-key window) with gates as three [B, T, Hq] tensors instead of our
[B, T, Hq, 3]; equal importances may be ordered differently (a bitonic sort against our top_k's
lower index first), and its window branch needs flash-attn: without it FLA runs parallel_nsa
without the window plus its own parallel_attn(window_size=512), gated the same way (reported in
the parity line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lalte_jax.generate import DECODE_COMPILER_OPTIONS
from pallas_kernels.benchmarking import (
    Timed, kernel_times, looped_copy, median_ms, paired_ms, run_for_seconds)
from pallas_kernels.nsa import (
    NSABlockSizes, compress_prompt, compressed_blocks, pallas, pallas_decode, reference)


@dataclasses.dataclass(frozen=True)
class Shape:
  num_q_heads: int = 32
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 64
  block_count: int = 16
  window_size: int = 512
  tokens: int = 32768  # B x T of a training step
  lengths: tuple[int, ...] = (4096, 8192, 16384)
  parity_length: int = 2048
  decode_batch: int = 32
  decode_contexts: tuple[int, ...] = (4096, 16384, 65536)
  blocks: NSABlockSizes = NSABlockSizes()

  @property
  def sizes(self):
    return dict(block_size=self.block_size, block_count=self.block_count,
                window_size=self.window_size)


# CPU: interpret mode, so a handful of tokens; 16-wide tiles and 2 query heads per KV head.
SMOKE = Shape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, block_count=3,
              window_size=20, tokens=48, lengths=(48,), parity_length=48, decode_batch=2,
              decode_contexts=(64,),
              blocks=NSABlockSizes(cmp_keys=16, cmp_bwd_keys=16, cmp_bwd_queries_per_program=16,
                                   slc_queries_per_program=8, decode_splits=2))


# Launch-parameter candidates timed by --sweep (each compiles its own kernels).
SWEEP = (
    NSABlockSizes(),
    NSABlockSizes(slc_num_warps=2, slc_dq_num_warps=4),
    NSABlockSizes(slc_dq_num_warps=2),
    NSABlockSizes(cmp_positions=8, cmp_bwd_positions=8),
)


def make_inputs(key, batch: int, length: int, shape: Shape, dtype=jnp.bfloat16):
  """(q, k, v, gates, do) with random normals (keys x 2: peaked compressed attention) and
  sigmoided gates."""
  keys = jax.random.split(key, 5)
  normal = lambda k, heads, dim: jax.random.normal(k, (batch, length, heads, dim), jnp.float32)
  q = normal(keys[0], shape.num_q_heads, shape.head_dim)
  k = 2.0 * normal(keys[1], shape.num_kv_heads, shape.head_dim)
  v = normal(keys[2], shape.num_kv_heads, shape.head_dim)
  gates = jax.nn.sigmoid(normal(keys[3], shape.num_q_heads, 3))
  do = normal(keys[4], shape.num_q_heads, shape.head_dim)
  return tuple(x.astype(dtype) for x in (q, k, v, gates, do))


@functools.lru_cache(maxsize=None)
def ours(shape: Shape):
  """(jitted forward, jitted forward + gradients) of our Pallas NSA (one pair per shape, so that
  the parity check and the timings share compilations)."""
  attend = functools.partial(pallas.nsa_attention, block_sizes=shape.blocks, **shape.sizes)
  forward = jax.jit(lambda q, k, v, gates, do: attend(q, k, v, gates))

  @jax.jit
  def forward_backward(q, k, v, gates, do):
    out, vjp = jax.vjp(attend, q, k, v, gates)
    return out, vjp(do)

  return forward, forward_backward


def fla(shape: Shape):
  """(forward, forward + gradients, what FLA runs) on torch tensors (q, k, v, gates, do)."""
  import torch  # pylint: disable=import-outside-toplevel
  from fla.ops.attn import parallel_attn  # pylint: disable=import-outside-toplevel
  from fla.ops.nsa import parallel_nsa  # pylint: disable=import-outside-toplevel
  from fla.ops.nsa import parallel as fla_nsa  # pylint: disable=import-outside-toplevel
  fused_window = fla_nsa.flash_attn_func is not None

  def attend(q, k, v, gates):
    g_cmp, g_slc, g_swa = gates.unbind(-1)
    window = shape.window_size if fused_window else 0
    out = parallel_nsa(q, k, v, g_cmp, g_slc, g_swa, block_counts=shape.block_count,
                       block_size=shape.block_size, window_size=window)
    if not fused_window:
      out = out + parallel_attn(q, k, v, window_size=shape.window_size) * g_swa.unsqueeze(-1)
    return out

  def forward(q, k, v, gates, do):
    with torch.no_grad():
      return attend(q, k, v, gates)

  def forward_backward(q, k, v, gates, do):
    leaves = [x.detach().requires_grad_() for x in (q, k, v, gates)]
    attend(*leaves).backward(do)
    return [x.grad for x in leaves]

  how = ("parallel_nsa with its flash-attn window" if fused_window else
         "parallel_nsa without window + parallel_attn(window_size=512) (no flash-attn)")
  return forward, forward_backward, how


def to_torch(x):
  import torch  # pylint: disable=import-outside-toplevel
  return torch.from_numpy(np.asarray(x.astype(jnp.float32))).to("cuda", torch.bfloat16)


def relative_error(actual, expected) -> float:
  actual, expected = (np.asarray(x, np.float64) for x in (actual, expected))
  return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def parity(shape: Shape, use_fla: bool) -> list[str]:
  """Output and gradients of ours (and FLA) against the float32 reference at B1."""
  inputs = make_inputs(jax.random.key(1), 1, shape.parity_length, shape)
  f32 = [x.astype(jnp.float32) for x in inputs]
  attend = functools.partial(reference.nsa_attention, **shape.sizes)
  out, vjp = jax.vjp(attend, *f32[:4])
  expected = [out, *vjp(f32[4])]
  names = ("o", "dq", "dk", "dv", "dgates")
  runs = {"ours": ours(shape)[1](*inputs)}
  how = ""
  if use_fla:
    fla_forward, fla_forward_backward, how = fla(shape)
    torch_inputs = [to_torch(x) for x in inputs]
    runs["FLA"] = [fla_forward(*torch_inputs)] + fla_forward_backward(*torch_inputs)
  lines, results = [], {"float32 reference": expected}
  for who, result in runs.items():
    leaves = jax.tree.leaves(result) if who == "ours" else [x.float().cpu().numpy()
                                                            for x in result]
    results[who] = [np.asarray(a, np.float32) for a in leaves]
  # bf16 importances reorder near-equal blocks, and one changed selection moves that query's
  # output by O(1): ours vs FLA (both bf16) tells that apart from a kernel error.
  pairs = [(who, "float32 reference") for who in runs] + ([("ours", "FLA")] if use_fla else [])
  for who, other in pairs:
    errors = [relative_error(a, e) for a, e in zip(results[who], results[other])]
    lines.append(f"parity B1 T{shape.parity_length} {who} vs {other}: "
                 + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errors))
                 + (f" ({how})" if "FLA" in (who, other) else ""))
    print(lines[-1], flush=True)
  return lines


def time_training(shape: Shape, args, rows: list) -> None:
  for length in shape.lengths:
    batch = max(1, shape.tokens // length)
    inputs = make_inputs(jax.random.key(2), batch, length, shape)
    ours_fns = ours(shape)
    fla_fns = fla(shape)[:2] if args.fla else (None, None)
    torch_inputs = [to_torch(x) for x in inputs] if args.fla else None
    for mode, ours_fn, fla_fn in zip(("fwd", "fwd+bwd"), ours_fns, fla_fns):
      start = time.perf_counter()  # the first call compiles: how long a user waits for it
      jax.block_until_ready(ours_fn(*inputs))
      first_call_s = time.perf_counter() - start
      ours_timed = Timed(ours_fn, [inputs])
      if fla_fn is None:
        ms = median_ms(ours_fn, [inputs], warmup=args.warmup, repeats=args.iters)
        rows.append(dict(kind="train", batch=batch, length=length, mode=mode, ours_ms=ms,
                         first_call_s=first_call_s))
      else:
        import torch  # pylint: disable=import-outside-toplevel
        fla_timed = Timed(fla_fn, [torch_inputs], sync=lambda _: torch.cuda.synchronize())
        run_for_seconds(ours_timed, seconds=args.warmup_s)
        ms, fla_ms = paired_ms(ours_timed, fla_timed, warmup=args.warmup, rounds=args.iters)
        rows.append(dict(kind="train", batch=batch, length=length, mode=mode, ours_ms=ms,
                         fla_ms=fla_ms, ratio=ms / fla_ms, first_call_s=first_call_s))
      if jax.default_backend() == "gpu":  # which kernels take the time (profiler trace)
        rows[-1]["kernels"] = kernel_breakdown(kernel_times(ours_timed, passes=3))
      print(json.dumps(rows[-1]), flush=True)


def kernel_breakdown(times, calls: int = 1, top: int = 12) -> dict:
  """{kernel: [launches, GPU us]} per call of the `top` kernels by GPU time in `times` (a
  `kernel_times` result over passes of `calls` calls each), and the sum of all under "total"."""
  per_call = lambda launches, us: [launches / calls, round(us / calls, 2)]
  kernels = {name: per_call(launches, us)
             for name, (launches, us) in list(times.kernels.items())[:top]}
  return dict(kernels, total=per_call(sum(n for n, _ in times.kernels.values()), times.busy_us))


def sweep(shape: Shape, args, rows: list) -> None:
  """Ours alone, fwd and fwd+bwd, for each SWEEP candidate at each length."""
  for blocks in SWEEP:
    candidate = dataclasses.replace(shape, blocks=blocks)
    changed = {f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)
               if getattr(blocks, f.name) != f.default}
    for length in shape.lengths:
      batch = max(1, shape.tokens // length)
      inputs = make_inputs(jax.random.key(2), batch, length, shape)
      for mode, fn in zip(("fwd", "fwd+bwd"), ours(candidate)):
        row = dict(kind="train", batch=batch, length=length, mode=mode,
                   blocks=str(changed or "defaults"))
        try:
          row["ours_ms"] = median_ms(fn, [inputs], warmup=args.warmup, repeats=args.iters)
          if jax.default_backend() == "gpu":
            row["kernels"] = kernel_breakdown(kernel_times(Timed(fn, [inputs]), passes=3))
        except Exception as error:  # pylint: disable=broad-except
          # A candidate that fails to compile must not hide the others' numbers.
          row["failed"] = str(error)[:500]
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)


def decode_case(shape: Shape, context: int, sets: int):
  """(the decode attention of one cache, `sets` caches' inputs, bytes one step must read per
  cache)."""
  batch, heads, kv_heads, dim = (shape.decode_batch, shape.num_q_heads, shape.num_kv_heads,
                                 shape.head_dim)
  num_blocks = compressed_blocks(context, shape.block_size, shape.blocks)
  position = jnp.full((batch,), context - 1, jnp.int32)
  caches = []
  for i in range(sets):
    keys = jax.random.split(jax.random.key(10 + i), 4)
    k = 2.0 * jax.random.normal(keys[0], (batch, context, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[1], (batch, context, kv_heads, dim), jnp.bfloat16)
    k_cmp, v_cmp = compress_prompt(k, v, position + 1, block_size=shape.block_size,
                                   num_blocks=num_blocks)
    q = jax.random.normal(keys[2], (batch, heads, dim), jnp.bfloat16)
    gates = jax.nn.sigmoid(jax.random.normal(keys[3], (batch, heads, 3), jnp.float32))
    # A layer group's caches as the model holds them, stacked over its groups (here one).
    caches.append((q, gates.astype(jnp.bfloat16), k[None], v[None], k_cmp[None], v_cmp[None],
                   position, jnp.zeros((), jnp.int32)))
  attend = functools.partial(pallas_decode.decode_attention, block_sizes=shape.blocks,
                             **shape.sizes)
  window = min(shape.window_size, context)
  keys_read = shape.block_count * shape.block_size + window + context // shape.block_size
  moved = batch * (kv_heads * keys_read * dim * 2 * 2 + 2 * heads * dim * 2)
  return attend, caches, moved


def looped_decode(attend, caches, rounds: int) -> Timed:
  """`rounds` rounds over every cache in one jitted call, compiled as the model's decode step is
  (`generate.DECODE_COMPILER_OPTIONS`: every run of kernels a CUDA graph), so that one dispatch
  is paid per rounds x len(caches) steps, as in a decode loop. Each step's query is chained to
  the previous output (q + 0 * o), so XLA can neither hoist nor merge the steps."""

  def run_rounds(caches):
    def one_round(_, o):
      for q, *rest in caches:
        o = attend(q + 0 * o, *rest)
      return o
    return jax.lax.fori_loop(0, rounds, one_round, jnp.zeros_like(caches[0][0]))
  return Timed(jax.jit(run_rounds, compiler_options=DECODE_COMPILER_OPTIONS), [(caches,)])


def time_decode(shape: Shape, args, rows: list) -> None:
  """Three times per context, each as bytes / time against a copy timed the same way: one jitted
  call over `--sets` caches per dispatch (wall), the looped decode (wall), and the kernels'
  GPU time from a profiler trace (with the kernels of a step, to see where it goes)."""
  x = jnp.ones((2,) if args.smoke else (512, 1024, 1024), jnp.bfloat16)
  copy = Timed(jax.jit(lambda x: x + 1), [(x,)])
  copy_rounds = looped_copy(copy, args.rounds)
  copy_bytes = 2 * x.size * x.dtype.itemsize
  on_gpu = jax.default_backend() == "gpu"
  copy_gpu_gbps = (copy_bytes / kernel_times(copy, passes=5).busy_us / 1e3 if on_gpu
                   else float("nan"))
  for context in shape.decode_contexts:
    attend, caches, moved = decode_case(shape, context, args.sets)
    per_call = Timed(jax.jit(lambda caches: [attend(*c) for c in caches]), [(caches,)])
    ms, copy_ms = paired_ms(per_call, copy, warmup=args.warmup, rounds=args.iters)
    step_us = 1e3 * ms / args.sets
    gbps, copy_gbps = moved / (step_us * 1e3), copy_bytes / (copy_ms * 1e6)
    looped_ms, looped_copy_ms = paired_ms(looped_decode(attend, caches, args.rounds),
                                          copy_rounds, warmup=args.warmup, rounds=args.iters)
    looped_us = 1e3 * looped_ms / (args.rounds * args.sets)
    looped_copy_gbps = copy_bytes * args.rounds / (looped_copy_ms * 1e6)
    row = dict(kind="decode", batch=shape.decode_batch, context=context, step_us=step_us,
               bytes=moved, gb_per_s=gbps, copy_gb_per_s=copy_gbps, ratio=gbps / copy_gbps,
               rounds=args.rounds, looped_us=looped_us,
               looped_ratio=moved / (looped_us * 1e3) / looped_copy_gbps)
    if on_gpu:
      times = kernel_times(per_call, passes=5)
      row.update(gpu_us=times.busy_us / args.sets,
                 gpu_ratio=moved * args.sets / times.busy_us / 1e3 / copy_gpu_gbps,
                 kernels=kernel_breakdown(times, calls=args.sets))
    rows.append(row)
    print(json.dumps(row), flush=True)


def print_table(rows: list, lines: list) -> None:
  print("\n| what | shape | ours | FLA / copy | ratio |\n| --- | --- | --- | --- | --- |")
  for row in rows:
    if row["kind"] == "train":
      fla_ms = f"{row['fla_ms']:.3f} ms" if "fla_ms" in row else "-"
      ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "-"
      mode = row["mode"] + (f" {row['blocks']}" if "blocks" in row else "")
      first = f" (first call {row['first_call_s']:.0f} s)" if "first_call_s" in row else ""
      ours = "FAILED" if "failed" in row else f"{row['ours_ms']:.3f} ms{first}"
      print(f"| train {mode} | B{row['batch']} T{row['length']} | {ours} | {fla_ms} | {ratio} |")
    else:
      gpu = (f"; GPU time {row['gpu_us']:.1f} us, {row['gpu_ratio']:.2f} of the copy's"
             if "gpu_us" in row else "")
      print(f"| decode step | B{row['batch']} context {row['context']} |"
            f" {row['step_us']:.1f} us per call, {row['gb_per_s']:.0f} GB/s; looped"
            f" {row['looped_us']:.1f} us{gpu} | {row['copy_gb_per_s']:.0f} GB/s |"
            f" {row['ratio']:.2f}; looped {row['looped_ratio']:.2f} |")
  print("\n".join(lines))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes in interpret mode, no FLA (runs on CPU)")
  parser.add_argument("--lengths", type=int, nargs="*", help="only these training T")
  parser.add_argument("--no-fla", dest="fla", action="store_false")
  parser.add_argument("--no-parity", dest="parity", action="store_false")
  parser.add_argument("--no-training", dest="training", action="store_false")
  parser.add_argument("--no-decode", dest="decode", action="store_false")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--warmup-s", type=float, default=2.0,
                      help="seconds of our calls before each pairing (GPU clocks)")
  parser.add_argument("--sets", type=int, default=4, help="decode caches per timed call")
  parser.add_argument("--rounds", type=int, default=8,
                      help="rounds over the sets per jitted call in the looped decode timing")
  parser.add_argument("--sweep", action="store_true",
                      help="time ours for each launch-parameter candidate of SWEEP (no FLA)")
  parser.add_argument("--json", help="also write the rows and parity lines here")
  args = parser.parse_args(argv)
  shape = SMOKE if args.smoke else Shape()
  if args.smoke:
    args.fla, args.warmup, args.iters, args.warmup_s, args.sets, args.rounds = (
        False, 1, 2, 0.0, 2, 2)
  if args.lengths:
    shape = dataclasses.replace(shape, lengths=tuple(args.lengths))
  print(f"devices: {jax.devices()}, jax {jax.__version__}", flush=True)
  rows, lines = [], []
  steps = [("parity", lambda: lines.extend(parity(shape, args.fla)))] if args.parity else []
  if args.training:
    steps.append(("training",
                  lambda: (sweep if args.sweep else time_training)(shape, args, rows)))
  if args.decode:
    steps.append(("decode", lambda: time_decode(shape, args, rows)))
  for name, run in steps:
    try:
      run()
    except Exception as error:  # pylint: disable=broad-except
      # One failing part must not hide the others' numbers in a single GPU run.
      lines.append(f"{name} FAILED: {str(error)[:2000]}")
      print(lines[-1], flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as file:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "command": "python tools/bench_nsa.py " + " ".join(
                     sys.argv[1:] if argv is None else argv),
                 "rows": rows, "parity": lines}, file, indent=2)
  print_table(rows, lines)
  return 0 if not any("FAILED" in line for line in lines) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  sys.exit(main())
