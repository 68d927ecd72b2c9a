"""Train-step throughput, MFU, memory and compile time of the trainer's jitted step, per preset.

    python tools/bench_train.py                # lalte/lansa/nsa/gdn_swa/gdn_attn-0.4b, T=4096
    python tools/bench_train.py --presets lalte-1.4b --batch 2 --remat block   # does it fit?
    python tools/bench_train.py --presets lansa-1.4b --batch 1                 # laNSA at 1.4b
    python tools/bench_train.py --presets lalte-tiny --seq_len 64 --steps 2 --warmup 1  # CPU smoke
    python tools/bench_train.py --presets gdn_swa-0.4b lalte-0.4b --lte_kept_fraction 0.125
    python tools/bench_train.py --presets gdn_swa-0.4b --batch 4 --profile  # GPU time by op class
    python tools/bench_train.py --presets gdn_swa-1.4b lalte-1.4b --batch 1 2 4 8  # fastest batch

The step is the one `python -m lalte_jax.train` runs: `lalte_jax.train.trainer.Trainer` builds it (AdamW, float32
master weights, `--dtype` compute, `--remat`, gradient accumulation over `--grad_accum`
micro-batches, FSDP over `--mesh_fsdp` devices), here fed a fixed batch of random tokens (no
dataset). `--batch` is the per-device micro-batch: one step processes
batch x (data x fsdp devices) x grad_accum sequences of `--seq_len` tokens. Given several
batches, each preset runs them smallest first, each in its own child, up to the first that runs
out of memory, and the fastest that ran is marked (`"fastest": true`, "(fastest)" in the table):
the per-device batch to quote a preset's tokens/s and MFU at.

Per preset: compile time (lower + compile of the step), then `--warmup` untimed steps, then the
median wall time of `--steps` steps (each waited for with block_until_ready), tokens/s, MFU, and
the device's peak memory (`memory_stats()["peak_bytes_in_use"]`; null where the backend has none,
e.g. CPU) next to the memory JAX may use (`bytes_limit`: by default 0.75 of the GPU, see
`--mem_fraction`). MFU uses the model FLOP count of `lalte_jax.train.metrics.flops_per_token` (6 N per
token for the matmul parameters + the attention / delta-rule mixer terms, forward + backward, no
remat recompute) over `lalte_jax.train.metrics.peak_flops_per_device` (dense bf16 datasheet peak;
`--peak_tflops` overrides). XLA's own count of the compiled step (`xla_flops_per_step`: remat
recompute included, custom kernels not) is reported next to it where the backend gives one.

laLTE's attention cost follows how many tokens its routers keep: as initialised they keep nearly
every token (output bias +0.5), which costs what full attention costs, while training soon holds
the count at the controller's target (b of T). `--lte_kept_fraction F` shifts the routers' output
biases so that a share F is kept per layer and head on the bench batch in the training forward
(router dropout on, as the step runs it; 0.125 = the paper's b/T = 512/4096); the result records
the share kept in the last timed step.

Each preset runs in a fresh child process (default), so that its peak memory is its own and an
out-of-memory preset cannot leave the next one fragmented memory. RESOURCE_EXHAUSTED (at compile
or run time) is reported as status "oom" and the benchmark continues with the next preset.
Prints one JSON line per preset and a markdown table, then, for presets run with gdn_swa of their
size, their tokens/s over gdn_swa's, each at its fastest batch and at every batch both ran
(`ratios_to_reference`); `--json PATH` writes the list. `--profile`
then traces `--profile_steps` more steps and adds their GPU time by op class (Pallas kernels,
matmuls, cuDNN, XLA fusions, copies, collectives, host gaps: tools/step_profile.py) to each
result ("profile") and prints it as a table per preset.
Exit status: 0 when every preset ran or was out of memory, 1 when one failed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import traceback


_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # run as a script from a checkout
  sys.path.insert(0, str(_REPO_ROOT))

from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # before JAX creates a backend

from lalte_jax.config import REMAT_POLICIES  # pylint: disable=wrong-import-position
from lalte_jax.train.metrics import is_out_of_memory  # pylint: disable=wrong-import-position

DEFAULT_PRESETS = ("lalte-0.4b", "lansa-0.4b", "nsa-0.4b", "gdn_swa-0.4b", "gdn_attn-0.4b")
RESULT_PREFIX = "BENCH_RESULT "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS),
                      help="'<variant>-<size>' names (lalte_jax.presets)")
  parser.add_argument("--seq_len", type=int, default=4096)
  parser.add_argument("--batch", type=int, nargs="+", default=[1],
                      help="sequences per device per micro-batch; several values: each is timed"
                           " (up to the first that runs out of memory) and the fastest marked")
  parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per step")
  # "none" measured fastest with the layer groups unrolled (one H200, 2026-11-29, B4 T4096,
  # routers at 12.5% kept): gdn_swa-0.4b / lalte-0.4b / lansa-0.4b 154,913 / 138,731 / 111,884
  # tokens/s against "dots_attention"'s 139,618 / 125,553 / 104,193 (+11%, +10%, +7%) at 27-30
  # against 18-20 GiB; gdn_swa-1.4b 45.0% MFU at B4 (57 GiB). Scanned, "none" had been 13-14%
  # slower: its saved activations went through the scan's stacked buffers (docs/benchmarks.md §5).
  parser.add_argument("--remat", default="none", choices=REMAT_POLICIES)
  # Unrolled (as the paper recipes in lalte_jax/configs run) measured faster than the scan: one
  # H200, 2026-11-29, B4 T4096, dots_attention: gdn_swa-0.4b 0.125 -> 0.117 s a step, lalte-0.4b
  # 0.140 -> 0.130 s (the scan's saved activations go through per-layer stacked buffers, ~9 ms
  # of copies a step; docs/benchmarks.md, section 5). It compiles 3-4x longer.
  parser.add_argument("--scan_layers", default="false", choices=("true", "false"),
                      help="TrainConfig.scan_layers: the layer groups as one lax.scan (true:"
                           " compile time flat in depth) or unrolled (false: no stacked per-layer"
                           " buffers, faster on GPUs, a longer compile)")
  parser.add_argument("--xla_flags", default="",
                      help="flags added to XLA_FLAGS for the step (they replace a setting of the"
                           " same flag there), e.g. --xla_flags=--xla_gpu_enable_dynamic_slice_"
                           "fusion=true; recorded in each result")
  parser.add_argument("--lte_kept_fraction", type=float, default=None,
                      help="shift the LTE routers' output biases so that this fraction of the"
                           " tokens is kept per layer and head on the bench batch (the state the"
                           " sparsity controller drives training to; default: as initialised)")
  parser.add_argument("--loss_chunk_tokens", type=int, default=0,
                      help="TrainConfig.loss_chunk_tokens (0: the whole logits at once)")
  parser.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                      help="kernel version of every token mixer (default: the platform's fastest)")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="compute dtype (parameters and optimizer state stay float32)")
  parser.add_argument("--mesh_fsdp", type=int, default=1,
                      help="devices that shard parameters and optimizer state (the rest: data)")
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation")
  parser.add_argument("--peak_tflops", type=float, default=0.0,
                      help="peak TFLOP/s per device for MFU (0 = look up the device kind)")
  parser.add_argument("--mem_fraction", type=float, default=None,
                      help="GPU memory JAX may take (XLA_PYTHON_CLIENT_MEM_FRACTION; default:"
                           " JAX's, 0.75 of the GPU)")
  parser.add_argument("--profile", action="store_true",
                      help="also trace --profile_steps steps and break their GPU time down by op"
                           " class (tools/step_profile.py)")
  parser.add_argument("--profile_steps", type=int, default=3, help="steps traced by --profile")
  parser.add_argument("--json", default="", help="also write the results (a JSON list) here")
  parser.add_argument("--timeout_s", type=int, default=3600,
                      help="per-preset limit of a child process")
  parser.add_argument("--in_process", action="store_true",
                      help="run the presets in this process, one after another (peak memory is"
                           " then the maximum so far)")
  args = parser.parse_args(argv)
  for name in ("seq_len", "grad_accum", "mesh_fsdp", "steps", "timeout_s", "profile_steps"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be positive, got {getattr(args, name)}")
  if min(args.batch) <= 0 or len(set(args.batch)) != len(args.batch):
    parser.error(f"--batch must be distinct positive values, got {args.batch}")
  args.batch = sorted(args.batch)
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0, got {args.warmup}")
  if args.mem_fraction is not None and not 0.0 < args.mem_fraction <= 1.0:
    parser.error(f"--mem_fraction must lie in (0, 1], got {args.mem_fraction}")
  return args


def _xla_flops(compiled) -> float | None:
  """XLA's FLOP count of a compiled step (the cost analysis API returns a dict or [dict])."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # optional; some backends have none
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get("flops")
  return float(flops) if flops is not None and flops > 0 else None


