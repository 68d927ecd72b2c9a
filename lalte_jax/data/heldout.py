"""Training and validation data of a prepared corpus that never share a document.

Packing concatenates documents across sequences, so a split by sequence would cut documents in
two. `lalte-prepare-data --val-fraction F` therefore splits by document before packing: document
i (0-based, in input order) is held out when `held_out_document(i, F)`, i.e. when the first 8
bytes of blake2b(i as 8 little-endian bytes), read as a little-endian integer and divided by
2**64, fall below F. The choice is deterministic, independent of the rest of the corpus and of the
tokenizer, and holds out about a fraction F of the documents. They are packed into shards of their
own (listed under "validation" in metadata.json), so no sequence mixes the two splits.

A corpus prepared without a validation split falls back to holding out whole shards: the last
one, when there are at least two (the rest is the training data; with many shards that is a
small part, with two it is half). Only the one document that may run from the last training shard
into it crosses the boundary: its tokens are not scored (labels ignored up to the first BOS of the
held-out shard). A corpus of one shard has no validation data.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from lalte_jax.data.pretokenized import PretokenizedSource, read_metadata
from lalte_jax.data.synthetic import IGNORE_LABEL

SELECTION = ("document i (0-based, input order) is held out when blake2b(i as 8 little-endian"
             " bytes, digest_size=8) as a little-endian integer / 2**64 < fraction")


def held_out_document(index: int, fraction: float) -> bool:
  """Whether document `index` belongs to the validation split of a corpus prepared with
  `--val-fraction fraction` (module doc)."""
  digest = hashlib.blake2b(int(index).to_bytes(8, "little"), digest_size=8).digest()
  return int.from_bytes(digest, "little") < fraction * 2**64


def training_source(directory: str | os.PathLike) -> PretokenizedSource:
  """The sequences to train on: the training split, without the held-out shard of the fallback."""
  metadata = read_metadata(directory)
  if "validation" not in metadata and len(metadata["shards"]) >= 2:
    return PretokenizedSource(directory, shards=slice(None, -1))
  return PretokenizedSource(directory)


def validation_source(directory: str | os.PathLike):
  """The held-out sequences (module doc), or None when the corpus has none. Elements of the
  fallback carry "labels" (next tokens, unscored ones IGNORE_LABEL); the others only "tokens"."""
  metadata = read_metadata(directory)
  if "validation" in metadata:
    return PretokenizedSource(directory, split="validation")
  if len(metadata["shards"]) >= 2:
    return FromFirstDocument(PretokenizedSource(directory, shards=slice(-1, None)))
  return None


class FromFirstDocument:
  """A packed source scored from its first BOS on: the tokens before it continue a document of
  other data. Element i = {"tokens", "labels"}, labels[t] = tokens[t+1] (IGNORE_LABEL at the last
  position and where the predicted token is the first BOS of the stream or comes before it)."""

  def __init__(self, source: PretokenizedSource):
    self.source = source
    self.seq_len, self.vocab_size = source.seq_len, source.vocab_size
    self.bytes_per_token = source.bytes_per_token
    # Stream position of the first BOS; the scan stops at the first sequence that holds one.
    self.first_bos = len(source) * source.seq_len
    for index in range(len(source)):
      positions = np.flatnonzero(source[index]["tokens"] == source.bos_id)
      if positions.size:
        self.first_bos = index * source.seq_len + int(positions[0])
        break

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index) -> dict[str, np.ndarray]:
    tokens = self.source[index]["tokens"]
    labels = np.concatenate([tokens[1:], [IGNORE_LABEL]]).astype(np.int32)
    # labels[t] predicts stream position index * T + t + 1; up to the first BOS it is the end of
    # the document that began in the training shards.
    unscored = self.first_bos - index * self.seq_len
    labels[:max(0, min(unscored, self.seq_len))] = IGNORE_LABEL
    return {"tokens": tokens, "labels": labels}

  def __repr__(self) -> str:
    return f"FromFirstDocument({self.source!r})"
