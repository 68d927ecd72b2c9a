"""Loading and saving the authors' Hugging Face checkpoints.

    model = load_hf("gated-deltanet-lte-0.4B-10B")            # HybridLM, float32 parameters
    save_hf(model, "out_dir")                                    # config.json + model.safetensors
    save_hf("runs/x/export", "out_dir", tokenizer="hf_dir")      # from a params export

A checkpoint directory holds `config.json` (see `hf_config`) and safetensors weights (see
`safetensors_io`); the tensors map onto our parameters through the table in `weights`. Nothing
here needs PyTorch.
"""

from __future__ import annotations

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.convert import hf_config, weights
from lalte_jax.convert.safetensors_io import (DEFAULT_MAX_SHARD_BYTES, SafetensorsReader,
                                              write_safetensors)
# The tokenizer files travel with a checkpoint; these are shared with prepared corpora and exports.
from lalte_jax.data.tokenizer import copy_tokenizer, tokenizer_directory
from lalte_jax.inference import checkpoint
from lalte_jax.model import HybridLM

CONFIG_FILE = "config.json"
# The source config.json kept beside a converted params export: `to-hf` restores the fields our
# ModelConfig does not hold (token ids, LTE training settings) from it.
SOURCE_CONFIG_FILE = "hf_config.json"
STORED_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def read_hf_config(path: str | pathlib.Path) -> dict:
  config_path = pathlib.Path(path) / CONFIG_FILE
  if not config_path.is_file():
    raise ValueError(f"checkpoint {path}: no {CONFIG_FILE} (expected a Hugging Face checkpoint"
                     " directory)")
  try:
    return json.loads(config_path.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"checkpoint {config_path}: not valid JSON ({error})") from None


def read_hf(path: str | pathlib.Path, dtype: str | None = None
            ) -> tuple[ModelConfig, dict, dict]:
  """(ModelConfig, our pure param dict of float32 NumPy arrays, carried fields) of the checkpoint
  directory `path`. The config is named after the directory; `dtype` sets its activation dtype
  (default float32, as the authors evaluate)."""
  directory = pathlib.Path(path)
  hf = read_hf_config(directory)
  config, carried = hf_config.model_config_from_hf(
      hf, name=directory.absolute().name, dtype=dtype or "float32")
  reader = SafetensorsReader(directory)
  params = weights.params_from_hf(config, reader, checkpoint.param_shapes(config),
                                  where=f"checkpoint {directory}")
  return config, params, carried


def load_hf(path: str | pathlib.Path, dtype: str | None = None) -> HybridLM:
  """The model of an authors' checkpoint directory (config.json + safetensors), with float32
  parameters and activations in `dtype` (default float32)."""
  config, params, _ = read_hf(path, dtype)
  return checkpoint.model_from_param_dict(config, params)


def write_hf(config: ModelConfig, params: dict, out_dir: str | pathlib.Path, *,
             dtype: str = "float32", carried: dict | None = None,
             tokenizer: str | pathlib.Path | None = None,
             max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> pathlib.Path:
  """Writes `params` (our pure param dict) as an authors' checkpoint into `out_dir`, which must
  not exist or be empty. dtype: of the stored tensors ("float32" or "bfloat16")."""
  if dtype not in STORED_DTYPES:
    raise ValueError(f"dtype: {dtype!r} is not one of {sorted(STORED_DTYPES)}")
  hf = hf_config.hf_config_from_model(config, torch_dtype=dtype, carried=carried)
  tensors = weights.params_to_hf(config, params, hf_config.lambda_sharing(hf))
  out_dir = _check_destination(out_dir, tokenizer)
  out_dir.mkdir(parents=True, exist_ok=True)
  stored = STORED_DTYPES[dtype]
  write_safetensors(out_dir, {k: v.astype(stored) for k, v in tensors.items()}, max_shard_bytes)
  (out_dir / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
  if tokenizer is not None:
    copy_tokenizer(tokenizer, out_dir)
  return out_dir


def _check_destination(out_dir: str | pathlib.Path, tokenizer: str | pathlib.Path | None
                       ) -> pathlib.Path:
  """ValueError unless `out_dir` is new or empty and `tokenizer` (if any) holds tokenizer.json;
  checked before anything is read or written."""
  out_dir = pathlib.Path(out_dir)
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
    raise ValueError(f"out: {out_dir} already exists and is not an empty directory")
  if tokenizer is not None:
    tokenizer_directory(tokenizer)
  return out_dir


def save_hf(model_or_export: HybridLM | str | pathlib.Path, out_dir: str | pathlib.Path, *,
            dtype: str = "float32", tokenizer: str | pathlib.Path | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> pathlib.Path:
  """Writes a model, or the params export at a path (`lalte_jax.inference.checkpoint`), as an
  authors' checkpoint directory that their code and FLA load with `from_pretrained`. An export
  converted from their format restores its token ids and LTE training settings."""
  _check_destination(out_dir, tokenizer)
  carried = None
  if isinstance(model_or_export, HybridLM):
    model = model_or_export
  else:
    model = checkpoint.load_model(model_or_export)
    source = pathlib.Path(model_or_export) / SOURCE_CONFIG_FILE
    if source.is_file():
      _, carried = hf_config.model_config_from_hf(json.loads(source.read_text()), name="source")
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return write_hf(model.config, params, out_dir, dtype=dtype, carried=carried,
                  tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)