def bench_preset(preset: str, args: argparse.Namespace) -> dict:
  """Compiles and times the train step of `preset`; a dict of results (status "ok")."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from lalte_jax.train import sharding  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.config import TrainConfig  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.metrics import MetricsLogger, peak_memory_gib  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer, with_labels  # pylint: disable=import-outside-toplevel

  variant, _, size = preset.rpartition("-")
  mesh = sharding.make_mesh(-1, args.mesh_fsdp, 1)
  global_batch = args.batch * sharding.batch_devices(mesh) * args.grad_accum
  # The schedule does not change the step's cost; steps/warmup only need to validate.
  config = TrainConfig(variant=variant, size=size, model_dtype=args.dtype, remat=args.remat,
                       data="mqar", seq_len=args.seq_len, num_train_examples=global_batch,
                       global_batch_size=global_batch, grad_accum_steps=args.grad_accum,
                       loss_chunk_tokens=args.loss_chunk_tokens, steps=1000, warmup_steps=10,
                       mesh_fsdp=args.mesh_fsdp, scan_layers=args.scan_layers == "true",
                       peak_tflops_per_device=args.peak_tflops, progress_bar=False,
                       tensorboard=False)
  if args.implementation is not None:
    from lalte_jax.train import model_overrides  # pylint: disable=import-outside-toplevel
    config = config.replace(model_overrides=model_overrides.implementation_overrides(
        config.model_config(), args.implementation))
  result = {"preset": preset, "implementation": args.implementation or "default",
            "seq_len": args.seq_len, "batch_per_device": args.batch,
            "grad_accum": args.grad_accum, "global_batch": global_batch, "remat": args.remat,
            "scan_layers": args.scan_layers == "true",
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "loss_chunk_tokens": args.loss_chunk_tokens,
            "lte_kept_fraction_set": args.lte_kept_fraction,
            "dtype": args.dtype, "mesh_fsdp": args.mesh_fsdp, "devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind}
  trainer = Trainer(config, mesh=mesh, logger=MetricsLogger("", total_steps=1, enabled=False))
  vocab_size = trainer.model_config.vocab_size
  rows = global_batch // jax.process_count()
  tokens = np.random.default_rng(0).integers(0, vocab_size, (rows, args.seq_len), np.int32)
  batch = sharding.global_batch(with_labels({"tokens": tokens}), mesh)

  calibrate = None
  if args.lte_kept_fraction is not None and trainer.model_config.num_lte_layers:
    calibrate = lte_calibrator(trainer.model_config, batch["tokens"], args.lte_kept_fraction)
    trainer.state = trainer.state.replace(params=calibrate(trainer.state.params))
  start = time.perf_counter()
  compiled = trainer.step_fn.lower(trainer.state, batch).compile()
  result["compile_s"] = time.perf_counter() - start
  result["xla_flops_per_step"] = _xla_flops(compiled)

  state, step_times, metrics = trainer.state, [], None
  trainer.state = None  # the step donates the state; keep no second reference
  for index in range(args.warmup + args.steps):
    if calibrate is not None and index:  # each step at the set share, not where training drifts
      # Waited for: the calibration's forwards must not run inside the timed step.
      state = jax.block_until_ready(state.replace(params=calibrate(state.params)))
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    if index >= args.warmup:
      step_times.append(time.perf_counter() - start)
  step_time = statistics.median(step_times)
  tokens_per_s = config.tokens_per_step / step_time
  result.update(
      status="ok", step_time_s=step_time, step_times_s=step_times, tokens_per_s=tokens_per_s,
      tokens_per_step=config.tokens_per_step, flops_per_token=trainer.flops_per_token,
      final_loss=float(sharding.to_host(metrics["loss"])))
  peak_flops = trainer.peak_flops  # per device; None on CPU / unknown kinds without --peak_tflops
  result["mfu"] = (tokens_per_s * trainer.flops_per_token / (peak_flops * jax.device_count())
                   if peak_flops else None)
  result["peak_memory_gib"] = peak_memory_gib(jax.local_devices()[:1])
  memory = jax.local_devices()[0].memory_stats() or {}
  result["memory_limit_gib"] = (memory["bytes_limit"] / 2**30 if "bytes_limit" in memory
                                else None)  # what JAX may use: see --mem_fraction
  if trainer.model_config.num_lte_layers:  # kept share of the last timed step's batch
    retained_LH = np.asarray(sharding.to_host(metrics["lte_retained"]))
    result["lte_kept_fraction"] = float(retained_LH.mean()) / (
        args.seq_len - trainer.model_config.lte.router_margin)
  if args.profile:  # the same compiled step, traced
    import step_profile  # pylint: disable=import-outside-toplevel
    result["profile"], _ = step_profile.profile_step(
        lambda carried: compiled(carried, batch)[0], state, compiled.as_text(),
        steps=args.profile_steps)
  return result


def lte_calibrator(model_config, tokens_BT, fraction: float, rounds: int = 2):
  """`calibrate(params) -> params`: each LTE router's output bias shifted per head so that a
  share `fraction` of the tokens of `tokens_BT` get a score > 0 (are kept) in the training
  forward, router dropout on. A model at initialisation keeps most tokens (output bias +0.5), so
  its attention costs nearly what full attention costs; training soon brings the retention
  count, counted under the dropout the step applies, to the controller's target (b of T tokens),
  which this reproduces. (Calibrated without dropout, the timed steps kept 16.7-17.9% instead of
  12.5% at lalte-0.4b: the dropout's noise on the logits lets more tokens through.) Later
  layers' inputs move with earlier layers' biases, hence a few rounds. The benchmark calibrates
  before every step: from a fresh initialisation the updates of a few steps move the share
  (12.5% at the first step became 14.3-16.8% by the seventh at lalte-0.4b, more at larger
  batches), where a trained model's controller holds it. The forward is compiled once."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from lalte_jax.train import router_warmup  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.step import model_graphdef  # pylint: disable=import-outside-toplevel

  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"--lte_kept_fraction: {fraction} is not in (0, 1]")
  graphdef = model_graphdef(model_config)
  dropout_key = jax.random.key(0)  # any draw: the share kept depends on the rate, not the draw
  scores_fn = jax.jit(lambda p, t: nnx.merge(graphdef, p)(
      t, dropout_key=dropout_key, return_aux=True)[1].lte_scores)
  group_pattern = model_config.layer_pattern[:model_config.pattern_period]
  lte_positions = [i for i, kind in enumerate(group_pattern) if kind == "lte"]

  def calibrate(params: dict) -> dict:
    for _ in range(rounds):
      scores_LBTH = scores_fn(params, tokens_BT).astype(jnp.float32)
      logits_LBTH = jnp.log(0.5 + scores_LBTH) - jnp.log(0.5 - scores_LBTH)  # sigmoid's inverse
      threshold_LH = jnp.quantile(logits_LBTH, 1.0 - fraction, axis=(1, 2))
      threshold_GPH = threshold_LH.reshape(-1, len(lte_positions), threshold_LH.shape[-1])

      def shift(path, leaf, threshold_GPH=threshold_GPH):
        names = router_warmup.path_names(path)
        if (names[-1] != router_warmup.ROUTER_OUTPUT_BIAS
            or router_warmup.ROUTER_MODULE not in names):
          return leaf
        position = lte_positions.index(names[names.index("blocks") + 1])
        return leaf - threshold_GPH[:, position].astype(leaf.dtype)
      params = jax.tree_util.tree_map_with_path(shift, params)
    return params

  return calibrate


