"""Pre-tokenized corpora: documents packed into fixed-length sequences in ArrayRecord shards.

Storage format (written by `lalte-prepare-data` (`lalte_jax/data/prepare.py`), read by `PretokenizedSource`): a directory with
- shards `<prefix>-NNNNN.array_record`: one record = one sequence of `seq_len` token ids stored as
  little-endian int32 bytes (`seq_len * 4` bytes), written with `group_size:1` so each record is
  read on its own (random access for Grain's global shuffle), zstd-compressed;
- `metadata.json`, written last (a directory without it is an unfinished write): `format`,
  `seq_len`, `vocab_size`, `bos_id`, `eos_id`, `tokenizer` (its name), `tokenizer_file`
  (`tokenizer.json` beside the shards, or null), the training split's `num_sequences`,
  `num_documents`, `num_tokens` (BOS included), `num_dropped_tokens`, `num_bytes` (UTF-8 bytes of
  its documents) and `shards` ([{"path": file name, "num_sequences": n}]), optionally a
  `validation` split with the same fields (see `lalte_jax/data/heldout.py`), and the input files.
- `tokenizer.json` (+ `tokenizer_config.json`) when the tokenizer is a HF one.

Packing follows §8.2: each document is tokenized on its own, BOS prepended, no EOS;
the documents of a split are concatenated into one stream in input order, cut into consecutive
`seq_len` sequences, and the incomplete tail is dropped. No document masking: sequences cross
documents (never splits).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, Sequence

import numpy as np

METADATA_FILENAME = "metadata.json"
FORMAT_NAME = "lalte-array_record-int32le-v1"
TOKEN_DTYPE = np.dtype("<i4")
_WRITER_OPTIONS = "group_size:1,zstd:3"


class SequencePacker:
  """Streams documents into fixed-length sequences: BOS + document ids, concatenated, cut."""

  def __init__(self, seq_len: int, bos_id: int):
    if seq_len <= 0:
      raise ValueError(f"seq_len must be positive, got {seq_len}")
    self.seq_len = seq_len
    self.bos_id = bos_id
    self._pending: list[np.ndarray] = []  # pieces of the not-yet-full sequence
    self._pending_len = 0
    self.num_documents = 0
    self.num_tokens = 0  # tokens fed in, BOS included

  def add_document(self, token_ids: Sequence[int]) -> list[np.ndarray]:
    """Appends one document; returns the sequences (int32 [seq_len]) it completed."""
    document = np.concatenate([[self.bos_id], np.asarray(token_ids, dtype=np.int64)])
    self.num_documents += 1
    self.num_tokens += len(document)
    completed = []
    while len(document):
      take = min(self.seq_len - self._pending_len, len(document))
      self._pending.append(document[:take])
      self._pending_len += take
      document = document[take:]
      if self._pending_len == self.seq_len:
        completed.append(np.concatenate(self._pending).astype(TOKEN_DTYPE))
        self._pending, self._pending_len = [], 0
    return completed

  @property
  def num_dropped_tokens(self) -> int:
    """Tokens of the incomplete last sequence, dropped when packing ends."""
    return self._pending_len


class ShardWriter:
  """Writes int32 sequences into ArrayRecord shards of at most `sequences_per_shard` records."""

  def __init__(self, output_dir: str | os.PathLike, seq_len: int, *, sequences_per_shard: int,
               prefix: str = "train"):
    if sequences_per_shard <= 0:
      raise ValueError(f"sequences_per_shard must be positive, got {sequences_per_shard}")
    self.output_dir = pathlib.Path(output_dir)
    self.seq_len = seq_len
    self.sequences_per_shard = sequences_per_shard
    self.prefix = prefix
    self.shards: list[dict] = []  # [{"path": file name, "num_sequences": n}] of closed shards
    self._writer = None
    self._in_shard = 0

  def write(self, sequence: np.ndarray) -> None:
    sequence = np.asarray(sequence)
    if sequence.shape != (self.seq_len,):
      raise ValueError(f"sequence shape {sequence.shape} != ({self.seq_len},)")
    if self._writer is None:
      self._open_next_shard()
    self._writer.write(sequence.astype(TOKEN_DTYPE).tobytes())
    self._in_shard += 1
    if self._in_shard == self.sequences_per_shard:
      self._close_shard()

  def close(self) -> list[dict]:
    if self._writer is not None:
      self._close_shard()
    return self.shards

  def _open_next_shard(self) -> None:
    from array_record.python import array_record_module  # pylint: disable=import-outside-toplevel
    name = f"{self.prefix}-{len(self.shards):05d}.array_record"
    self._writer = array_record_module.ArrayRecordWriter(str(self.output_dir / name),
                                                         _WRITER_OPTIONS)
    self.shards.append({"path": name, "num_sequences": 0})
    self._in_shard = 0

  def _close_shard(self) -> None:
    self._writer.close()
    self.shards[-1]["num_sequences"] = self._in_shard
    self._writer = None

  def __enter__(self) -> "ShardWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def write_metadata(output_dir: str | os.PathLike, metadata: dict) -> None:
  """Writes metadata.json atomically (rename), so readers never see a half-written file."""
  path = pathlib.Path(output_dir) / METADATA_FILENAME
  temporary = path.with_suffix(".json.tmp")
  temporary.write_text(json.dumps({"format": FORMAT_NAME, **metadata}, indent=2) + "\n",
                       encoding="utf-8")
  os.replace(temporary, path)


def read_metadata(directory: str | os.PathLike) -> dict:
  path = pathlib.Path(directory) / METADATA_FILENAME
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: {directory} is not a prepared corpus (or its"
                            " preparation did not finish); run lalte-prepare-data")
  metadata = json.loads(path.read_text(encoding="utf-8"))
  if metadata.get("format") != FORMAT_NAME:
    raise ValueError(f"{path}: format {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
  return metadata


SPLITS = ("train", "validation")


class PretokenizedSource:
  """Random access over one split of a prepared corpus: element i = {"tokens": int32 [seq_len]}.

  `split` "train" reads the shards metadata.json lists at its top level (every sequence of a
  corpus prepared without a validation split), "validation" those under its "validation" key;
  `shards` (a slice of that shard list) keeps only some of them. Indices run over the shards in
  the order metadata.json lists them. Picklable (Grain workers).
  """

  def __init__(self, directory: str | os.PathLike, *, split: str = "train",
               shards: slice = slice(None)):
    import grain  # pylint: disable=import-outside-toplevel
    self.directory = pathlib.Path(directory)
    metadata = read_metadata(self.directory)
    if split not in SPLITS:
      raise ValueError(f"split: {split!r} is not one of {SPLITS}")
    if split == "validation" and "validation" not in metadata:
      raise ValueError(f"{self.directory} has no validation split (prepare it with"
                       " lalte-prepare-data --val-fraction F)")
    self.split, self.shards = split, shards
    split_metadata = metadata[split] if split == "validation" else metadata
    self.seq_len: int = metadata["seq_len"]
    self.vocab_size: int = metadata["vocab_size"]
    self.bos_id: int | None = metadata.get("bos_id")
    self.metadata = metadata
    # Mean UTF-8 bytes per token of the split (BOS counts as a token of no bytes), for bits per
    # byte; None for corpora prepared before the byte counts were recorded.
    num_bytes = split_metadata.get("num_bytes")
    self.bytes_per_token: float | None = (None if num_bytes is None else
                                          num_bytes / split_metadata["num_tokens"])
    listed = split_metadata["shards"][shards]
    paths = [str(self.directory / shard["path"]) for shard in listed]
    missing = [path for path in paths if not os.path.isfile(path)]
    if missing:
      raise FileNotFoundError(f"{self.directory}: shards listed in {METADATA_FILENAME} are missing:"
                              f" {missing}")
    self._records = grain.sources.ArrayRecordDataSource(paths) if paths else []
    expected = sum(shard["num_sequences"] for shard in listed)
    if len(self._records) != expected:
      raise ValueError(f"{self.directory}: shards hold {len(self._records)} records but"
                       f" {METADATA_FILENAME} lists {expected} for them")

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    record = self._records[index]
    tokens = np.frombuffer(record, dtype=TOKEN_DTYPE)
    if tokens.shape != (self.seq_len,):
      raise ValueError(f"{self!r}: record {index} holds {len(record)} bytes, expected"
                       f" {self.seq_len} int32 tokens ({self.seq_len * 4} bytes)")
    return {"tokens": tokens.astype(np.int32)}  # native int32 and writable (frombuffer is not)

  def __repr__(self) -> str:
    where = "" if self.split == "train" else f", split={self.split!r}"
    if self.shards != slice(None):
      start, stop = ("" if end is None else end for end in (self.shards.start, self.shards.stop))
      where += f", shards[{start}:{stop}]"
    return f"PretokenizedSource({str(self.directory)!r}{where})"


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int, bos_id: int) -> np.ndarray:
  """All packed sequences of `documents` as int32 [N, seq_len] (in memory; for tests and tiny
  corpora — the CLI streams through `SequencePacker` instead)."""
  packer = SequencePacker(seq_len, bos_id)
  sequences = [sequence for document in documents for sequence in packer.add_document(document)]
  return np.stack(sequences) if sequences else np.zeros((0, seq_len), np.int32)
