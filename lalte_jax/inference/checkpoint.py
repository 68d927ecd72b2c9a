"""Params-only checkpoints for inference: a directory with `model.json` (the preset name) and
`params/` (the model's `nnx.Param` state written by orbax's StandardCheckpointer).

Loading checks the stored parameter tree against the preset's before restoring, so a checkpoint of
another architecture fails with a ValueError that names the first differences.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.model import HybridLM

FORMAT = "lalte_jax.params.v1"
METADATA_FILE = "model.json"
PARAMS_DIR = "params"


def save_params(model: HybridLM, directory: str | pathlib.Path) -> None:
  """Writes `model`'s parameters and preset name under `directory` (which must not exist)."""
  import orbax.checkpoint as ocp
  directory = pathlib.Path(directory).absolute()
  if directory.exists():
    raise ValueError(f"checkpoint: {directory} already exists")
  directory.mkdir(parents=True)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory / PARAMS_DIR, _string_keys(params))
  checkpointer.wait_until_finished()
  (directory / METADATA_FILE).write_text(json.dumps(
      {"format": FORMAT, "config_name": model.config.name}, indent=2))


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


def read_config_name(directory: str | pathlib.Path) -> str:
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise ValueError(f"checkpoint: {directory} is not a directory")
  metadata_path = directory / METADATA_FILE
  if not metadata_path.is_file() or not (directory / PARAMS_DIR).is_dir():
    raise ValueError(f"checkpoint: {directory} lacks {METADATA_FILE} or {PARAMS_DIR}/ (expected a"
                     " params-only checkpoint written by lalte_jax.inference.checkpoint)")
  try:
    metadata = json.loads(metadata_path.read_text())
    return str(metadata["config_name"])
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"checkpoint: {metadata_path} is not valid metadata ({error})") from error


def load_params(directory: str | pathlib.Path, config_name: str | None = None,
                dtype: str | None = None) -> HybridLM:
  """The model stored in `directory`.

  config_name: the preset the caller expects; a checkpoint of another preset raises ValueError.
  dtype: activation dtype override ("bfloat16" on GPUs); parameters stay float32.
  """
  import orbax.checkpoint as ocp
  directory = pathlib.Path(directory).absolute()
  stored_name = read_config_name(directory)
  if config_name is not None and config_name != stored_name:
    raise ValueError(f"checkpoint: {directory} holds a {stored_name!r} model, not the requested"
                     f" {config_name!r}")
  config = get_model_config(stored_name)
  if dtype is not None:
    config = config.replace(dtype=dtype)
  abstract = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  graphdef, params_state, rest = nnx.split(abstract, nnx.Param, ...)
  target = _string_keys(nnx.to_pure_dict(params_state))
  checkpointer = ocp.StandardCheckpointer()
  stored = checkpointer.metadata(directory / PARAMS_DIR).item_metadata.tree
  expected_shapes, stored_shapes = _flat_shapes(target), _flat_shapes(stored)
  if expected_shapes != stored_shapes:
    missing = sorted(set(expected_shapes) - set(stored_shapes))[:3]
    extra = sorted(set(stored_shapes) - set(expected_shapes))[:3]
    wrong = [f"{k}: stored {stored_shapes[k]}, expected {v}" for k, v in expected_shapes.items()
             if k in stored_shapes and stored_shapes[k] != v][:3]
    raise ValueError(f"checkpoint: the parameters in {directory} do not fit {stored_name!r}"
                     f" (another architecture?); missing {missing}, unexpected {extra},"
                     f" wrong shapes {wrong}")
  abstract_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), target)
  restored = checkpointer.restore(directory / PARAMS_DIR, abstract_target)
  nnx.replace_by_pure_dict(params_state,
                           _keys_like(nnx.to_pure_dict(params_state), restored))
  rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), rest)
  return nnx.merge(graphdef, params_state, rest)