def run_one(preset: str, args: argparse.Namespace) -> dict:
  """`bench_preset` with failures turned into results: status "oom" or "error"."""
  try:
    return bench_preset(preset, args)
  except Exception as error:  # pylint: disable=broad-except  # report and go on to the next
    status = "oom" if is_out_of_memory(error) else "error"
    message = str(error).strip().splitlines()
    return {"preset": preset, "seq_len": args.seq_len, "batch_per_device": args.batch,
            "grad_accum": args.grad_accum, "remat": args.remat, "status": status,
            "error": message[0][:500] if message else type(error).__name__,
            **({"traceback": traceback.format_exc()[-4000:]} if status == "error" else {})}


def run_in_child(preset: str, args: argparse.Namespace, argv: list[str]) -> dict:
  """Runs `preset` in a fresh Python process (same flags) and returns its result line."""
  command = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--presets", preset,
             "--in_process", "--json", ""]
  try:
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s,
                          check=False)
  except subprocess.TimeoutExpired:
    return {"preset": preset, "batch_per_device": args.batch, "status": "error",
            "error": f"timed out after {args.timeout_s} s"}
  for line in done.stdout.splitlines():
    if line.startswith(RESULT_PREFIX):
      return json.loads(line[len(RESULT_PREFIX):])
  # No result line: the child died (e.g. killed by the OS for host memory).
  tail = (done.stderr or done.stdout)[-2000:]
  status = "oom" if is_out_of_memory(Exception(tail)) else "error"
  return {"preset": preset, "batch_per_device": args.batch, "status": status,
          "error": f"child exited with status {done.returncode}: {tail.strip()[-500:]}"}


