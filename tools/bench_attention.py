"""Attention kernels on the GPU: parity spot checks, timings against cuDNN and FLA, and a tiny laLTE
training step through the Pallas kernels vs the XLA reference.

    python tools/bench_attention.py            # B8 T4096, B4 T8192, B2 T16384 (Hq32 Hkv8 D64 bf16)
    python tools/bench_attention.py --quick    # B8 T4096 only
    python tools/bench_attention.py --sweep --heads 16 16 --lte 769 512 --only "LTE train" --no-fla \
        --no-checks    # backward blocks at a lalte-0.4b layer (G=1, routers keeping 12.5%)

Timed: each JAX variant in alternation with its anchor (`paired_ms`: --iters rounds of one pass
over three input sets each, after --warmup; the ratio is of the two medians, so both see the same
GPU clocks); the anchors alone and FLA as medians of --iters single calls (FLA around
torch.cuda.synchronize):
  ours SWA-1024; ours LTE training (window 769 keys, 4 sinks, 256 kept columns per KV head at
  random positions); ours LTE prefill forward (window 769 + 256 kept keys = a half-full 512-slot
  cache, with and without a key-padding mask); ours full causal; cuDNN SWA-1024 and causal through
  jax.nn.dot_product_attention(implementation="cudnn"); FLA parallel_attn (window 1024, causal).
"fwd+bwd" is one jitted call that runs the forward and the gradients wrt q, k, v.
Ratios are against cuDNN SWA-1024 (or cuDNN causal for causal rows) in the same run and mode.
"""

from __future__ import annotations

import argparse
import json
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.benchmarking import Timed, median_ms, paired_ms, run_for_seconds
from pallas_kernels.masked_attention import compaction, masked_attention, reference
from pallas_kernels.masked_attention import pallas as attention_pallas
from pallas_kernels.masked_attention.tiling import BlockSizes

