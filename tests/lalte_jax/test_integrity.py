"""The checksum record of saved directories (`lalte_jax.integrity`): what it catches, what it
leaves out, and how processes share the verification."""

import json

import pytest

from lalte_jax import integrity


def _saved(tmp_path):
  """A directory shaped like a checkpoint: item folders with files, and top-level files."""
  root = tmp_path / "saved"
  for name, size in (("state/d/a", 4000), ("state/d/b", 3000), ("state/_METADATA", 200),
                     ("data/process_0-of-1.json", 50)):
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
  (root / "_CHECKPOINT_METADATA").write_text("{}")
  integrity.write_record(root)
  return root


def test_record_covers_the_subfolders_and_verifies(tmp_path):
  root = _saved(tmp_path)
  files = json.loads((root / integrity.RECORD_FILE).read_text())["files"]
  assert sorted(files) == ["data/process_0-of-1.json", "state/_METADATA", "state/d/a",
                           "state/d/b"]
  assert files["state/d/a"][0] == 4000
  assert integrity.verify(root) is None
  (root / "_CHECKPOINT_METADATA").write_text('{"commit_timestamp_nsecs": 1}')  # updated later
  assert integrity.verify(root) is None
  (root / integrity.RECORD_FILE).unlink()  # saved before records existed: reading decides
  assert integrity.verify(root) is None


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "state/d/a has 2000 bytes, 4000 were written"),
    ("overwrite", "state/d/a differs from what was written (CRC32)"),
    ("delete", "state/d/a is missing"),
    ("record", "checksums.json is unreadable"),
])
def test_damage_is_named(tmp_path, damage, reason):
  root = _saved(tmp_path)
  target = root / "state" / "d" / "a"
  data = bytearray(target.read_bytes())
  if damage == "truncate":
    target.write_bytes(data[:2000])
  elif damage == "overwrite":  # same size: only the CRC tells
    data[1000:1016] = b"\xa5" * 16
    target.write_bytes(bytes(data))
  elif damage == "delete":
    target.unlink()
  else:
    (root / integrity.RECORD_FILE).write_text('{"files": {"state/d/a": [1')
  assert integrity.verify(root) == reason


def test_processes_share_the_files(tmp_path):
  root = _saved(tmp_path)
  (root / "state" / "d" / "b").write_bytes(b"")
  found = [integrity.verify(root, part=part, parts=3) for part in range(3)]
  assert found.count(None) == 2 and "state/d/b has 0 bytes, 3000 were written" in found


def test_read_error_reason_is_the_innermost_first_line():
  try:
    try:
      raise ValueError('OUT_OF_RANGE: Error reading "x"\nmore detail')
    except ValueError as cause:
      raise RuntimeError("Encountered error while reading\n" + "spec\n" * 100) from cause
  except RuntimeError as error:
    assert integrity.read_error_reason(error) == 'ValueError: OUT_OF_RANGE: Error reading "x"'
  assert len(integrity.read_error_reason(ValueError("y" * 500))) == 200