def mark_fastest(results: list[dict]) -> None:
  """Marks the highest tokens/s among one preset's batches that ran (`fastest`), where more than
  one batch was timed."""
  ran = [r for r in results if r["status"] == "ok"]
  if len(results) > 1 and ran:
    best = max(ran, key=lambda r: r["tokens_per_s"])
    for r in ran:
      r["fastest"] = r is best


REFERENCE_VARIANT = "gdn_swa"  # the presets' tokens/s are set against gdn_swa of their size


def ratios_to_reference(results: list[dict]) -> list[dict]:
  """Per preset with a gdn_swa preset of its size among the results: its tokens/s at its fastest
  batch over gdn_swa's at its fastest, and at each batch both ran ({batch: ratio}).

  Each at its own fastest batch is how a user would run either (e.g. laLTE's done-when ratio
  against GDN+SWA); the same-batch ratios show how much of it the batch choice makes."""
  ran = [r for r in results if r["status"] == "ok"]
  by_preset: dict[str, list[dict]] = {}
  for r in ran:
    by_preset.setdefault(r["preset"], []).append(r)
  rows = []
  for preset, mine in by_preset.items():
    variant, _, size = preset.partition("-")
    reference = by_preset.get(f"{REFERENCE_VARIANT}-{size}")
    if variant == REFERENCE_VARIANT or not reference:
      continue
    best = max(mine, key=lambda r: r["tokens_per_s"])
    best_reference = max(reference, key=lambda r: r["tokens_per_s"])
    at_reference = {r["batch_per_device"]: r["tokens_per_s"] for r in reference}
    rows.append({
        "preset": preset, "reference": f"{REFERENCE_VARIANT}-{size}",
        "batch": best["batch_per_device"], "reference_batch": best_reference["batch_per_device"],
        "at_fastest": best["tokens_per_s"] / best_reference["tokens_per_s"],
        "same_batch": {r["batch_per_device"]: r["tokens_per_s"] / at_reference[r["batch_per_device"]]
                       for r in sorted(mine, key=lambda r: r["batch_per_device"])
                       if r["batch_per_device"] in at_reference}})
  return rows