SHAPES = ((8, 4096), (4, 8192), (2, 16384))
HEAD_DIM = 64
# Block-size candidates timed by --sweep (B8 T4096). SWEEP_FORWARD changes forward blocks only and
# is timed "fwd" on SWA-1024 and on the LTE prefill. SWEEP_BACKWARD changes backward blocks only
# and is timed "fwd+bwd" on SWA-1024 and on the LTE training call.
SWEEP_FORWARD = (
    BlockSizes(),
    # 64 x 128 tiles on one warpgroup: the tile of cuDNN's SWA forward kernel on an H100 (its
    # name in a profile, 2026-11-23: ..._flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1).
    BlockSizes(block_k=128),
    BlockSizes(block_k=128, num_stages=2),
    BlockSizes(block_k=128, num_stages=4),
    BlockSizes(block_k=128, num_warps=8),
    BlockSizes(num_stages=2),
    BlockSizes(num_stages=4),
    BlockSizes(block_q=128, block_k=128, num_warps=8),
    BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
    BlockSizes(block_q=128, block_k=32, num_stages=3),
    # 128-row query tiles on one warpgroup (two independent 64-row halves per step; 896 keys
    # visited per window instead of 832, so it must win > 8% per tile).
    BlockSizes(block_q=128),
    BlockSizes(block_q=128, num_stages=2),
    BlockSizes(block_k=32, num_stages=4),
)
SWEEP_BACKWARD = (
    BlockSizes(),
    BlockSizes(block_q_dq=128, block_k_dq=64, block_q_dkv=64, block_k_dkv=128, num_warps_bwd=8),
    BlockSizes(block_q_dq=64, block_k_dq=32, block_q_dkv=32, block_k_dkv=64, num_stages_bwd=3),
    BlockSizes(block_q_dq=128, block_k_dq=32, block_q_dkv=32, block_k_dkv=128, num_warps_bwd=8),
    BlockSizes(block_q_dq=64, block_k_dq=64, block_q_dkv=64, block_k_dkv=64, num_stages_bwd=3),
    # Deeper pipelines: with one query head per KV head (the 0.4b presets) each dk/dv program's
    # loop is 4x shorter than at four, and three stages measured 7% faster on LTE training there.
    BlockSizes(num_stages_bwd=4),
    BlockSizes(num_stages_bwd=3, num_warps_bwd=8),
    BlockSizes(block_q_dkv=32, num_stages_bwd=3),
    BlockSizes(block_k_dq=32, num_stages_bwd=3),
    BlockSizes(block_q_dkv=32, num_stages_bwd=4),
    BlockSizes(block_k_dkv=128, num_warps_bwd=8, num_stages_bwd=3),
    # The kept-list dk/dv kernel split into query chunks (float32 atomics) below 8192 queries:
    # more, shorter programs. One program per list tile walks every later query tile; with one
    # query head per KV head (lalte-0.4b) the oldest tile's ~50 steps in a row may bound the call.
    BlockSizes(kept_split_from=1, kept_split_tiles=8),
    BlockSizes(kept_split_from=1, kept_split_tiles=4),
    BlockSizes(kept_split_from=1, kept_split_tiles=2),
    BlockSizes(kept_split_from=1, kept_split_tiles=1),
)
SWA_WINDOW, LTE_SINKS = 1024, 4


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Heads and the LTE calls' window (keys a query sees, itself included) and kept keys per KV
  head. The defaults are the shape the kernels were tuned at (a lalte-1.4b layer: 32 query heads
  over 8 KV heads); `--heads 16 16 --lte 769 512` is a lalte-0.4b layer (one query head per KV
  head) with its routers keeping 12.5% of 4096 tokens."""
  num_q_heads: int = 32
  num_kv_heads: int = 8
  lte_window_keys: int = 769
  lte_kept: int = 256

  @property
  def lte_train(self) -> str:
    return f"ours LTE train ({self.lte_window_keys} + {LTE_SINKS} sinks + {self.lte_kept} kept)"

  @property
  def lte_prefill(self) -> str:
    return f"ours LTE prefill ({self.lte_window_keys} + {self.lte_kept} kept)"


def random_kept(key, batch, length, num_kv_heads, count):
  """bool [B, S, Hkv] with exactly `count` True per (batch, KV head) at random positions."""
  scores = jax.random.uniform(key, (batch, num_kv_heads, length))
  threshold = jnp.sort(scores, axis=-1)[..., -count][..., None]
  return jnp.transpose(scores >= threshold, (0, 2, 1))


def kept_list_alone(q, k, v, kept, key_valid, *, window_size):
  """What masked_attention computes in XLA before the LTE prefill kernel (no key padding mask):
  the list's positions and the per-tile counts (the prefill reads K/V by position, no copies)."""
  del key_valid
  batch, length, num_kv_heads, _ = k.shape
  listed = compaction.listed_keys(batch=batch, key_len=length, num_kv_heads=num_kv_heads,
                                  num_sinks=0, kept_BSK=kept, key_valid_BS=None)
  kept_list, counts = compaction.kept_list_and_counts(
      listed, capacity=length, block_qs=(BlockSizes().block_q,), padded_query_len=q.shape[1],
      query_offset=0, window_size=window_size)
  return kept_list.positions_BKC, counts


def jax_variants(block_sizes=None, geometry=Geometry()):
  """name -> (attention fn of (q, k, v, kept, key_valid), anchor name).

  kept/key_valid are jit arguments: closed over, they would be constants that XLA folds slowly.
  """
  def ours_blocks(blocks, use_kept=False, use_valid=False, **kw):
    def attn(q, k, v, kept, key_valid):
      masks = dict(kept_BSK=kept if use_kept else None,
                   key_valid_BS=key_valid if use_valid else None)
      if blocks is not None:
        return attention_pallas.masked_attention(q, k, v, block_sizes=blocks, **kw, **masks)
      return masked_attention(q, k, v, implementation="pallas", **kw, **masks)
    return attn

  ours = functools.partial(ours_blocks, block_sizes)
  window = geometry.lte_window_keys

  cudnn = lambda window: (lambda q, k, v, kept, key_valid: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn",
      local_window_size=None if window is None else (window - 1, 0)))
  return {
      "cuDNN SWA-1024": (cudnn(SWA_WINDOW), "cuDNN SWA-1024"),
      "ours SWA-1024": (ours(window_size=SWA_WINDOW), "cuDNN SWA-1024"),
      geometry.lte_train: (
          ours(True, window_size=window, num_sinks=LTE_SINKS), "cuDNN SWA-1024"),
      geometry.lte_prefill: (ours(True, window_size=window), "cuDNN SWA-1024"),
      # The prefill's window part alone: what the kept list adds to the prefill is the difference.
      f"ours SWA-{window} (the prefill without its kept list)": (
          ours(window_size=window), "cuDNN SWA-1024"),
      "ours LTE prefill + padding mask": (ours(True, True, window_size=window), "cuDNN SWA-1024"),
      # The XLA part of the prefill alone (kept list: positions, gathered K/V copies, per-tile
      # counts), to tell it from the kernel's time.
      "ours LTE prefill's kept list alone": (
          functools.partial(kept_list_alone, window_size=window), "cuDNN SWA-1024"),
      "cuDNN causal": (cudnn(None), "cuDNN causal"),
      "ours causal": (ours(), "cuDNN causal"),
  }


