"""GDN kernel on the GPU: forward parity and speed against FLA, plus a tiny-model training check.

One process, one GPU (docs/benchmarks.md, "GDN kernel", has the numbers and the command):
1. for each benchmark shape (bf16, l2-norm on), the same random inputs go to FLA's
   `chunk_gated_delta_rule` (PyTorch, shared through DLPack, so the values are identical) and to
   ours (`implementation="pallas"`); prints the forward's relative difference, and the forward
   and forward+backward times of ours and FLA timed in alternation after warm-up (two rotating
   input sets; `pallas_kernels.benchmarking.paired_ms`) with their ratios.
   Also times our pieces: the preparation (step a; forward, and forward + backward) and its
   parts (layout, decays, WY transform), the chunk inverse inside it (by launch width) and the
   Pallas chunk scan alone; our numbers are printed before FLA runs (its first call per shape
   autotunes for minutes).
2. `--sweep`: times the chunk-scan kernels alone under several launch configurations;
   `--sweep-prep`: the preparation kernels (the default) forward and forward + backward by launch
   config (pallas_prepare.PrepareConfig), next to the XLA preparation's.
3. a tiny GDN model (`gdn-tiny`, bf16) trains a few steps with the Pallas kernel and with the XLA
   reference from the same initial weights and batches; the losses must agree within the bf16
   tolerance (2e-2 relative).

FLA 0.6.0 refuses its gated backward (chunk_bwd_dqkwg) on Hopper with Triton < 3.7.1 (FLA issue
#640: results can be wrong). The image has Triton 3.6.0, so for a *timing anchor only* this script
disables that guard (fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True); FLA's gradients are never
compared. Our gradients are checked against the float64 recurrence by the gpu tests instead.

Run on the GPU machine:
`python3 tools/compare_fla.py [--quick] [--sweep] [--sweep-prep] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
from pallas_kernels.benchmarking import Timed, median_ms, paired_ms, run_for_seconds
from pallas_kernels.gated_delta_rule import ChunkConfig, StatePassConfig, chunk_gated_delta_rule
from pallas_kernels.gated_delta_rule.xla_prepare import (
    chunk_decays,
    chunk_layout,
    prepare_scan_inputs,
    wy_transform,
)
from pallas_kernels.gated_delta_rule.pallas_inverse import inverse_forward
from pallas_kernels.gated_delta_rule.pallas_prepare import PrepareConfig, prepare_chunks
from pallas_kernels.gated_delta_rule.pallas_state_pass import chunk_scan, default_state_config

# (B, T, H, K=V): the benchmark shapes (docs/benchmarks.md, "GDN kernel against FLA").
SHAPES = ((8, 4096, 8, 256), (8, 4096, 8, 128), (1, 16384, 8, 128), (4, 4096, 64, 128))
BF16_TOLERANCE = 2e-2
# (block_v, num_warps, num_stages) tried by --sweep, forward and backward kernels alike.
# The 4th entry is StatePassConfig.v_blocks_adjacent.
SWEEP_CONFIGS = ((32, 4, 1, False), (32, 4, 1, True), (16, 4, 1, True), (32, 8, 1, True),
                 (64, 4, 1, True), (64, 8, 1, True), (64, 4, 2, False), (64, 4, 2, True),
                 (128, 8, 1, True), (16, 2, 2, True), (16, 4, 2, True), (32, 4, 2, True))
# Launch widths of the chunk inverse timed at every shape.
INVERSE_WARPS = (1, 2, 4)
# (num_warps, num_stages) of the per-chunk preparation kernels tried by --sweep-prep.
PREP_SWEEP_CONFIGS = ((4, 1), (8, 1), (8, 2), (16, 1))


def log(record: dict, results: list, out_dir: str | None):
  """Prints one result and rewrites the JSON file, so a run cut short keeps what it measured."""
  print(json.dumps(record), flush=True)
  results.append(record)
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare_fla.json"), "w") as f:
      json.dump(results, f, indent=1)


def make_inputs(seed, batch, seq_len, heads, dim):
  """bf16 q, k, v, float32 g (log-sigmoid decays, mostly slow), bf16 beta, bf16 do."""
  keys = jax.random.split(jax.random.key(seed), 6)
  shape = (batch, seq_len, heads, dim)
  normal = lambda key, s: jax.random.normal(key, s, jnp.float32)
  return {
      "q": normal(keys[0], shape).astype(jnp.bfloat16),
      "k": normal(keys[1], shape).astype(jnp.bfloat16),
      "v": normal(keys[2], shape).astype(jnp.bfloat16),
      "g": jax.nn.log_sigmoid(3.0 + 1.5 * normal(keys[3], shape[:3])),
      "beta": jax.nn.sigmoid(normal(keys[4], shape[:3])).astype(jnp.bfloat16),
      "do": normal(keys[5], shape).astype(jnp.bfloat16),
  }


def to_torch(x):
  import torch  # pylint: disable=import-outside-toplevel
  return torch.utils.dlpack.from_dlpack(jax.block_until_ready(x)).clone()


def load_fla():
  import torch  # pylint: disable=import-outside-toplevel
  import fla.ops.common.chunk_o as fla_chunk_o  # pylint: disable=import-outside-toplevel
  from fla.ops.gated_delta_rule import (  # pylint: disable=import-outside-toplevel
      chunk_gated_delta_rule as fla_chunk)
  # Timing anchor only (module docstring): lift the Hopper + Triton < 3.7.1 guard.
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True
  return torch, fla_chunk


def ours(config: ChunkConfig):
  def forward(q, k, v, g, beta):
    return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, implementation="pallas",
                                  config=config)[0]

  def forward_backward(q, k, v, g, beta, do):
    _, vjp = jax.vjp(forward, q, k, v, g, beta)
    return vjp(do)

  return jax.jit(forward), jax.jit(forward_backward)


def prep_fns(config: PrepareConfig | None = None, fused: bool = False):
  """Jitted preparation (step a): forward, and forward + backward (cotangents = the outputs).
  fused=False: XLA + the Pallas inverse and XLA's autodiff; True: the Pallas kernels forward and
  backward (what implementation="pallas" runs)."""
  def forward(q, k, v, g, beta):
    if fused:
      return prepare_chunks(q, k, v, g, beta, None, True, 64, config)
    return prepare_scan_inputs(q, k, v, g, beta, scale=None, initial_state=None,
                               use_qk_l2norm=True, chunk_size=64)[:6]

  def forward_backward(q, k, v, g, beta):
    outputs, vjp = jax.vjp(forward, q, k, v, g, beta)
    return vjp(outputs)

  return jax.jit(forward), jax.jit(forward_backward)


def prep_pieces_ms(input_sets, *, warmup, repeats) -> dict:
  """Times the default preparation's parts (xla_prepare.py) one by one, each jitted alone: the
  layout (l2norm, padding, head-major copies), the decays, and the WY transform (forward; forward
  + backward with its outputs as cotangents)."""
  timed = lambda fn, sets: median_ms(jax.jit(fn), sets, warmup=warmup, repeats=repeats,
                                     sync=jax.block_until_ready)
  layout = functools.partial(chunk_layout, scale=None, initial_state=None, use_qk_l2norm=True,
                             chunk_size=64)
  chunks = [jax.jit(layout)(*s) for s in input_sets]
  decays = [chunk_decays(c[3], exact=False) for c in chunks]
  wy_sets = [[c[1], c[2], c[4], d[0], d[1]] for c, d in zip(chunks, decays)]
  wy = functools.partial(wy_transform, exact=False)

  def wy_fwd_bwd(*inputs):
    outputs, vjp = jax.vjp(wy, *inputs)
    return vjp(outputs)

  return {"ours_prep_layout_ms": timed(layout, input_sets),
          "ours_prep_decays_ms": timed(functools.partial(chunk_decays, exact=False),
                                       [[c[3]] for c in chunks]),
          "ours_prep_wy_fwd_ms": timed(wy, wy_sets),
          "ours_prep_wy_fwdbwd_ms": timed(wy_fwd_bwd, wy_sets)}


def scan_inputs_of(prep, input_sets):
  """chunk_scan's leading arguments: the preparation's outputs and a zero initial state."""
  scan_inputs = []
  for s in input_sets:
    w, u, *rest = prep(*s)
    h0 = jnp.zeros(w.shape[:2] + (w.shape[-1], u.shape[-1]), jnp.float32)
    scan_inputs.append([w, u, *rest, h0])
  return scan_inputs


def bench_shape(shape, args, results, torch, fla_chunk):  # pylint: disable=too-many-locals
  batch, seq_len, heads, dim = shape
  name = f"B{batch} T{seq_len} H{heads} K=V={dim}"
  sets = [make_inputs(seed, *shape) for seed in (0, 1)]
  names = ("q", "k", "v", "g", "beta")
  jax_sets = [[s[n] for n in names] for s in sets]
  jax_sets_bwd = [[s[n] for n in names + ("do",)] for s in sets]
  warmup, repeats = (3, 10) if args.quick else (5, 30)
  sync_jax = jax.block_until_ready
  forward, forward_backward = ours(ChunkConfig())

  record = {"shape": name}
  o_ours = forward(*jax_sets[0])
  # Sustained load first: the first timing of a fresh process read up to ~25% slow on an H100
  # while the clocks ramped up (2026-11-22: 4.40 against 3.5-3.6 ms in other runs).
  run_for_seconds(Timed(forward_backward, jax_sets_bwd), seconds=3.0)
  record["ours_fwd_ms"] = median_ms(forward, jax_sets, warmup=warmup, repeats=repeats,
                                    sync=sync_jax)
  record["ours_fwdbwd_ms"] = median_ms(forward_backward, jax_sets_bwd, warmup=warmup,
                                       repeats=repeats, sync=sync_jax)
  # Training: the outputs after the state pass (the default) or inside it
  # (StatePassConfig.separate_output_train), to check that choice.
  default_config = default_state_config(dim)
  _, inside_fwd_bwd = ours(ChunkConfig(state_pass=dataclasses.replace(
      default_config, separate_output_train=False)))
  record["ours_fwdbwd_output_inside_pass_ms"] = median_ms(
      inside_fwd_bwd, jax_sets_bwd, warmup=warmup, repeats=repeats, sync=sync_jax)
  # Our pieces: the preparation (forward; forward + backward), the chunk inverse inside it
  # (forward, by launch width) and the Pallas scan alone; the preparation kernels (the default)
  # next to the XLA preparation with its autodiff.
  prep, prep_fwd_bwd = prep_fns()
  record["ours_prep_fwd_ms"] = median_ms(prep, jax_sets, warmup=warmup, repeats=repeats,
                                         sync=sync_jax)
  record["ours_prep_kernels_fwd_ms"] = median_ms(prep_fns(fused=True)[0], jax_sets,
                                                 warmup=warmup, repeats=repeats, sync=sync_jax)
  record["ours_prep_fwdbwd_ms"] = median_ms(prep_fwd_bwd, jax_sets, warmup=warmup,
                                            repeats=repeats, sync=sync_jax)
  record["ours_prep_kernels_fwdbwd_ms"] = median_ms(prep_fns(fused=True)[1], jax_sets,
                                                    warmup=warmup, repeats=repeats, sync=sync_jax)
  record.update(prep_pieces_ms(jax_sets, warmup=warmup, repeats=repeats))
  num_matrices = batch * heads * -(-seq_len // 64)
  a_sets = [[jnp.tril(0.1 * jax.random.normal(jax.random.key(seed), (num_matrices, 64, 64)), -1)]
            for seed in (0, 1)]
  for num_warps in INVERSE_WARPS:
    inverse = jax.jit(functools.partial(inverse_forward, num_warps=num_warps, exact=False))
    record[f"ours_inverse_{num_warps}warps_ms"] = median_ms(inverse, a_sets, warmup=warmup,
                                                            repeats=repeats, sync=sync_jax)
  scan_inputs = scan_inputs_of(prep, jax_sets)
  scan = jax.jit(lambda *a: chunk_scan(*a, 64, "bfloat16", False, default_config))
  record["ours_scan_fwd_ms"] = median_ms(scan, scan_inputs, warmup=warmup, repeats=repeats,
                                         sync=sync_jax)
  # Logged before FLA runs: FLA autotunes on its first call per shape, which can outlast a step.
  log(dict(record), results, args.out)
  if fla_chunk is None:
    return

  torch_sets = [[to_torch(s[n]) for n in names + ("do",)] for s in sets]
  sync_torch = lambda _: torch.cuda.synchronize()

  def fla_forward(q, k, v, g, beta, do):
    del do
    with torch.no_grad():
      return fla_chunk(q, k, v, g, beta, scale=dim ** -0.5, use_qk_l2norm_in_kernel=True)[0]

  def fla_forward_backward(q, k, v, g, beta, do):
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    o = fla_chunk(*leaves, scale=dim ** -0.5, use_qk_l2norm_in_kernel=True)[0]
    o.backward(do)
    return [x.grad for x in leaves]

  o_fla = fla_forward(*torch_sets[0])
  o_fla_np = o_fla.float().cpu().numpy()
  o_ours_np = np.asarray(o_ours.astype(jnp.float32))
  record["fwd_rel_diff_vs_fla"] = float(np.max(np.abs(o_ours_np - o_fla_np))
                                        / np.max(np.abs(o_fla_np)))
  record["fwd_parity_ok"] = record["fwd_rel_diff_vs_fla"] <= BF16_TOLERANCE
  # Ours and FLA in alternation (pallas_kernels.benchmarking.paired_ms): the ratios are of
  # medians taken under the same clocks. FLA's forward alone varied 1.63-2.04 ms at B8 T4096 H8
  # K=V=256 between runs on one H100 (2026-11-22).
  for mode, ours_fn, fla_fn, ours_sets in (
      ("fwd", forward, fla_forward, jax_sets),
      ("fwdbwd", forward_backward, fla_forward_backward, jax_sets_bwd)):
    ours_ms, fla_ms = paired_ms(Timed(ours_fn, ours_sets, sync_jax),
                                Timed(fla_fn, torch_sets, sync_torch),
                                warmup=warmup, rounds=repeats)
    record[f"paired_ours_{mode}_ms"], record[f"fla_{mode}_ms"] = ours_ms, fla_ms
    record[f"{mode}_ratio"] = ours_ms / fla_ms
  del torch_sets
  log(record, results, args.out)


def sweep_shape(shape, args, results):
  """Times the chunk scan alone (forward; forward + backward) for several launch configs."""
  batch, seq_len, heads, dim = shape
  sets = [make_inputs(seed, *shape) for seed in (0, 1)]
  prep, _ = prep_fns()
  scan_inputs = scan_inputs_of(prep, [[s[n] for n in ("q", "k", "v", "g", "beta")] for s in sets])
  do_sets = [jnp.pad(s["do"], [(0, 0), (0, -seq_len % 64), (0, 0), (0, 0)]) for s in sets]
  name = f"B{batch} T{seq_len} H{heads} K=V={dim}"
  for block_v, warps, stages, adjacent in SWEEP_CONFIGS:
    config = StatePassConfig(block_v=block_v, num_warps=warps, num_stages=stages,
                             v_blocks_adjacent=adjacent)
    scan = jax.jit(lambda *a, c=config: chunk_scan(*a, 64, "bfloat16", False, c))
    try:
      ms = median_ms(scan, scan_inputs, warmup=2, repeats=10, sync=jax.block_until_ready)
    except Exception as error:  # pylint: disable=broad-except
      ms = f"failed: {type(error).__name__}: {str(error)[:200]}"
    log({"sweep": "scan_fwd", "shape": name, "config": [block_v, warps, stages, adjacent],
         "ms": ms}, results, args.out)
  for block_v, warps, stages, adjacent in SWEEP_CONFIGS:
    # The forward part keeps the default launch; the adjacency applies to both directions.
    config = dataclasses.replace(default_state_config(dim), block_v_bwd=block_v,
                                 num_warps_bwd=warps, num_stages_bwd=stages,
                                 v_blocks_adjacent=adjacent)

    def scan_fwd_bwd(*a, c=config):
      *inputs, do = a
      outputs, vjp = jax.vjp(lambda *x: chunk_scan(*x, 64, "bfloat16", False, c), *inputs)
      return vjp((do, jnp.zeros_like(outputs[1])))

    fn = jax.jit(scan_fwd_bwd)
    try:
      ms = median_ms(fn, [list(s) + [d] for s, d in zip(scan_inputs, do_sets)], warmup=2,
                     repeats=10, sync=jax.block_until_ready)
    except Exception as error:  # pylint: disable=broad-except
      ms = f"failed: {type(error).__name__}: {str(error)[:200]}"
    log({"sweep": "scan_fwd_bwd", "shape": name, "config_bwd": [block_v, warps, stages, adjacent],
         "ms": ms}, results, args.out)


def sweep_prep_shape(shape, args, results):
  """Times the preparation kernels (forward; forward + backward) for several launch configs,
  next to the XLA preparation with its autodiff."""
  batch, seq_len, heads, dim = shape
  sets = [make_inputs(seed, *shape) for seed in (0, 1)]
  jax_sets = [[s[n] for n in ("q", "k", "v", "g", "beta")] for s in sets]
  name = f"B{batch} T{seq_len} H{heads} K=V={dim}"
  timed = lambda fn: median_ms(fn, jax_sets, warmup=2, repeats=10, sync=jax.block_until_ready)
  xla_fwd, xla_fwd_bwd = prep_fns()
  log({"sweep": "prep", "shape": name, "config": "xla", "fwd_ms": timed(xla_fwd),
       "fwdbwd_ms": timed(xla_fwd_bwd)}, results, args.out)
  for warps, stages in PREP_SWEEP_CONFIGS:
    record = {"sweep": "prep", "shape": name, "config": [warps, stages]}
    fns = prep_fns(PrepareConfig(num_warps=warps, num_stages=stages), fused=True)
    for key, fn in zip(("fwd_ms", "fwdbwd_ms"), fns):
      try:
        record[key] = timed(fn)
      except Exception as error:  # pylint: disable=broad-except
        record[key] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    log(record, results, args.out)


def train_check(args, results, steps: int = 30):
  """gdn-tiny in bf16: per-step losses with the Pallas kernel vs the XLA reference."""
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from lalte_jax.config import get_model_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.loss import next_token_cross_entropy  # pylint: disable=import-outside-toplevel
  from lalte_jax.model import HybridLM  # pylint: disable=import-outside-toplevel

  base = get_model_config("gdn-tiny")
  # Learnable but context-dependent data: arithmetic sequences with a random start and stride.
  key_start, key_stride = jax.random.split(jax.random.key(7))
  batch, seq_len = 8, 256
  start = jax.random.randint(key_start, (steps, batch, 1), 0, base.vocab_size)
  stride = jax.random.randint(key_stride, (steps, batch, 1), 1, 4)
  tokens = (start + stride * jnp.arange(seq_len)) % base.vocab_size

  def losses(implementation):
    config = base.replace(dtype="bfloat16",
                          gdn=dataclasses.replace(base.gdn, implementation=implementation))
    model = HybridLM(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens_BT):
      def loss_fn(params):
        return next_token_cross_entropy(nnx.merge(graphdef, params, rest)(tokens_BT), tokens_BT)
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    out = []
    for i in range(steps):
      params, opt_state, loss = step(params, opt_state, tokens[i])
      out.append(float(loss))
    return out

  pallas_losses = losses("pallas")
  xla_losses = losses("xla")
  rel = max(abs(a - b) / abs(b) for a, b in zip(pallas_losses, xla_losses))
  log({"train_check": "gdn-tiny bf16 B8 T256", "steps": steps,
       "pallas_losses": [round(x, 4) for x in pallas_losses[::5]] + [round(pallas_losses[-1], 4)],
       "xla_losses": [round(x, 4) for x in xla_losses[::5]] + [round(xla_losses[-1], 4)],
       "max_rel_diff": rel, "ok": rel <= BF16_TOLERANCE}, results, args.out)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="fewer timing repeats")
  parser.add_argument("--sweep", action="store_true", help="time kernel launch configs")
  parser.add_argument("--no-fla", action="store_true", help="skip FLA (ours only)")
  parser.add_argument("--no-train", action="store_true", help="skip the training check")
  parser.add_argument("--shapes", default="0,1,2,3", help="indices into SHAPES")
  parser.add_argument("--sweep-prep", action="store_true",
                      help="time the preparation kernels' launch configs (--sweep-shapes)")
  parser.add_argument("--sweep-shapes", default="0,1", help="indices into SHAPES for --sweep")
  parser.add_argument("--fla-shapes", default=None,
                      help="indices into SHAPES where FLA runs too (default: all); FLA's autotuning"
                           " costs about a minute per shape")
  parser.add_argument("--sweep-first", action="store_true", help="run the sweep before the rest")
  parser.add_argument("--out", default=os.environ.get("OUT"), help="directory for the JSON")
  args = parser.parse_args()
  results: list = []
  print(f"jax {jax.__version__} devices {jax.devices()}", flush=True)
  torch, fla_chunk = (None, None) if args.no_fla else load_fla()
  if args.sweep_prep:
    for index in args.sweep_shapes.split(","):
      sweep_prep_shape(SHAPES[int(index)], args, results)
  if args.sweep and args.sweep_first:
    for index in args.sweep_shapes.split(","):
      sweep_shape(SHAPES[int(index)], args, results)
  fla_shapes = args.shapes if args.fla_shapes is None else args.fla_shapes
  for index in args.shapes.split(","):
    try:
      with_fla = fla_chunk if index in fla_shapes.split(",") else None
      bench_shape(SHAPES[int(index)], args, results, torch, with_fla)
    except Exception as error:  # pylint: disable=broad-except
      log({"shape": str(SHAPES[int(index)]),
           "failed": f"{type(error).__name__}: {str(error)[:300]}"}, results, args.out)
  if not args.no_train:
    try:
      train_check(args, results)
    except Exception as error:  # pylint: disable=broad-except
      log({"train_check": "failed", "error": f"{type(error).__name__}: {str(error)[:300]}"},
          results, args.out)
  if args.sweep and not args.sweep_first:
    for index in args.sweep_shapes.split(","):
      sweep_shape(SHAPES[int(index)], args, results)


if __name__ == "__main__":
  main()
