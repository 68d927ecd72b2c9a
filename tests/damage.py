"""Damage to saved directories, as a disk, an interrupted copy or a user might do it, for the
tests of what loading and resuming then do."""

import pathlib


def largest_array_file(item: pathlib.Path) -> pathlib.Path:
  """The largest OCDBT data file (`.../d/<hash>`) under an Orbax item folder."""
  return max((path for path in item.rglob("*") if path.is_file() and path.parent.name == "d"),
             key=lambda path: path.stat().st_size)


def truncate(path: pathlib.Path) -> None:
  """Keeps the first half of the file."""
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def overwrite_middle(path: pathlib.Path) -> None:
  """Overwrites 16 bytes in the middle of the file (the size stays the same)."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2:len(data) // 2 + 16] = b"\xa5" * 16
  path.write_bytes(bytes(data))