FORWARD_ONLY = ("prefill",)


def fwd_and_bwd(attn):
  def run(q, k, v, do, *extra):
    out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *extra), q, k, v)
    return out, vjp(do)
  return jax.jit(run)


def anchor_ms_of(results, key):
  """The anchor time a result's ratio uses: its own paired one, else the anchor's separate run."""
  ms, anchor, *paired = results[key]
  if paired:
    return paired[0]
  return results.get((key[0], anchor, key[2]), (float("nan"),))[0]


def record(results, key, ms, anchor, paired_anchor_ms=None):
  """Stores (ms, anchor name[, the anchor's ms timed in alternation with this one])."""
  results[key] = (ms, anchor) if paired_anchor_ms is None else (ms, anchor, paired_anchor_ms)
  anchor_ms = anchor_ms_of(results, key)
  paired = "" if paired_anchor_ms is None else f" (paired: {anchor_ms:.3f} ms)"
  print(f"  {' | '.join(key)} | {ms:.3f} ms | {ms / anchor_ms:.2f}x {anchor}{paired}", flush=True)


def selected(name: str, only) -> bool:
  """--only: a word selects the names that contain it; "=NAME" selects NAME alone."""
  return any(name == word[1:] if word.startswith("=") else word in name for word in only)


def input_sets(batch, length, geometry, sets=3):
  """(forward sets (q, k, v, kept, key_valid), fwd+bwd sets (q, k, v, do, kept, key_valid)):
  bf16 normals, `random_kept` columns shared by the sets, no padding."""
  heads, kv_heads = geometry.num_q_heads, geometry.num_kv_heads
  keys = jax.random.split(jax.random.key(0), 4 * sets + 1)
  normal = lambda key, heads: jax.random.normal(
      key, (batch, length, heads, HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
  arg_sets = [(normal(keys[4 * i], heads), normal(keys[4 * i + 1], kv_heads),
               normal(keys[4 * i + 2], kv_heads), normal(keys[4 * i + 3], heads))
              for i in range(sets)]
  kept = random_kept(keys[-1], batch, length, kv_heads, geometry.lte_kept)
  key_valid = jnp.ones((batch, length), bool)
  return ([(q, k, v, kept, key_valid) for q, k, v, _ in arg_sets],
          [(q, k, v, do, kept, key_valid) for q, k, v, do in arg_sets])


def bench_jax(batch, length, args, results):
  geometry = args.geometry
  fwd_sets, bwd_sets = input_sets(batch, length, geometry)
  shape = f"B{batch} T{length}"
  variants = jax_variants(geometry=geometry)
  if args.only:
    variants = {name: value for name, value in variants.items()
                if selected(name, args.only)}
  modes = {name: ("fwd", "fwd+bwd") for name in variants}
  if args.sweep:
    variants = {"cuDNN SWA-1024": jax_variants()["cuDNN SWA-1024"]}
    modes = {"cuDNN SWA-1024": ("fwd", "fwd+bwd")}
    swept = (("ours SWA-1024", "fwd", SWEEP_FORWARD),
             (geometry.lte_prefill, "fwd", SWEEP_FORWARD),
             ("ours SWA-1024", "fwd+bwd", SWEEP_BACKWARD),
             (geometry.lte_train, "fwd+bwd", SWEEP_BACKWARD))
    for base, tag, candidates in swept:
      for blocks in candidates:
        changed = {f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)
                   if getattr(blocks, f.name) != f.default}
        name = f"{base} {changed or 'defaults'}"
        if args.only and not selected(name, args.only):
          continue
        variants[name] = (jax_variants(blocks, geometry)[base][0], "cuDNN SWA-1024")
        modes[name] = modes.get(name, ()) + (tag,)
  # Sustained load first: without it the first variant timed (the anchor) measured up to ~10%
  # slow on one H100 while the clocks ramped up (2026-11-22), which flattered every ratio.
  anchor_fns = {}
  for anchor_name in {anchor for _, anchor in variants.values()}:
    anchor_attn = jax_variants()[anchor_name][0]
    anchor_fns[anchor_name] = {"fwd": jax.jit(anchor_attn), "fwd+bwd": fwd_and_bwd(anchor_attn)}
  warm_up_anchor = anchor_fns.get("cuDNN SWA-1024") or next(iter(anchor_fns.values()))
  run_for_seconds(Timed(warm_up_anchor["fwd+bwd"], bwd_sets), seconds=args.warmup_s)
  for name, (attn, anchor) in variants.items():
    try:
      for mode, make, sets in (("fwd", jax.jit, fwd_sets), ("fwd+bwd", fwd_and_bwd, bwd_sets)):
        if mode not in modes[name] or (mode == "fwd+bwd"
                                       and any(word in name for word in FORWARD_ONLY)):
          continue
        if name == anchor:  # the anchor alone, as before (and for variants without pairing)
          record(results, (shape, name, mode),
                 median_ms(make(attn), sets, warmup=args.warmup, repeats=args.iters), anchor)
          continue
        ms, anchor_ms = paired_ms(Timed(make(attn), sets), Timed(anchor_fns[anchor][mode], sets),
                                  warmup=args.warmup, rounds=args.iters)
        record(results, (shape, name, mode), ms, anchor, anchor_ms)
    except Exception as error:  # pylint: disable=broad-except
      # One failing variant must not hide the others' numbers in a single GPU run.
      print(f"  {shape} {name}: FAILED {str(error)[:2000]}", flush=True)


def bench_fla(batch, length, args, results):
  import torch  # pylint: disable=import-outside-toplevel
  from fla.ops.attn import parallel_attn  # pylint: disable=import-outside-toplevel
  shape = f"B{batch} T{length}"
  gen = torch.Generator(device="cuda").manual_seed(0)
  normal = lambda heads: torch.randn(batch, length, heads, HEAD_DIM, device="cuda",
                                     dtype=torch.bfloat16, generator=gen)
  heads, kv_heads = args.geometry.num_q_heads, args.geometry.num_kv_heads
  arg_sets = [(normal(heads), normal(kv_heads), normal(kv_heads), normal(heads))
              for _ in range(3)]
  sync = lambda _: torch.cuda.synchronize()
  for window, name, anchor in ((SWA_WINDOW, "FLA SWA-1024", "cuDNN SWA-1024"),
                               (None, "FLA causal", "cuDNN causal")):
    if args.only and not selected(name, args.only):
      continue
    def fwd(q, k, v, window=window):
      with torch.no_grad():
        return parallel_attn(q, k, v, window_size=window)

    def fwd_bwd(q, k, v, do, window=window):
      q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
      parallel_attn(q, k, v, window_size=window).backward(do)
      return q.grad

    record(results, (shape, name, "fwd"), median_ms(
        fwd, [a[:3] for a in arg_sets], warmup=args.warmup, repeats=args.iters, sync=sync),
        anchor)
    record(results, (shape, name, "fwd+bwd"), median_ms(
        fwd_bwd, arg_sets, warmup=args.warmup, repeats=args.iters, sync=sync), anchor)


def relative_error(actual, expected) -> float:
  actual, expected = (np.asarray(x, np.float64) for x in (actual, expected))
  return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def parity_checks(geometry):
  """Ours vs cuDNN (SWA-1024, B8 T4096) and vs the XLA reference (LTE, B1 T4096): fwd and grads."""
  lines = []
  heads, kv_heads = geometry.num_q_heads, geometry.num_kv_heads
  keys = jax.random.split(jax.random.key(7), 5)
  for batch, against in ((8, "cuDNN"), (1, "reference")):
    shape = lambda heads: (batch, 4096, heads, HEAD_DIM)
    q = jax.random.normal(keys[0], shape(heads)).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], shape(kv_heads)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], shape(kv_heads)).astype(jnp.bfloat16)
    do = jax.random.normal(keys[3], shape(heads)).astype(jnp.bfloat16)
    if against == "cuDNN":
      kwargs = dict(window_size=SWA_WINDOW)
      expected_fn = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn", local_window_size=(SWA_WINDOW - 1, 0))
      label = "SWA-1024 B8 T4096 vs cuDNN"
    else:
      kept = random_kept(keys[4], batch, 4096, kv_heads, geometry.lte_kept)
      kwargs = dict(window_size=geometry.lte_window_keys, num_sinks=LTE_SINKS, kept_BSK=kept)
      f32 = lambda x: x.astype(jnp.float32)
      expected_fn = lambda q, k, v: reference.masked_attention(
          f32(q), f32(k), f32(v), **kwargs).astype(jnp.bfloat16)
      label = "LTE B1 T4096 vs f32 reference"
    ours = fwd_and_bwd(lambda q, k, v: masked_attention(q, k, v, implementation="pallas",
                                                        **kwargs))(q, k, v, do)
    theirs = fwd_and_bwd(expected_fn)(q, k, v, do)
    errors = [relative_error(a.astype(jnp.float32), b.astype(jnp.float32))
              for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs))]
    lines.append(f"parity {label}: rel err o/dq/dk/dv = " + " / ".join(f"{e:.2e}" for e in errors))
    print(lines[-1], flush=True)
  return lines


