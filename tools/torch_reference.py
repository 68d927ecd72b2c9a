"""The PyTorch side of tools/compare_torch.py: builds, saves and runs the reference models.

Run by compare_torch.py in a process of its own per family (never imported by the package;
tools/bench_prefill.py --fla imports `setup` to time FLA's models without the parity changes):

  fla      FLA 0.6.0 (transformers 5) for model types gated_deltanet and transformer;
  authors  the authors' fork of FLA 0.3.1 (transformers 4.53) for hybrid_gated_deltanet and nsa.

For each case directory holding `spec.json` ({"hf_config", "batch", "length", "new_tokens",
"seed"}) it builds the model from the config with random weights (every tensor drawn, norm weights
and router biases included, so that a misplaced tensor shows), writes it with `save_pretrained`
into `<case>/hf`, and stores in `<case>/reference.npz`:

  tokens            [B, T] the prompt
  logits_f32        [B, T, V] float32 forward without cache (LTE: the training-time layer, no cap)
  hidden_f32        [L + 1, B, T, D] (authors only) that forward's input to each layer, then the
                    last layer's output after the final norm
  scores_f32        [L_lte, B, T - margin, Hkv] LTE router scores of that forward (sigmoid - 0.5)
  prefill_f32       [B, T, V] logits of the cached prefill (LTE: capped at b, §5.2)
  oow_scores_f32    [L_lte, B, b, Hkv] the LTE caches' out-of-window segments after the prefill
                    (the kept tokens' scores in position order; sinks +inf, unused -inf)
  oow_counts_f32    [L_lte, B, Hkv] their fill counts
  greedy_f32        [B, new_tokens] greedy tokens through the cached decoder
  logits_bf16       [B, T, V] the same forward as logits_f32 with the model cast to bfloat16

It also converts `<case>/hf` to our parameters and back (`lalte_jax.convert`, NumPy only),
loads the result with `from_pretrained` and records whether its logits equal the original's.

What is changed in the reference run, and why (float32 parity needs float32 arithmetic throughout):
- TF32 is off: torch matmul and cuDNN flags, and TRITON_F32_DEFAULT=ieee (set by the driver) for
  every Triton dot of FLA and of the authors' kernels.
- TORCHDYNAMO_DISABLE=1 (set by the driver): `torch.compile`-decorated functions run eagerly.
- flash-attn is absent: a stand-in module is registered whose `flash_attn_func` (used by FLA's
  attention layer and by the window branch of the authors' NSA) is PyTorch SDPA with flash-attn's
  causal / window convention (`--parallel-attn`: FLA's `parallel_attn` for FLA's prefill).
- cuDNN is off (`torch.backends.cudnn.enabled = False`): the LTE router's Conv2d, the only
  convolution, runs PyTorch's own kernels.
- Triton autotuning is off: each autotuned kernel runs its first (pruned) launch configuration.
- GDN layers run the fused-recurrent kernel: the same recurrence token by token, with no dots
  (the authors' chunk kernel refuses float32).
- authors only: their layers cast q/k/v to float16 when the model is float32 (§9.4); their
  modules fla.layers.{gated_deltanet,attn,lte,nsa} are compiled with `torch.float16` read as
  `torch.float32`, which makes those casts no-ops. Their LTE layer runs its mask-based path
  (`use_flash_attn = False`; their Triton prefill kernel needs windows W = w + 1 that are
  multiples of 64), with FlexAttention replaced by SDPA over the same masks: their own
  `lte_attention_naive` for the prefill and the forward, and for decode steps the mask of their
  `prepare_compact_lte_mask` written out as one boolean tensor. The uncapped forward sets their
  `enforce_buffer_size = False`; the cached prefill and decode keep the cap b.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.abc
import importlib.machinery
import json
import os
import pathlib
import sys
import time
import types

import numpy as np

HALF_CAST_MODULES = ("fla.layers.gated_deltanet", "fla.layers.attn", "fla.layers.lte",
                     "fla.layers.nsa")


class _Float32Loader(importlib.machinery.SourceFileLoader):
  """Compiles a module with every `torch.float16` read as `torch.float32` (no bytecode cache)."""

  def get_code(self, fullname):
    source = self.get_data(self.path).decode("utf-8")
    return compile(source.replace("torch.float16", "torch.float32"), self.path, "exec",
                   dont_inherit=True)


class _Float32Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, fullname, path, target=None):
    if fullname not in HALF_CAST_MODULES:
      return None
    spec = importlib.machinery.PathFinder.find_spec(fullname, path)
    if spec is not None:
      spec.loader = _Float32Loader(fullname, spec.origin)
    return spec


def install_flash_attn_stand_in():
  """A `flash_attn` module (with a ModuleSpec, which transformers' availability check reads):
  `flash_attn_func` is SDPA with flash-attn's conventions, the rest refuse to run."""
  def unavailable(*args, **kwargs):
    raise NotImplementedError("flash-attn is not installed; this path is not used here")

  def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
    if not causal or window_size[1] not in (0, -1):
      raise NotImplementedError("the stand-in flash_attn_func is causal only")
    return sdpa_with_flash_convention(q, k, v, window_size[0])
  module = types.ModuleType("flash_attn")
  module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
  module.__version__ = "2.7.4"
  module.flash_attn_func = flash_attn_func
  module.flash_attn_varlen_func = module.flash_attn_with_kvcache = unavailable
  padding = types.ModuleType("flash_attn.bert_padding")
  padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
  padding.index_first_axis = padding.pad_input = padding.unpad_input = unavailable
  module.bert_padding = padding
  sys.modules["flash_attn"] = module
  sys.modules["flash_attn.bert_padding"] = padding


def sdpa_with_flash_convention(q, k, v, window_left):
  """flash-attn's causal attention for q [B, Tq, H, D], k/v [B, Tk, Hkv, D]: query i sits at
  position Tk - Tq + i and sees keys j <= it, at most `window_left` back (-1: unbounded)."""
  import torch  # pylint: disable=import-outside-toplevel
  tq, tk = q.shape[1], k.shape[1]
  group = q.shape[2] // k.shape[2]
  query_pos = torch.arange(tk - tq, tk, device=q.device)[:, None]
  key_pos = torch.arange(tk, device=q.device)[None, :]
  mask = key_pos <= query_pos
  if window_left >= 0:
    mask &= query_pos - key_pos <= window_left
  out = torch.nn.functional.scaled_dot_product_attention(
      q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
      v.repeat_interleave(group, 2).transpose(1, 2), attn_mask=mask)
  return out.transpose(1, 2)


def use_parallel_attn_for_prefill():
  """FLA's attention layer: FLA's `parallel_attn` when queries and keys have the same length."""
  import fla.layers.attn  # pylint: disable=import-outside-toplevel
  from fla.ops.attn.parallel import parallel_attn  # pylint: disable=import-outside-toplevel
  stand_in = fla.layers.attn.flash_attn_func

  def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
    if q.shape[1] != k.shape[1]:
      return stand_in(q, k, v, causal=causal, window_size=window_size)
    return parallel_attn(q, k, v, window_size=None if window_size[0] < 0 else window_size[0] + 1)
  fla.layers.attn.flash_attn_func = flash_attn_func


def patch_authors_lte():
  import torch  # pylint: disable=import-outside-toplevel
  import fla.layers.lte as lte  # pylint: disable=import-outside-toplevel

  def compact_lte_attention(q, k, v, blank_lengths, prefix_length, past_lengths, window_size):
    """Their decode attention over the cache: slot s is visible iff s < W + past_len[b, h] and s
    is not one of the ring's blank slots [ptr, ptr + blank[b]) (their compact LTE mask)."""
    group = q.shape[1] // k.shape[1]
    slot = torch.arange(k.shape[2], device=k.device)
    past_BH = past_lengths.repeat_interleave(group, -1)
    blank = (slot >= prefix_length) & (slot < prefix_length + blank_lengths[:, None])  # [B, S]
    mask = (slot[None, None] < window_size + past_BH[..., None]) & ~blank[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
        attn_mask=mask[:, :, None, :])

  lte.use_flash_attn = False
  lte.lte_attention = lte.lte_attention_naive
  lte.compact_lte_attention = compact_lte_attention
  return lte


def disable_autotuning():
  """Every Triton autotuner keeps only the first of its (pruned) launch configurations: FLA's
  kernels would otherwise benchmark all of them for every new shape, for minutes. Launch
  parameters change speed, not the computation."""
  from triton.runtime.autotuner import Autotuner  # pylint: disable=import-outside-toplevel
  prune = Autotuner.prune_configs

  def first_config(self, kwargs, *rest):
    return prune(self, kwargs, *rest)[:1]
  Autotuner.prune_configs = first_config


def setup(family: str, parallel_attn: bool, *, exact: bool = True):
  """Imports torch and the family's `fla` with the changes the module docstring lists.

  exact=False leaves out the changes made for float32 parity (TF32 and cuDNN off, Triton
  autotuning off) and keeps the flash-attn stand-in: FLA runs as it ships, for timing
  (tools/bench_prefill.py --fla)."""
  import torch  # pylint: disable=import-outside-toplevel
  if exact:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # The LTE router's Conv2d is the only convolution: PyTorch's own kernels, so that no cuDNN
    # algorithm of reduced float32 precision can be chosen for it.
    torch.backends.cudnn.enabled = False
    disable_autotuning()
  install_flash_attn_stand_in()
  if family == "authors":
    sys.meta_path.insert(0, _Float32Finder())
  import fla  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  if parallel_attn:
    use_parallel_attn_for_prefill()
  if family == "authors":
    patch_authors_lte()
  return torch


def randomize(model, seed: int) -> None:
  """Draws every parameter (on the CPU, so that the draw does not depend on the device)."""
  import torch  # pylint: disable=import-outside-toplevel
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      def normal(std, mean=0.0, shape=p.shape):
        return mean + std * torch.randn(shape, generator=generator)
      if name.endswith(("A_log", "dt_bias")):
        continue  # keep the init's ranges (decays in (0, 1))
      if p.ndim == 1 and "norm" in name:
        value = normal(0.1, 1.0)
      elif "router" in name:
        value = normal(0.3) if name.endswith("proj.bias") else p.detach().cpu() + normal(0.02)
      elif "conv1d" in name:
        value = normal(p.shape[-1] ** -0.5)
      elif "embeddings" in name or "lm_head" in name:
        value = normal(0.05)
      elif p.ndim == 2:
        value = normal(p.shape[1] ** -0.5)
      else:
        value = normal(0.1)
      p.copy_(value.to(p.dtype))


def lte_scores(output):
  """[L_lte, B, T - margin, Hkv] float32 router scores of the authors' LTE statistics, or None."""
  stat = getattr(output, "stat", None)
  if stat is None:
    return None
  return np.stack([stat[2][i].float().cpu().numpy() for i in sorted(stat[2])])


def lte_cache_segments(model, cache) -> dict:
  """The out-of-window segment of every LTE layer's cache after the prefill (§5.1: scores in
  position order, sinks +inf, unused -inf) and its fill counts."""
  layers = [m for m in model.modules() if type(m).__name__ == "LTEAttention"]
  if not layers:
    return {}
  window_keys = layers[0].window_size + 1
  states = [cache.states[layer.layer_idx]["attn_state"] for layer in layers]
  return {"oow_scores_f32": np.stack([s[2][:, window_keys:].float().cpu().numpy()
                                      for s in states]),
          "oow_counts_f32": np.stack([s[6].cpu().numpy() for s in states])}


def log(case_dir: pathlib.Path, stage: str, start: float) -> None:
  print(f"  {case_dir.name}: {stage} ({time.perf_counter() - start:.1f}s)", flush=True)


def run_case(torch, family: str, case_dir: pathlib.Path) -> dict:
  # pylint: disable-next=import-outside-toplevel
  from transformers import AutoConfig, AutoModelForCausalLM
  spec = json.loads((case_dir / "spec.json").read_text())
  timings = {}
  start = time.perf_counter()
  config_dir = case_dir / "config"
  config_dir.mkdir(exist_ok=True)
  (config_dir / "config.json").write_text(json.dumps(spec["hf_config"]))
  model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
  model = model.cuda().eval()
  randomize(model, spec["seed"])
  model.save_pretrained(case_dir / "hf")
  timings["build_save_s"] = time.perf_counter() - start
  log(case_dir, "built and saved", start)
  rng = np.random.default_rng(spec["seed"])
  tokens = rng.integers(0, spec["hf_config"]["vocab_size"], (spec["batch"], spec["length"]))
  ids = torch.as_tensor(tokens, device="cuda")
  lte = sys.modules.get("fla.layers.lte") if family == "authors" else None
  out = {"tokens": tokens}
  gdn_layers = [m for m in model.modules() if type(m).__name__ == "GatedDeltaNet"]
  with torch.no_grad():
    start = time.perf_counter()
    for layer in gdn_layers:  # module docstring: the recurrent kernel in float32
      layer.mode = "fused_recurrent"
    if lte is not None:
      lte.enforce_buffer_size = False
    # The authors' models also give every layer's input (and the normed last output), so that
    # each of our blocks can be checked on exactly their input (tools/layer_parity.py).
    forward = model(input_ids=ids, use_cache=False, output_hidden_states=family == "authors")
    if lte is not None:
      lte.enforce_buffer_size = True
    out["logits_f32"] = forward.logits.float().cpu().numpy()
    if family == "authors":
      out["hidden_f32"] = torch.stack(forward.hidden_states).float().cpu().numpy()
    log(case_dir, "float32 forward", start)
    scores = lte_scores(forward)
    if scores is not None:
      out["scores_f32"] = scores
    prefill = model(input_ids=ids, use_cache=True)
    out["prefill_f32"] = prefill.logits.float().cpu().numpy()
    out.update(lte_cache_segments(model, prefill.past_key_values))
    log(case_dir, "float32 prefill", start)
    cache, generated = prefill.past_key_values, []
    token = prefill.logits[:, -1].argmax(-1)
    for _ in range(spec["new_tokens"]):
      generated.append(token)
      step = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
      cache, token = step.past_key_values, step.logits[:, -1].argmax(-1)
    out["greedy_f32"] = torch.stack(generated, 1).cpu().numpy()
    timings["float32_s"] = time.perf_counter() - start
    log(case_dir, "float32 greedy decode", start)

    start = time.perf_counter()
    roundtrip = roundtrip_logits(AutoModelForCausalLM, case_dir, ids, lte)
    timings["roundtrip_s"] = time.perf_counter() - start
    diff = float(np.max(np.abs(roundtrip - out["logits_f32"])))
    log(case_dir, "round trip", start)

    start = time.perf_counter()
    model = model.to(torch.bfloat16)
    if lte is not None:
      lte.enforce_buffer_size = False
    out["logits_bf16"] = model(input_ids=ids, use_cache=False).logits.float().cpu().numpy()
    if lte is not None:
      lte.enforce_buffer_size = True
    timings["bfloat16_s"] = time.perf_counter() - start
    log(case_dir, "bfloat16 forward", start)
  np.savez(case_dir / "reference.npz", **out)
  return {"timings": timings, "roundtrip_max_abs_diff": diff,
          "device": torch.cuda.get_device_name()}


def roundtrip_logits(auto_model, case_dir, ids, lte):
  """Logits of `<case>/hf` after our import and export (`<case>/hf_roundtrip`)."""
  from lalte_jax.convert import read_hf, write_hf  # pylint: disable=import-outside-toplevel
  config, params, carried = read_hf(case_dir / "hf")
  write_hf(config, params, case_dir / "hf_roundtrip", carried=carried)
  model = auto_model.from_pretrained(case_dir / "hf_roundtrip").cuda().eval()
  for layer in model.modules():
    if type(layer).__name__ == "GatedDeltaNet":
      layer.mode = "fused_recurrent"
  if lte is not None:
    lte.enforce_buffer_size = False
  logits = model(input_ids=ids, use_cache=False).logits.float().cpu().numpy()
  if lte is not None:
    lte.enforce_buffer_size = True
  del model
  return logits


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", choices=("fla", "authors"), required=True)
  parser.add_argument("cases", nargs="+", help="case directories holding spec.json")
  parser.add_argument("--parallel-attn", action="store_true",
                      help="FLA's parallel_attn for prefill attention (autotunes per shape)"
                      " instead of SDPA")
  parser.add_argument("--timeout-s", type=float, default=None,
                      help="print every thread's stack and exit after this many seconds")
  args = parser.parse_args()
  if args.timeout_s:
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the round trip's JAX stays off the GPU
  torch = setup(args.family, args.parallel_attn)
  for case in args.cases:
    case_dir = pathlib.Path(case)
    try:
      record = run_case(torch, args.family, case_dir)
    except Exception as error:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
      record = {"error": f"{type(error).__name__}: {error}"}
    (case_dir / "reference.json").write_text(json.dumps(record, indent=1))
    print(f"reference {case_dir.name}: {json.dumps(record)}", flush=True)
    torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
