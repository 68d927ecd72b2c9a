"""FLA's PyTorch models of our presets, the anchors of tools/bench_prefill.py --fla and
tools/bench_train_fla.py.

FLA 0.6.0 has models for the GDN, GDN+SWA, GDN+Attn and Transformer variants (laLTE, laNSA and
NSA have none). `fla_model` builds the `fla.models` model of the config.json that
`lalte_jax.convert` writes for a preset, so its parameter count, next to ours, shows that the
configs match. flash-attn is absent on our GPU image: FLA's attention layer runs FLA's own Triton
`parallel_attn` through the stand-in of tools/torch_reference.py (`setup(exact=False)`: TF32,
cuDNN and Triton autotuning left as FLA ships them).
"""

from __future__ import annotations

import argparse
import importlib.util

from compare_torch import FAMILY  # tools/compare_torch.py: model type -> "fla" | "authors"

from lalte_jax.config import get_model_config
from lalte_jax.convert import hf_config

FLA_PACKAGES = ("torch", "transformers", "fla")


def has_fla_model(preset: str) -> bool:
  """Whether FLA 0.6.0 has a model of `preset`'s variant."""
  return FAMILY[hf_config.model_type_of(get_model_config(preset))] == "fla"


def load_fla(parser: argparse.ArgumentParser):
  """torch with FLA imported (tools/torch_reference.py's setup, exact=False); a parser error
  naming what is missing on a machine without them or without a CUDA GPU."""
  missing = [name for name in FLA_PACKAGES if importlib.util.find_spec(name) is None]
  if missing:
    parser.error("FLA rows need PyTorch, transformers 5 and FLA 0.6.0 (flash-linear-attention"
                 f" and fla-core); not importable here: {', '.join(missing)}")
  import torch_reference  # pylint: disable=import-outside-toplevel  # tools/torch_reference.py
  torch = torch_reference.setup("fla", parallel_attn=True, exact=False)
  if not torch.cuda.is_available():
    parser.error("FLA rows need a CUDA GPU (FLA's kernels are Triton GPU kernels);"
                 " torch.cuda.is_available() is False")
  return torch


def lift_hopper_guard() -> None:
  """FLA 0.6.0 refuses its gated GDN backward (chunk_bwd_dqkwg) on Hopper with Triton < 3.7.1,
  whose results can be wrong there. For a timing anchor only, lift that guard: FLA's gradients
  are never compared (ours are checked against the float64 recurrence by the GPU tests)."""
  import fla.ops.common.chunk_o as fla_chunk_o  # pylint: disable=import-outside-toplevel
  fla_chunk_o.TRITON_ABOVE_3_7_1 = True


def fla_model(torch, preset: str, dtype: str):
  """FLA's model of `preset` with FLA's random init, its parameters in `dtype`, on the GPU
  (in training mode: callers that only run it call `.eval()`)."""
  # pylint: disable-next=import-outside-toplevel
  from transformers import AutoConfig, AutoModelForCausalLM
  hf = hf_config.hf_config_from_model(get_model_config(preset), torch_dtype=dtype)
  config = AutoConfig.for_model(hf["model_type"],
                                **{key: value for key, value in hf.items() if key != "model_type"})
  with torch.device("cuda"):  # parameters made on the GPU
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
  return model.to("cuda")
