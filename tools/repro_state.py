"""Packs a study directory of tools/repro.py into a few small files, and unpacks it elsewhere.

    python tools/repro_state.py pack runs/capacity state/study.tar.gz [--part-mib 15 --max-parts 5]
    python tools/repro_state.py unpack state/study.tar.gz runs/capacity

`pack` writes one gzip-compressed tar cut into parts `<dest>.00of03`, `<dest>.01of03`, ... (the part
and the number of parts) of at most `--part-mib` MiB each. It holds what a later `tools/repro.py`
invocation needs: every file of every run except its exported parameters (`export/`), the
checkpoints of unfinished runs only (finished runs need none), and the study's results and figures.
When the unfinished runs' checkpoints do not all fit in `--max-parts` parts, those of the least
advanced runs are left out (named on stdout): such a run starts again from step 0. `unpack` joins
the parts of the newest complete set in order and extracts them into a study directory.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tarfile
import zlib

RUNS_DIR, RECORDS_FILE = "runs", "records.json"
CHECKPOINT_DIR, EXPORT_DIR = "checkpoints", "export"
MIB = 1 << 20


class _PartWriter:
  """A write-only file that cuts its bytes into parts of `size`; `close` names them
  `<prefix>.<i>of<n>`."""

  def __init__(self, prefix: pathlib.Path, size: int):
    self.prefix, self.size = prefix, size
    self.paths: list[pathlib.Path] = []
    self._file, self._written = None, 0

  def write(self, data: bytes) -> int:
    view = memoryview(data)
    while view:
      if self._file is None or self._written == self.size:
        self._next()
      take = min(len(view), self.size - self._written)
      self._file.write(view[:take])
      self._written += take
      view = view[take:]
    return len(data)

  def _next(self) -> None:
    if self._file is not None:
      self._file.close()
    path = self.prefix.with_name(f"{self.prefix.name}.{len(self.paths):02d}.partial")
    self.paths.append(path)
    self._file, self._written = path.open("wb"), 0

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    count = len(self.paths)
    self.paths = [path.rename(self.prefix.with_name(f"{self.prefix.name}.{i:02d}of{count:02d}"))
                  for i, path in enumerate(self.paths)]


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in directory.rglob("*") if p.is_file())


TAR_HEADER = 512  # bytes a tar archive spends per member before its data


def _packed_size(paths) -> int:
  """About what `paths` add to the gzip-compressed tar: each file's zlib-compressed size plus its
  header (metrics logs shrink ~5x, checkpoints of float32 state hardly at all)."""
  total = 0
  for path in paths:
    compressor, size = zlib.compressobj(6), TAR_HEADER
    with path.open("rb") as file:
      while chunk := file.read(MIB):
        size += len(compressor.compress(chunk))
    total += size + len(compressor.flush())
  return total


def checkpoint_step(run: pathlib.Path) -> int:
  """The step of the newest finished checkpoint in run directory `run`, or -1."""
  steps = [int(p.name) for p in (run / CHECKPOINT_DIR).glob("*") if re.fullmatch(r"\d+", p.name)]
  return max(steps, default=-1)


def select_files(study: pathlib.Path, max_bytes: int) -> tuple[list[pathlib.Path], list[str]]:
  """(the files to pack, the unfinished runs whose checkpoints do not fit `max_bytes`)."""
  small, unfinished = [], []
  for path in _files(study):
    parts = path.relative_to(study).parts
    if len(parts) > 2 and parts[0] == RUNS_DIR and parts[2] in (CHECKPOINT_DIR, EXPORT_DIR):
      continue
    small.append(path)
  for run in sorted((study / RUNS_DIR).glob("*")):
    if run.is_dir() and not (run / RECORDS_FILE).is_file() and checkpoint_step(run) >= 0:
      unfinished.append(run)
  unfinished.sort(key=checkpoint_step, reverse=True)  # the most advanced first
  chosen, left_out, total = list(small), [], _packed_size(small)
  for run in unfinished:
    step = run / CHECKPOINT_DIR / str(checkpoint_step(run))
    files = _files(step)
    size = _packed_size(files)
    if total + size > max_bytes:
      left_out.append(run.name)
      continue
    chosen += files
    total += size
  return chosen, left_out


def pack(study: pathlib.Path, dest: pathlib.Path, part_mib: float, max_parts: int) -> list:
  part_size = int(part_mib * MIB)
  files, left_out = select_files(study, part_size * max_parts)
  dest.parent.mkdir(parents=True, exist_ok=True)
  for stale in dest.parent.glob(f"{dest.name}.[0-9][0-9]*"):
    stale.unlink()
  writer = _PartWriter(dest, part_size)
  with tarfile.open(fileobj=writer, mode="w|gz") as archive:
    for path in files:
      archive.add(path, arcname=str(path.relative_to(study)))
  writer.close()
  print(f"packed {len(files)} files of {study} into {len(writer.paths)} parts ({dest}.NNofMM)")
  for name in left_out:
    print(f"left out the checkpoint of {name} (it will start again from step 0)")
  return writer.paths


class _PartReader:
  """The parts `<prefix>.00`, `<prefix>.01`, ... read as one stream."""

  def __init__(self, paths):
    self.paths, self._file = list(paths), None

  def read(self, size: int = -1) -> bytes:
    chunks = []
    while size != 0:
      if self._file is None:
        if not self.paths:
          break
        self._file = self.paths.pop(0).open("rb")
      data = self._file.read(size)
      if not data:
        self._file.close()
        self._file = None
        continue
      chunks.append(data)
      size = size - len(data) if size > 0 else size
    return b"".join(chunks)


def complete_parts(source: pathlib.Path) -> list[pathlib.Path]:
  """The parts `<source>.<i>of<n>` of the newest complete set, in order ([] when none)."""
  sets: dict[int, dict[int, pathlib.Path]] = {}
  for path in source.parent.glob(f"{source.name}.*of*"):
    match = re.fullmatch(r"(\d+)of(\d+)", path.name[len(source.name) + 1:])
    if match:
      sets.setdefault(int(match[2]), {})[int(match[1])] = path
  complete = [[parts[i] for i in range(count)] for count, parts in sets.items()
              if set(parts) == set(range(count))]
  return max(complete, key=lambda parts: min(p.stat().st_mtime for p in parts), default=[])


def unpack(source: pathlib.Path, study: pathlib.Path) -> int:
  parts = complete_parts(source)
  if not parts:
    raise FileNotFoundError(f"no complete set of parts {source}.NNofMM")
  study.mkdir(parents=True, exist_ok=True)
  with tarfile.open(fileobj=_PartReader(parts), mode="r|gz") as archive:
    archive.extractall(study, filter="data")
  print(f"unpacked {len(parts)} parts of {source} into {study}")
  return len(parts)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  commands = parser.add_subparsers(dest="command", required=True)
  pack_parser = commands.add_parser("pack", help="study directory -> parts")
  pack_parser.add_argument("study")
  pack_parser.add_argument("dest", help="path prefix of the parts (<dest>.00of03, ...)")
  pack_parser.add_argument("--part-mib", type=float, default=15.0)
  pack_parser.add_argument("--max-parts", type=int, default=5)
  unpack_parser = commands.add_parser("unpack", help="parts -> study directory")
  unpack_parser.add_argument("source", help="path prefix of the parts")
  unpack_parser.add_argument("study")
  args = parser.parse_args(argv)
  try:
    if args.command == "pack":
      if not (pathlib.Path(args.study) / RUNS_DIR).is_dir():
        raise FileNotFoundError(f"{args.study} holds no {RUNS_DIR}/ directory")
      pack(pathlib.Path(args.study), pathlib.Path(args.dest), args.part_mib, args.max_parts)
    else:
      unpack(pathlib.Path(args.source), pathlib.Path(args.study))
  except (FileNotFoundError, tarfile.TarError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
