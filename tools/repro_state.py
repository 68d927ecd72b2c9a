"""Packs a study directory of tools/repro.py into a few small files, and unpacks it elsewhere.

    python tools/repro_state.py pack runs/capacity state/study.tar.gz [--part-mib 15 --max-parts 5]
    python tools/repro_state.py unpack state/study.tar.gz runs/capacity
    python tools/repro_state.py restore docs/data/capacity_48k runs/capacity

`pack` writes one gzip-compressed tar cut into parts `<dest>.00of03`, `<dest>.01of03`, ... (the part
and the number of parts) of at most `--part-mib` MiB each. It holds what a later `tools/repro.py`
invocation needs: every file of every run except its exported parameters (`export/`), the
checkpoints of unfinished runs only (finished runs need none), and the study's results and figures.
When the unfinished runs' checkpoints do not all fit in `--max-parts` parts, those of the least
advanced runs are left out (named on stdout): such a run starts again from step 0. `unpack` joins
the parts of the newest complete set in order and extracts them into a study directory.
`restore` rebuilds the finished runs of a study's published data (results.json and
trajectories.json, e.g. docs/data/capacity_48k) in a study directory, so that new runs can be
reported together with them: each gets its records (marked "restored", with their published
milestones), its run.json and, as its metrics.jsonl, its published trajectory.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil
import sys
import tarfile
import zlib

RUNS_DIR, RECORDS_FILE = "runs", "records.json"
RESULTS_FILE, TRAJECTORIES_FILE, METRICS_FILE = "results.json", "trajectories.json", "metrics.jsonl"
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


def _published(data: pathlib.Path, name: str) -> dict:
  path = data / name
  if not path.is_file():
    raise FileNotFoundError(f"{path} does not exist: {data} is not a study's published data")
  return json.loads(path.read_text())


# What the report ("milestones") and `restore` add to a run's records: the records.json of the
# study that was published lacks both, yet holds the same run.
_ADDED_FIELDS = ("milestones", "restored")


def _as_run_wrote(record: dict) -> dict:
  return {key: value for key, value in record.items() if key not in _ADDED_FIELDS}


def _same_records(directory: pathlib.Path, record: dict) -> bool:
  """Whether run directory `directory` holds the records of `record` (restored or not)."""
  try:
    stored = json.loads((directory / RECORDS_FILE).read_text())
  except (OSError, ValueError):  # no records (an unfinished run) or unreadable ones
    return False
  return isinstance(stored, dict) and _as_run_wrote(stored) == _as_run_wrote(record)


def restore(data: pathlib.Path, study: pathlib.Path) -> list[str]:
  """Rebuilds in `study` every finished run of the published data `data` (its results.json and
  trajectories.json): `runs/<name>/records.json` (the published record, milestones included,
  with "restored": true), run.json and, when the run has a trajectory, metrics.jsonl holding its
  rows. A run directory that exists already is skipped when it holds the same records, and is an
  error otherwise (checked before anything is written). Returns the names of the restored runs."""
  # Lazily: the report and the run's writer import JAX, which pack and unpack do not need.
  import repro_report  # pylint: disable=import-outside-toplevel
  import repro_run  # pylint: disable=import-outside-toplevel
  records = _published(data, RESULTS_FILE)["runs"]
  curves = _published(data, TRAJECTORIES_FILE)["runs"]
  runs = study / RUNS_DIR
  todo, conflicts = [], []
  for record in records:
    directory = runs / record["name"]
    if not directory.exists():
      todo.append(record)
    elif _same_records(directory, record):
      print(f"skipped {record['name']}: {directory} holds these records already")
    else:
      conflicts.append(str(directory))
  if conflicts:
    raise FileExistsError(f"not overwritten, since they hold another run or an unfinished one,"
                          f" not the records of {data / RESULTS_FILE}: {', '.join(conflicts)}")
  for record in todo:
    name = record["name"]
    # Built under a temporary name, then renamed: a restore cut short leaves no run directory
    # that a later restore would take for a real run.
    partial = runs / f".{name}.restore"
    shutil.rmtree(partial, ignore_errors=True)
    repro_run.write_spec(partial, repro_report.record_spec(record),
                         bool(record.get("smoke", False)))
    rows = curves.get(name)
    if rows:
      (partial / METRICS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
      print(f"{name}: no published trajectory, so no {METRICS_FILE}")
    (partial / RECORDS_FILE).write_text(json.dumps(dict(record, restored=True), indent=2) + "\n")
    partial.rename(runs / name)
  finished = {record["name"] for record in records}
  unfinished = sorted(name for name in curves if name not in finished)
  if unfinished:
    print(f"not restored, unfinished (not in {RESULTS_FILE}): {', '.join(unfinished)}")
  print(f"restored {len(todo)} of the {len(records)} finished runs of {data} into {runs}")
  return [record["name"] for record in todo]


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
  restore_parser = commands.add_parser("restore", help="published data -> finished runs")
  restore_parser.add_argument("data", help=f"directory of a study's {RESULTS_FILE} and"
                                           f" {TRAJECTORIES_FILE}")
  restore_parser.add_argument("study")
  args = parser.parse_args(argv)
  try:
    if args.command == "pack":
      if not (pathlib.Path(args.study) / RUNS_DIR).is_dir():
        raise FileNotFoundError(f"{args.study} holds no {RUNS_DIR}/ directory")
      pack(pathlib.Path(args.study), pathlib.Path(args.dest), args.part_mib, args.max_parts)
    elif args.command == "unpack":
      unpack(pathlib.Path(args.source), pathlib.Path(args.study))
    else:
      restore(pathlib.Path(args.data), pathlib.Path(args.study))
  except (FileNotFoundError, FileExistsError, tarfile.TarError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