def tiny_model_check():
  """One laLTE-tiny loss + grads through Pallas attention vs the XLA reference (GDN on XLA)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from lalte_jax.config import get_model_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.loss import next_token_cross_entropy  # pylint: disable=import-outside-toplevel
  from lalte_jax.model import HybridLM  # pylint: disable=import-outside-toplevel
  lines = []
  tokens = jax.random.randint(jax.random.key(3), (2, 256), 0, 256)
  for dtype in ("float32", "bfloat16"):
    losses, grad_norms = {}, {}
    for impl in ("xla", "pallas"):
      base = get_model_config("lalte-tiny").replace(dtype=dtype)
      config = base.replace(lte=dataclasses.replace(base.lte, implementation=impl))
      if config.gdn is not None:
        config = config.replace(gdn=dataclasses.replace(config.gdn, implementation="xla"))
      model = HybridLM(config, rngs=nnx.Rngs(0))

      @nnx.jit
      def loss_and_grads(model, tokens):
        return nnx.value_and_grad(
            lambda m: next_token_cross_entropy(m(tokens), tokens))(model)

      loss, grads = loss_and_grads(model, tokens)
      leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
      losses[impl] = float(loss)
      grad_norms[impl] = float(jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                                            for g in leaves)))
    lines.append(
        f"laLTE-tiny {dtype} B2 T256: loss xla {losses['xla']:.6f} pallas {losses['pallas']:.6f}"
        f" (|diff| {abs(losses['xla'] - losses['pallas']):.2e}); grad norm xla"
        f" {grad_norms['xla']:.5f} pallas {grad_norms['pallas']:.5f}")
    print(lines[-1], flush=True)
  return lines


def write_json(path, results, argv) -> None:
  """{"device", "command", "timings": [{batch, length, kernel, mode, ms, anchor, ratio}]}."""
  timings = []
  for key, (ms, anchor, *_) in results.items():
    shape, name, mode = key
    batch, length = (int(part[1:]) for part in shape.split())  # "B8 T4096"
    anchor_ms = anchor_ms_of(results, key)
    timings.append({"batch": batch, "length": length, "kernel": name, "mode": mode, "ms": ms,
                    "anchor": anchor, "anchor_ms": anchor_ms, "ratio": ms / anchor_ms})
  payload = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "command": "python tools/bench_attention.py " + " ".join(
                 sys.argv[1:] if argv is None else argv), "timings": timings}
  with open(path, "w", encoding="utf-8") as file:
    json.dump(payload, file, indent=2)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="B8 T4096 only")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--iters", type=int, default=15)
  parser.add_argument("--warmup-s", type=float, default=3.0,
                      help="seconds of anchor calls before each shape's timings (GPU clocks)")
  parser.add_argument("--no-fla", action="store_true")
  parser.add_argument("--sweep", action="store_true",
                      help="time SWA-1024, LTE prefill and LTE training at B8 T4096 for each"
                      " block-size candidate in SWEEP_*")
  parser.add_argument("--lengths", type=int, nargs="*",
                      help="only these T of SHAPES (B8 T4096, B4 T8192, B2 T16384)")
  parser.add_argument("--only", nargs="*", help="only variants whose name contains one of these"
                      " or, for a word '=NAME', is NAME (with --sweep: only those candidates;"
                      " cuDNN SWA-1024 is always timed)")
  parser.add_argument("--no-checks", action="store_true", help="skip parity and model checks")
  parser.add_argument("--heads", type=int, nargs=2, default=None, metavar=("HQ", "HKV"),
                      help="query and KV heads (default 32 8)")
  parser.add_argument("--lte", type=int, nargs=2, default=None, metavar=("WINDOW_KEYS", "KEPT"),
                      help="the LTE calls' window in keys and kept keys per KV head (default"
                           " 769 256)")
  parser.add_argument("--json", help="also write every timing here (tools/plot_results.py"
                      " --kernel-bench draws time against sequence length from it)")
  args = parser.parse_args(argv)
  fields = {}
  if args.heads:
    fields.update(num_q_heads=args.heads[0], num_kv_heads=args.heads[1])
  if args.lte:
    fields.update(lte_window_keys=args.lte[0], lte_kept=args.lte[1])
  args.geometry = Geometry(**fields)
  if min(dataclasses.astuple(args.geometry)) <= 0 or (
      args.geometry.num_q_heads % args.geometry.num_kv_heads):
    parser.error(f"--heads/--lte: positive numbers, KV heads dividing query heads; got"
                 f" {args.geometry}")
  print(f"devices: {jax.devices()}, jax {jax.__version__}, {args.geometry}", flush=True)
  results = {}
  shapes = SHAPES[:1] if args.quick or args.sweep else SHAPES
  if args.lengths:
    shapes = [(batch, length) for batch, length in SHAPES if length in args.lengths]
  for batch, length in shapes:
    bench_jax(batch, length, args, results)
    if not args.no_fla and not args.sweep:
      try:
        bench_fla(batch, length, args, results)
      except Exception as error:  # pylint: disable=broad-except
        print(f"FLA failed at B{batch} T{length}: {error!r}", flush=True)
  if args.json:  # now, so that the timings survive a time limit hit by the checks below
    write_json(args.json, results, argv)
  lines = []
  checks = (("parity_checks", functools.partial(parity_checks, args.geometry)),
            ("tiny_model_check", tiny_model_check))
  for check_name, check in () if args.no_checks else checks:
    try:
      lines += check()
    except Exception as error:  # pylint: disable=broad-except
      lines.append(f"{check_name} FAILED: {str(error)[:2000]}")
      print(lines[-1], flush=True)
  print("\n| shape | kernel | mode | ms | vs anchor |\n| --- | --- | --- | --- | --- |")
  for key, (ms, anchor, *_) in results.items():
    shape, name, mode = key
    anchor_ms = anchor_ms_of(results, key)
    print(f"| {shape} | {name} | {mode} | {ms:.3f} | {ms / anchor_ms:.2f}x {anchor} |")
  print("\n" + "\n".join(lines))
  if args.json:
    write_json(args.json, results, argv)
  print("command: python tools/bench_attention.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv))
  return 0


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  sys.exit(main())
