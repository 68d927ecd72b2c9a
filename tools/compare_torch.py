"""Parity of our JAX models with the authors' PyTorch models through their checkpoint format.

For each variant and size, on one GPU:
1. PyTorch (tools/torch_reference.py, one process per family: FLA 0.6.0 on transformers 5 for
   gdn / gdn_swa / gdn_attn / transformer, the authors' code on transformers 4.53 for lalte /
   lansa / nsa) builds the model from the config.json that `lalte_jax.convert` writes for our
   config, draws random weights, saves it with `save_pretrained`, and records its logits (float32
   and bfloat16), LTE router scores, the LTE prefill's kept tokens and 64 greedy tokens through its
   cached decoder (b enforced); it also checks that our import + export of its checkpoint loads
   back with `from_pretrained` and gives the same logits.
2. JAX (this process) imports the saved checkpoint with `lalte_jax.convert.read_hf` and compares:
   float32 with the XLA implementations and full-precision matmuls (`implementation="xla"`,
   matmul precision "highest"; the reference side runs without TF32 too): forward logits (LTE:
   the training-time layer, no cap), LTE scores and keep decisions (score > 0), the cached prefill's
   logits and the LTE caches' kept out-of-window tokens (capped at b, §5.2), and greedy tokens from
   `lalte_jax.generate.generate`; bfloat16 with the default (GPU kernel) implementations: forward
   logits against the reference's bfloat16 and float32 logits. For the authors' models, also each
   of our layers on the reference's input to it (tools/layer_parity.py: where an error arises, and
   how close NSA's block selections are to ties).
Errors are max |ours - theirs| / max |theirs| (tests/kernel_testing.py). Pass: float32 logits
<= 1e-4, identical keep decisions, kept sets and greedy tokens, bfloat16 logits within the
tolerance table's bfloat16 value of the reference's bfloat16 logits, round trip exact.

Sizes: "tiny" is hidden 256 with 4 layers (B 2, T 256; windows and caps small enough that T
exercises them: SWA 64, LTE w 63 / b 32, NSA blocks 32 x 4, window 64); "0.4b" is the paper's
config (B 1, T 2048, so that LTE's b = 512 binds).

The two PyTorch processes run side by side and this process compares each case as soon as its
reference is written (tiny sizes first), so that what finished within `--budget-s` comes back.

On the GPU machine, from the repository root, with FLA's wheels installed to /tmp/site and
transformers 4.53 (+ huggingface_hub, tokenizers) to /tmp/site_tf4:
  PYTHONPATH=/tmp/site:$PWD python3 tools/compare_torch.py --sizes tiny,0.4b \\
      --authors-path PATH_TO_AUTHORS_REPO --fla-site /tmp/site --tf4-site /tmp/site_tf4 \\
      --out parity.json
where PATH_TO_AUTHORS_REPO holds their `fla/` package. Prints a table; writes the JSON after
every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from lalte_jax.config import (AttentionConfig, GDNConfig, LTEConfig, ModelConfig,  # noqa: E402
                              NSAConfig, get_model_config)
from lalte_jax.convert import hf_config  # noqa: E402

VARIANTS = ("gdn", "gdn_swa", "gdn_attn", "transformer", "lalte", "lansa")
FAMILY = {"gated_deltanet": "fla", "transformer": "fla", "hybrid_gated_deltanet": "authors",
          "nsa": "authors"}
SHAPES = {"tiny": dict(batch=2, length=256), "0.4b": dict(batch=1, length=2048),
          "1.4b": dict(batch=1, length=2048)}
FLOAT32_TOLERANCE = 1e-4


def tiny_config(variant: str) -> ModelConfig:
  """The variant at hidden 256, 4 layers, vocab 1024 (GQA 2 for attention and LTE, NSA's group
  of 16 query heads per KV head as its kernels need)."""
  base = get_model_config(f"{variant}-0.4b")
  subs = {}
  if base.gdn is not None:
    subs["gdn"] = GDNConfig(num_heads=2, head_dim=128)
  if base.attention is not None:
    subs["attention"] = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=64,
                                        window_size=base.attention.window_size and 64)
  if base.lte is not None:
    subs["lte"] = LTEConfig(num_heads=4, num_kv_heads=2, head_dim=64, window=63, cap=32,
                            router_kernel_sizes=base.lte.router_kernel_sizes,
                            router_dilations=base.lte.router_dilations)
  if base.nsa is not None:
    subs["nsa"] = NSAConfig(num_heads=16, num_kv_heads=1, head_dim=32, block_size=32,
                            block_count=4, window_size=64)
  return base.replace(name=f"{variant}-tiny256", vocab_size=1024, hidden_size=256, num_layers=4,
                      intermediate_size=768, layer_pattern=base.layer_pattern[:4], **subs)


def case_config(variant: str, size: str) -> ModelConfig:
  return tiny_config(variant) if size == "tiny" else get_model_config(f"{variant}-{size}")


def write_spec(case_dir: pathlib.Path, config: ModelConfig, size: str, args) -> str:
  case_dir.mkdir(parents=True, exist_ok=True)
  hf = hf_config.hf_config_from_model(config)
  spec = dict(hf_config=hf, new_tokens=args.new_tokens, seed=args.seed, **SHAPES[size])
  (case_dir / "spec.json").write_text(json.dumps(spec, indent=1))
  return FAMILY[hf["model_type"]]


def start_references(family: str, case_dirs: list, args, deadline: float) -> subprocess.Popen:
  """Starts tools/torch_reference.py for `case_dirs` (in that order); it stops itself, printing
  its stacks, at `deadline`."""
  paths = [args.authors_path, args.tf4_site] if family == "authors" else []
  paths += [str(ROOT), args.fla_site]
  env = dict(os.environ, TRITON_F32_DEFAULT="ieee", TORCHDYNAMO_DISABLE="1",
             JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
             TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in paths if p))
  command = [sys.executable, str(ROOT / "tools" / "torch_reference.py"), "--family", family,
             "--timeout-s", f"{max(deadline - time.time(), 10):.0f}", *map(str, case_dirs)]
  print(f"### reference ({family}): {' '.join(command[2:])}", flush=True)
  return subprocess.Popen(command, env=env)


def with_implementation(config: ModelConfig, implementation: str | None) -> ModelConfig:
  subs = {kind: dataclasses.replace(getattr(config, kind), implementation=implementation)
          for kind in ("gdn", "attention", "lte", "nsa") if getattr(config, kind) is not None}
  return config.replace(**subs)


def lte_cache_segments(config: ModelConfig, cache):
  """Our LTE caches' out-of-window segments [L_lte, B, b, K] and fill counts [L_lte, B, K]
  after a prefill, in depth order (layer = group * period + position in the group)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  period = config.layer_pattern[:config.pattern_period]
  positions = [i for i, kind in enumerate(period) if kind == "lte"]
  groups = config.num_layers // config.pattern_period
  window_keys = config.lte.window_keys
  scores = [np.asarray(cache.layers[p].score)[g, :, window_keys:]
            for g in range(groups) for p in positions]
  counts = [np.asarray(cache.layers[p].past_len)[g] for g in range(groups) for p in positions]
  return np.stack(scores), np.stack(counts)