def ratio_table(rows: list[dict]) -> str:
  lines = ["| preset | / reference | each at its fastest batch (batches) | at the same batch |",
           "|" + "---|" * 4]
  for row in rows:
    same = ", ".join(f"{ratio:.3f} at {batch}" for batch, ratio in row["same_batch"].items())
    lines.append(f"| {row['preset']} | {row['reference']} | {row['at_fastest']:.3f}"
                 f" ({row['batch']} / {row['reference_batch']}) | {same or '-'} |")
  return "\n".join(lines)


def table_cell(value, fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def markdown_table(results: list[dict]) -> str:
  lines = ["| preset | status | T | batch/dev x accum | remat | step s | tokens/s | MFU |"
           " peak GiB | compile s |", "|" + "---|" * 10]
  for r in results:
    lines.append(
        f"| {r['preset']} | {r['status']} | {r.get('seq_len', '-')} |"
        f" {r.get('batch_per_device', '-')}{' (fastest)' if r.get('fastest') else ''} x"
        f" {r.get('grad_accum', '-')} | {r.get('remat', '-')} |"
        f" {table_cell(r.get('step_time_s'), '.3f')} |"
        f" {table_cell(r.get('tokens_per_s'), ',.0f')} |"
        f" {table_cell(r.get('mfu'), '.1%')} | {table_cell(r.get('peak_memory_gib'), '.1f')} |"
        f" {table_cell(r.get('compile_s'), '.1f')} |")
  return "\n".join(lines)


def _argv_without_presets(argv: list[str]) -> list[str]:
  """The command line minus --presets, --batch (and their values), --json and --in_process: a
  child gets one preset and one batch."""
  kept, skipping = [], False
  for arg in argv:
    if arg.startswith("--"):
      skipping = arg in ("--presets", "--json", "--batch")
      if skipping or arg == "--in_process" or arg.startswith(("--presets=", "--json=",
                                                              "--batch=")):
        continue
    elif skipping:
      continue
    kept.append(arg)
  return kept


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.mem_fraction is not None:  # read when JAX starts its GPU client (here or in children)
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
  if args.xla_flags:  # likewise read when JAX starts a backend, which no import here has done
    xla_flags.apply(*args.xla_flags.split(), replace=True)
  child_argv = _argv_without_presets(argv)
  results = []
  for preset in args.presets:
    preset_results = []
    for batch in args.batch:
      one = argparse.Namespace(**{**vars(args), "batch": batch})
      result = (run_one(preset, one) if args.in_process
                else run_in_child(preset, one, child_argv + ["--batch", str(batch)]))
      preset_results.append(result)
      print(RESULT_PREFIX + json.dumps(result), flush=True)
      if result["status"] != "ok":
        print(f"{preset}: {result['status']}: {result['error']}", file=sys.stderr, flush=True)
      if result["status"] == "oom":
        break  # a larger batch needs more memory still
    mark_fastest(preset_results)
    results += preset_results
  if not args.in_process or len(results) > 1:
    print(markdown_table(results))
    ratios = ratios_to_reference(results)
    if ratios:
      print("\n" + ratio_table(ratios))
    print("command: python tools/bench_train.py " + " ".join(argv))
  if args.profile:
    import step_profile  # pylint: disable=import-outside-toplevel
    for r in results:
      if "profile" in r:
        print("\n" + step_profile.markdown(
            r["profile"], f"{r['preset']} train step: T {r['seq_len']}, batch {r['global_batch']},"
            f" {r['dtype']}, remat {r['remat']}, {r['device_kind']}"))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
  return 0 if all(r["status"] in ("ok", "oom") for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
