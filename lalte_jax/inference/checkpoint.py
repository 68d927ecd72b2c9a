"""Params-only checkpoints for inference: a directory with `model.json` and `params/` (the
model's `nnx.Param` state written by orbax's StandardCheckpointer).

`model.json` holds the full `ModelConfig` (so custom configs, e.g. a preset with a smaller width
or window, load without a preset of their own), its name, and the dtype the parameters were
stored in. Older files that hold only `config_name` load through the preset of that name.
Parameters may be stored in bfloat16 (`save_params(..., dtype="bfloat16")`, half the bytes);
loading gives float32 parameters, or with `param_dtype="bfloat16"` bfloat16 matrices and float32
vectors for serving (`lalte_jax.inference.param_dtype`), whatever the stored dtype.

Loading checks the stored parameter tree against the config's before restoring, so a checkpoint of
another architecture fails with a ValueError that names the first differences. A damaged or
incomplete directory (no `model.json`, no `params/_METADATA`, files that differ from the checksum
record `checksums.json` written with them, see `lalte_jax.integrity`, or any failure to read)
fails with a ValueError that names the directory and what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax import integrity
from lalte_jax.config import (AttentionConfig, GDNConfig, LTEConfig, ModelConfig, NSAConfig,
                              get_model_config)
# PARAM_DTYPES: the dtypes parameters are stored in, as those they are held in.
from lalte_jax.inference.param_dtype import (PARAM_DTYPES, cast_params_for_inference,
                                             check_param_dtype)
from lalte_jax.model import HybridLM

FORMAT = "lalte_jax.params.v2"
METADATA_FILE = "model.json"
PARAMS_DIR = "params"
_SUB_CONFIGS = {"gdn": GDNConfig, "attention": AttentionConfig, "lte": LTEConfig,
                "nsa": NSAConfig}


def model_config_to_json(config: ModelConfig) -> dict:
  """A JSON-able dict of every field of `config` (tuples become lists)."""
  return json.loads(json.dumps(dataclasses.asdict(config)))


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def model_config_from_json(data: dict) -> ModelConfig:
  """The ModelConfig that `model_config_to_json` wrote (equal to the original); unknown or
  missing fields raise ValueError."""
  def build(cls, fields: dict, where: str):
    if not isinstance(fields, dict):
      raise ValueError(f"checkpoint: {where} must be an object, got {fields!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
      raise ValueError(f"checkpoint: {where} has unknown fields {unknown}")
    values = {}
    for name, value in fields.items():
      if name in _SUB_CONFIGS and cls is ModelConfig:
        values[name] = None if value is None else build(_SUB_CONFIGS[name], value, name)
      else:
        values[name] = _tuples(value)  # every list-valued config field is a tuple
    try:
      return cls(**values)
    except TypeError as error:  # a missing required field
      raise ValueError(f"checkpoint: {where}: {error}") from None
  return build(ModelConfig, data, "model_config")


def save_params(model: HybridLM, directory: str | pathlib.Path, dtype: str = "float32") -> None:
  """Writes `model`'s parameters (cast to `dtype`) and full config under `directory` (which must
  not exist)."""
  save_param_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.config, directory, dtype)


def save_param_dict(params: dict, config: ModelConfig, directory: str | pathlib.Path,
                    dtype: str = "float32") -> None:
  """`save_params` for an nnx pure dict of parameters (e.g. a train state's, sharded or not).
  In a multi-process run every process calls it (Orbax writes each process's shards); process 0
  creates the directory and writes `model.json`."""
  import orbax.checkpoint as ocp
  if dtype not in PARAM_DTYPES:
    raise ValueError(f"save_params: dtype {dtype!r} is not one of {PARAM_DTYPES}")
  directory = pathlib.Path(directory).absolute()
  primary = jax.process_index() == 0
  if primary:
    if directory.exists():
      raise ValueError(f"checkpoint: {directory} already exists")
    directory.mkdir(parents=True)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory / PARAMS_DIR, _string_keys(params))
  checkpointer.wait_until_finished()  # on process 0: until every process has written its shards
  if primary:
    integrity.write_record(directory)
    (directory / METADATA_FILE).write_text(json.dumps(
        {"format": FORMAT, "config_name": config.name, "param_dtype": dtype,
         "model_config": model_config_to_json(config)}, indent=2))


def _string_keys(tree):
  """nnx pure dicts index lists by int; orbax stores every key as a string: save strings."""
  if isinstance(tree, dict):
    return {str(key): _string_keys(value) for key, value in tree.items()}
  return tree


def _keys_like(template, tree):
  """`tree` (string keys) re-keyed like `template` (the model's pure dict)."""
  if isinstance(template, dict):
    return {key: _keys_like(value, tree[str(key)]) for key, value in template.items()}
  return tree


def _flat_shapes(tree) -> dict[str, tuple[int, ...]]:
  return {jax.tree_util.keystr(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _read_metadata(directory: str | pathlib.Path) -> dict:
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ValueError(f"checkpoint: {directory} is not a directory")
  metadata_path = directory / METADATA_FILE
  if not metadata_path.is_file() or not (directory / PARAMS_DIR).is_dir():
    raise ValueError(f"checkpoint: {directory} lacks {METADATA_FILE} or {PARAMS_DIR}/ (expected a"
                     " params-only checkpoint written by lalte_jax.inference.checkpoint)")
  try:
    metadata = json.loads(metadata_path.read_text())
    metadata["config_name"] = str(metadata["config_name"])
    return metadata
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"checkpoint: {metadata_path} is not valid metadata ({error})") from error


def read_config_name(directory: str | pathlib.Path) -> str:
  return _read_metadata(directory)["config_name"]


def read_model_config(directory: str | pathlib.Path) -> ModelConfig:
  """The full config stored with the parameters (the preset of that name for v1 files)."""
  metadata = _read_metadata(directory)
  if "model_config" in metadata:
    return model_config_from_json(metadata["model_config"])
  return get_model_config(metadata["config_name"])


def load_params(directory: str | pathlib.Path, config_name: str | None = None,
                dtype: str | None = None, param_dtype: str = "float32") -> HybridLM:
  """The model stored in `directory`.

  config_name: the config name the caller expects; another name raises ValueError.
  dtype: activation dtype override ("bfloat16" on GPUs).
  param_dtype: "float32" (every parameter) or "bfloat16" (matrices in bfloat16, vectors float32:
    `cast_params_for_inference`), whatever dtype the parameters were stored in.
  """
  import orbax.checkpoint as ocp
  check_param_dtype(param_dtype)
  directory = pathlib.Path(directory).absolute()
  stored_name = read_config_name(directory)
  if config_name is not None and config_name != stored_name:
    raise ValueError(f"checkpoint: {directory} holds a {stored_name!r} model, not the requested"
                     f" {config_name!r}")
  config = read_model_config(directory)
  if dtype is not None:
    config = config.replace(dtype=dtype)
  reason = integrity.verify(directory)
  if reason is None and not (directory / PARAMS_DIR / integrity.TREE_METADATA_FILE).is_file():
    reason = f"{PARAMS_DIR}/{integrity.TREE_METADATA_FILE} is missing"
  if reason is not None:
    raise ValueError(f"checkpoint: {directory} is damaged or incomplete: {reason}")
  target = _string_keys(param_shapes(config))
  checkpointer = ocp.StandardCheckpointer()
  try:
    stored = checkpointer.metadata(directory / PARAMS_DIR).item_metadata.tree
  except Exception as error:  # pylint: disable=broad-exception-caught
    raise ValueError(f"checkpoint: {directory} is damaged: the parameter metadata is unreadable"
                     f" ({integrity.read_error_reason(error)})") from error
  expected_shapes, stored_shapes = _flat_shapes(target), _flat_shapes(stored)
  if expected_shapes != stored_shapes:
    missing = sorted(set(expected_shapes) - set(stored_shapes))[:3]
    extra = sorted(set(stored_shapes) - set(expected_shapes))[:3]
    wrong = [f"{k}: stored {stored_shapes[k]}, expected {v}" for k, v in expected_shapes.items()
             if k in stored_shapes and stored_shapes[k] != v][:3]
    raise ValueError(f"checkpoint: the parameters in {directory} do not fit {stored_name!r}"
                     f" (another architecture?); missing {missing}, unexpected {extra},"
                     f" wrong shapes {wrong}")
  # Onto one device whatever the saving run's mesh was (a trainer's export is sharded).
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract_target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=device), target)
  try:
    restored = checkpointer.restore(directory / PARAMS_DIR, abstract_target)
  except Exception as error:  # Orbax/TensorStore raise many types; all mean unreadable
    raise ValueError(f"checkpoint: {directory} is damaged: the parameters are unreadable"
                     f" ({integrity.read_error_reason(error)})") from error
  model = model_from_param_dict(config, _keys_like(param_shapes(config), restored))
  return model if param_dtype == "float32" else cast_params_for_inference(model, param_dtype)


def param_shapes(config: ModelConfig) -> dict:
  """The nnx pure dict of `HybridLM(config)`'s parameters as `jax.ShapeDtypeStruct`s (nothing is
  allocated)."""
  abstract = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def model_from_param_dict(config: ModelConfig, params: dict) -> HybridLM:
  """`HybridLM(config)` holding `params` (an nnx pure dict of arrays of the model's shapes, e.g.
  NumPy arrays) as float32 parameters, without initialising any."""
  abstract = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  graphdef, params_state, rest = nnx.split(abstract, nnx.Param, ...)
  nnx.replace_by_pure_dict(params_state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                                                      params))
  rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)
  return nnx.merge(graphdef, params_state, rest)


def load_model(directory: str | pathlib.Path, dtype: str | None = None,
               param_dtype: str = "float32") -> HybridLM:
  """The model (full stored config, parameters in `param_dtype` as `load_params`) of a
  params-only checkpoint, as the trainer's export (`python -m lalte_jax.train.export`,
  `<run_dir>/export`) writes it."""
  return load_params(directory, dtype=dtype, param_dtype=param_dtype)
