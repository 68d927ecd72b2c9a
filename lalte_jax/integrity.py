"""Damage to saved directories (train checkpoints, exports): a checksum record, and one-line
reasons for failed reads.

The record holds the size and CRC32 of every file in the directory's subfolders; it is written
once the save is complete and compared before the files are read back.

Reading alone does not notice every damage. A truncated array file or a missing metadata file
makes Orbax/TensorStore fail, but bytes overwritten inside an array data file decode to wrong
numbers without any error: TensorStore's zarr arrays as Orbax writes them carry a CRC32C only on
the shard index, not on the data chunks, and OCDBT checks its tree nodes but not the values
(measured with orbax-checkpoint 0.12.8 and tensorstore 0.1.86). The record catches that.

The record `checksums.json` sits at the top of the directory and covers the files of its
subfolders only: top-level files (the record itself, Orbax's `_CHECKPOINT_METADATA` and commit
marker, an export's `model.json`) are written or updated after it. A directory without a record
(saved before records existed) passes `verify`; reading it is then the only check.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib

RECORD_FILE = "checksums.json"
FORMAT = "lalte_jax.checksums.v1"
# Orbax's record of a saved pytree's structure, in every item folder it writes.
TREE_METADATA_FILE = "_METADATA"
_CHUNK_BYTES = 16 << 20
_REASON_CHARS = 200


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(path for folder in directory.iterdir() if folder.is_dir()
                for path in folder.rglob("*") if path.is_file())


def _crc32(path: pathlib.Path) -> int:
  crc = 0
  with open(path, "rb") as file:
    while chunk := file.read(_CHUNK_BYTES):
      crc = zlib.crc32(chunk, crc)  # releases the GIL: a background save does not stall training
  return crc


def write_record(directory: str | pathlib.Path) -> None:
  """Writes the record of `directory`'s subfolders (atomically: a reader sees all or nothing)."""
  directory = pathlib.Path(directory)
  files = {path.relative_to(directory).as_posix(): [path.stat().st_size, _crc32(path)]
           for path in _files(directory)}
  partial = directory / (RECORD_FILE + ".partial")
  partial.write_text(json.dumps({"format": FORMAT, "files": files}, indent=0))
  os.replace(partial, directory / RECORD_FILE)


def has_record(directory: str | pathlib.Path) -> bool:
  return (pathlib.Path(directory) / RECORD_FILE).is_file()


def verify(directory: str | pathlib.Path, *, part: int = 0, parts: int = 1) -> str | None:
  """The first way in which the files differ from the record (one short phrase), or None when
  they match it or there is no record. With `parts` > 1 only files part, part + parts, ... (in
  name order) are read, so that several processes can share the work."""
  directory = pathlib.Path(directory)
  path = directory / RECORD_FILE
  if not path.is_file():
    return None
  try:
    record = json.loads(path.read_text())
    files = sorted((str(name), int(size), int(crc)) for name, (size, crc)
                   in record["files"].items())
  except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
    return f"{RECORD_FILE} is unreadable"
  for name, size, crc in files[part::parts]:
    file = directory / name
    if not file.is_file():
      return f"{name} is missing"
    actual = file.stat().st_size
    if actual != size:
      return f"{name} has {actual} bytes, {size} were written"
    if _crc32(file) != crc:
      return f"{name} differs from what was written (CRC32)"
  return None


def read_error_reason(error: BaseException) -> str:
  """The first line of the innermost cause of a failed read, shortened: Orbax and TensorStore
  wrap the cause (e.g. `OUT_OF_RANGE: Error reading ...`) in a TensorStore spec of a hundred
  lines."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = f"{type(error).__name__}: {lines[0] if lines else ''}"
  return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."