def same_kept_tokens(ours, our_counts, theirs, their_counts) -> tuple[bool, str]:
  """Whether two caches kept the same tokens: equal counts, and the kept scores (position
  order, so equal scores mean equal tokens) equal within 1e-4, sinks +inf in both."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  valid = np.arange(ours.shape[2])[None, None, :, None] < their_counts[:, :, None, :]
  a, b = ours[valid], theirs[valid]
  finite = np.isfinite(b)
  same_entry = np.where(finite, np.abs(a - np.where(finite, b, 0)) <= 1e-4, a == b)
  layer, row, _, head = np.nonzero(valid)
  differ = our_counts != their_counts
  np.logical_or.at(differ, (layer, row, head), ~same_entry)
  return (not differ.any(), f"{int(differ.sum())} of {differ.size} (layer, row, head) caches"
          f" differ; {int(their_counts.sum())} tokens kept")


def log(case_dir: pathlib.Path, stage: str, start: float) -> None:
  print(f"  {case_dir.name}: {stage} ({time.perf_counter() - start:.1f}s)", flush=True)


def compare_case(case_dir: pathlib.Path) -> dict:
  # pylint: disable=import-outside-toplevel
  import jax
  import numpy as np
  from flax import nnx

  from lalte_jax import generate as generation
  from lalte_jax.convert import read_hf
  from lalte_jax.inference.checkpoint import model_from_param_dict
  import layer_parity
  from tests.kernel_testing import relative_error, tolerance

  reference = json.loads((case_dir / "reference.json").read_text())
  if "error" in reference:
    return {"error": f"reference: {reference['error']}"}
  ref = np.load(case_dir / "reference.npz")
  record = {"roundtrip_max_abs_diff": reference["roundtrip_max_abs_diff"],
            "reference_timings": reference["timings"], "device": reference["device"]}
  start = time.perf_counter()
  config, params, _ = read_hf(case_dir / "hf")
  record["import_s"] = time.perf_counter() - start
  tokens = jax.numpy.asarray(ref["tokens"], jax.numpy.int32)
  forward = nnx.jit(lambda model, tokens: model(tokens, return_aux=True))

  start = time.perf_counter()
  with jax.default_matmul_precision("highest"):
    model = model_from_param_dict(with_implementation(config, "xla"), params)
    logits, aux = forward(model, tokens)
    record["logits_f32_rel"] = relative_error(logits, ref["logits_f32"])
    log(case_dir, "float32 forward", start)
    if "hidden_f32" in ref.files:
      record["layers"] = layer_parity.layer_errors(model, ref["hidden_f32"])
      log(case_dir, "float32 layer by layer", start)
    if aux.lte_scores is not None:
      cropped = ref["scores_f32"].shape[2]
      ours = np.asarray(aux.lte_scores)
      ours, theirs = ours[:, :, :cropped], ref["scores_f32"]
      record["scores_f32_rel"] = relative_error(ours, theirs)
      record["scores_f32_rel_by_layer"] = [relative_error(a, b) for a, b in zip(ours, theirs)]
      differ = (ours > 0) != (theirs > 0)
      record["decisions"] = f"{int(differ.sum())}/{differ.size} differ"
      record["decisions_equal"] = not differ.any()
      if differ.any():  # a flip where the score is ~0 is float32 noise, and later layers inherit it
        record["first_flip_layer"] = int(np.argmax(differ.reshape(len(ours), -1).any(axis=1)))
        record["flipped_scores_max_abs"] = float(np.abs(theirs[differ]).max())
      cache = generation.init_cache(model, tokens.shape[0], tokens.shape[1])
      prefill, cache = generation.prefill(model, tokens, cache, all_logits=True)
      record["kept_equal"], record["kept"] = same_kept_tokens(
          *lte_cache_segments(config, cache), ref["oow_scores_f32"], ref["oow_counts_f32"])
      record["prefill_f32_rel"] = relative_error(prefill, ref["prefill_f32"])
      log(case_dir, "float32 LTE prefill", start)
    out = generation.generate(model, ref["tokens"].tolist(), ref["greedy_f32"].shape[1])
    greedy = np.asarray(out.tokens)
    same = greedy == ref["greedy_f32"]
    record["greedy_equal"] = bool(same.all())
    record["greedy_first_difference"] = (None if same.all() else
                                         int(np.argmin(same.all(axis=0))))
  record["float32_s"] = time.perf_counter() - start
  log(case_dir, "float32 greedy", start)

  start = time.perf_counter()
  model = model_from_param_dict(config.replace(dtype="bfloat16"), params)
  logits, _ = forward(model, tokens)
  record["logits_bf16_rel"] = relative_error(logits, ref["logits_bf16"])
  record["logits_bf16_vs_ref_f32_rel"] = relative_error(logits, ref["logits_f32"])
  record["ref_bf16_vs_ref_f32_rel"] = relative_error(ref["logits_bf16"], ref["logits_f32"])
  record["bfloat16_s"] = time.perf_counter() - start
  record["pass"] = bool(
      record["logits_f32_rel"] <= FLOAT32_TOLERANCE
      and record.get("prefill_f32_rel", 0.0) <= FLOAT32_TOLERANCE
      and record.get("decisions_equal", True) and record.get("kept_equal", True)
      and record["greedy_equal"] and record["roundtrip_max_abs_diff"] == 0.0
      and record["logits_bf16_rel"] <= tolerance("bfloat16"))
  return record


def table(records: list) -> str:
  def num(record, key):
    return f"{record[key]:.1e}" if key in record else "-"
  lines = ["| variant | size | f32 logits | f32 LTE prefill | LTE scores | keep decisions |"
           " LTE kept (cap b) | greedy 64 | bf16 logits (vs ref bf16 / vs ref f32; ref bf16"
           " vs f32) | round trip | pass |", "|" + "---|" * 11]
  for r in records:
    if "error" in r:
      lines.append(f"| {r['variant']} | {r['size']} | error: {r['error'][:120]} |"
                   + " |" * 8)
      continue
    greedy = "same" if r["greedy_equal"] else f"differs from {r['greedy_first_difference']}"
    lines.append(
        f"| {r['variant']} | {r['size']} | {num(r, 'logits_f32_rel')} |"
        f" {num(r, 'prefill_f32_rel')} | {num(r, 'scores_f32_rel')} | {r.get('decisions', '-')}"
        f" | {r.get('kept', '-')} | {greedy} | {num(r, 'logits_bf16_rel')} /"
        f" {num(r, 'logits_bf16_vs_ref_f32_rel')}; {num(r, 'ref_bf16_vs_ref_f32_rel')} |"
        f" {'exact' if r['roundtrip_max_abs_diff'] == 0 else r['roundtrip_max_abs_diff']} |"
        f" {'yes' if r['pass'] else 'NO'} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--sizes", default="tiny")
  parser.add_argument("--authors-path", required=True, help="directory holding the authors' fla/")
  parser.add_argument("--fla-site", required=True, help="site directory with FLA 0.6.0")
  parser.add_argument("--tf4-site", required=True, help="site directory with transformers 4.53")
  parser.add_argument("--workdir", default="/tmp/compare_torch")
  parser.add_argument("--out", default="compare_torch.json")
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--budget-s", type=float, default=520,
                      help="everything stops after this many seconds")
  args = parser.parse_args()
  # The reference processes share the GPU with this one while it compares finished cases.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  deadline = time.time() + args.budget_s
  cases = [(v, s) for s in args.sizes.split(",") for v in args.variants.split(",")]
  workdir = pathlib.Path(args.workdir)
  families: dict[str, list] = {}
  for variant, size in cases:
    case_dir = workdir / f"{variant}-{size}"
    families.setdefault(write_spec(case_dir, case_config(variant, size), size, args),
                        []).append(case_dir)
  processes = [start_references(family, dirs, args, deadline)
               for family, dirs in families.items()]
  results: dict = {}
  pending = list(cases)
  while pending and time.time() < deadline:
    ready = [c for c in pending if (workdir / f"{c[0]}-{c[1]}" / "reference.json").is_file()]
    if not ready:
      if all(p.poll() is not None for p in processes):
        break
      time.sleep(2)
      continue
    variant, size = ready[0]
    pending.remove(ready[0])
    start = time.time()
    try:
      record = compare_case(workdir / f"{variant}-{size}")
    except Exception as error:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
      record = {"error": f"{type(error).__name__}: {error}"}
    results[variant, size] = {"variant": variant, "size": size,
                              "compare_s": time.time() - start, **record}
    print(json.dumps(results[variant, size]), flush=True)
    pathlib.Path(args.out).write_text(json.dumps(list(results.values()), indent=1))
  for process in processes:
    if process.poll() is None:
      process.terminate()
  records = [results.get(c, {"variant": c[0], "size": c[1], "error": "no reference in time"})
             for c in cases]
  pathlib.Path(args.out).write_text(json.dumps(records, indent=1))
  print(table(records), flush=True)


if __name__ == "__main__":
  main()
