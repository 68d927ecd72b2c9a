"""Reading and writing Hugging Face safetensors weights (one file or shards with an index).

A checkpoint directory holds either `model.safetensors` or `model.safetensors.index.json`, whose
`weight_map` names the shard of every tensor (`model-00001-of-00003.safetensors`, ...). Tensors
are read one at a time through the `safetensors` NumPy API, so shapes can be checked before any
data is loaded; bfloat16 tensors come back as `ml_dtypes.bfloat16` arrays.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, which safetensors' NumPy API needs)
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers loads only safetensors files whose metadata names a framework it knows.
FILE_METADATA = {"format": "pt"}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class SafetensorsReader:
  """The tensors of a checkpoint directory: `names`, `shape(name)`, `get(name)`."""

  def __init__(self, directory: str | pathlib.Path):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    self.directory = pathlib.Path(directory)
    index_path = self.directory / INDEX_FILE
    single_path = self.directory / SINGLE_FILE
    if index_path.is_file():
      file_of = _read_index(index_path)
    elif single_path.is_file():
      file_of = None
    else:
      raise ValueError(f"checkpoint {self.directory}: no {SINGLE_FILE} or {INDEX_FILE} (only"
                       " safetensors weights are read; re-save a pytorch_model.bin checkpoint"
                       " with save_pretrained(..., safe_serialization=True))")
    self._handles = {}
    self._file_of: dict[str, str] = {}
    files = sorted(set(file_of.values())) if file_of is not None else [SINGLE_FILE]
    for name in files:
      path = self.directory / name
      if not path.is_file():
        raise ValueError(f"checkpoint {self.directory}: {INDEX_FILE} names the shard {name},"
                         " which does not exist")
      handle = safe_open(str(path), framework="np")
      self._handles[name] = handle
      for key in handle.keys():
        if key in self._file_of:
          raise ValueError(f"checkpoint {self.directory}: tensor {key!r} is stored in both"
                           f" {self._file_of[key]} and {name}")
        self._file_of[key] = name
    if file_of is not None:
      for key, name in file_of.items():
        if self._file_of.get(key) != name:
          raise ValueError(f"checkpoint {self.directory}: {INDEX_FILE} puts {key!r} in {name},"
                           " which does not hold it")

  @property
  def names(self) -> set[str]:
    return set(self._file_of)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    return self._handles[self._file_of[name]].get_tensor(name)


def _read_index(path: pathlib.Path) -> dict[str, str]:
  try:
    weight_map = json.loads(path.read_text())["weight_map"]
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise ValueError(f"checkpoint: {path} is not a safetensors index ({error!r})") from None
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise ValueError(f"checkpoint: {path}: weight_map must map tensor names to file names")
  return weight_map


def write_safetensors(directory: str | pathlib.Path, tensors: dict[str, np.ndarray],
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
  """Writes `tensors` into `directory` (which must exist): one `model.safetensors`, or shards of
  at most `max_shard_bytes` (a larger tensor gets a shard of its own) plus the index. Returns the
  file names written."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  directory = pathlib.Path(directory)
  shards: list[dict[str, np.ndarray]] = [{}]
  shard_bytes = 0
  for name in sorted(tensors):
    size = tensors[name].nbytes
    if shards[-1] and shard_bytes + size > max_shard_bytes:
      shards.append({})
      shard_bytes = 0
    shards[-1][name] = np.ascontiguousarray(tensors[name])
    shard_bytes += size
  if len(shards) == 1:
    save_file(shards[0], str(directory / SINGLE_FILE), metadata=FILE_METADATA)
    return [SINGLE_FILE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    save_file(shard, str(directory / name), metadata=FILE_METADATA)
    weight_map.update({key: name for key in shard})
  total = sum(t.nbytes for t in tensors.values())
  (directory / INDEX_FILE).write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
  return names + [INDEX_FILE]
