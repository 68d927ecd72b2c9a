"""The input pipeline: a random-access source -> deterministic, checkpointable, per-process batches.

`make_dataset` builds a Grain `MapDataset` pipeline and returns its iterator (a
`grain.DatasetIterator`), whose `get_state()` (a small JSON-able dict) and `set_state(state)` save
and restore the position exactly; Orbax saves it through Grain's `grain.checkpoint` handlers.

Order of elements. With G = `batch_size_per_process * process_count` (the global batch), the
source is shuffled globally with `seed` (reshuffled each epoch by Grain from `seed + epoch`),
repeated `num_epochs` times (forever when None), cut to whole global batches, and then element `g`
of that global stream goes to process `g % process_count`. So global step k holds elements
`[k*G, (k+1)*G)` of one stream that does not depend on how many processes read it, every process
gets the same number of batches, and within an epoch the process shards are disjoint and together
cover the source (up to the < G elements dropped at the end when `num_epochs` is finite).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from lalte_jax.data.synthetic import IGNORE_LABEL


@dataclasses.dataclass(frozen=True)
class _CheckTokenIds(grain.transforms.MapWithIndex):
  """Turns an element into {"tokens", ["labels"]} int32 arrays and checks its ids (the data
  boundary: an id >= the model's vocabulary would index past the embedding table silently)."""
  vocab_size: int
  source_name: str
  source_len: int

  def map_with_index(self, index: int, element):
    if not isinstance(element, dict):
      element = {"tokens": element}
    # Upstream of the shuffle the index counts through epochs; the record is index % len.
    where = f"record {index % self.source_len} of {self.source_name}"
    if "tokens" not in element:
      raise ValueError(f"{where} has no 'tokens' field (fields: {sorted(element)})")
    batch = {"tokens": _as_int32(element["tokens"], "tokens", where)}
    _check_range(batch["tokens"], self.vocab_size, "token", where)
    if "labels" in element:
      batch["labels"] = _as_int32(element["labels"], "labels", where)
      _check_range(batch["labels"][batch["labels"] != IGNORE_LABEL], self.vocab_size, "label",
                   where)
    return batch


def _as_int32(ids, field: str, where: str) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{where}: {field} must be a 1-D integer array, got {ids.dtype} {ids.shape}")
  return ids.astype(np.int32, copy=False)


def _check_range(ids: np.ndarray, vocab_size: int, kind: str, where: str) -> None:
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    position = int(np.flatnonzero(bad)[0])
    raise ValueError(f"{where}: {kind} id {int(ids[position])} is outside the vocabulary"
                     f" [0, {vocab_size})")


def make_dataset(source, *, batch_size_per_process: int, seed: int, shuffle: bool,
                 process_index: int, process_count: int, num_epochs: int | None = None,
                 vocab_size: int | None = None, drop_remainder: bool = True,
                 num_threads: int = 2, prefetch_batches: int = 4) -> grain.DatasetIterator:
  """This process's batches of `source`, as an iterator with `get_state()/set_state()`.

  Args:
    source: a random-access source (`__len__`, `__getitem__`) whose elements are dicts with
      "tokens" (and optionally "labels", see `synthetic.py` for their meaning) or bare token arrays;
      all of one length T.
    batch_size_per_process: rows per batch on this process.
    seed: shuffle seed in [0, 2**32).
    shuffle: shuffle globally (each epoch differently); False keeps source order.
    process_index, process_count: this process and how many read the data (normally
      `jax.process_index()`, `jax.process_count()`).
    num_epochs: passes over the source; None repeats forever.
    vocab_size: ids must lie in [0, vocab_size); defaults to `source.vocab_size`. An id outside
      raises ValueError naming the id, the record and the source.
    drop_remainder: with a finite `num_epochs`, drop the last incomplete global batch (required
      with several processes, so that all of them step together); False keeps it on one process.
    num_threads, prefetch_batches: Grain read threads and batches read ahead; order and state do
      not depend on them.

  Yields:
    {"tokens": int32 [B, T], "labels": int32 [B, T] (when the source has labels)} numpy arrays.
  """
  if vocab_size is None:
    vocab_size = getattr(source, "vocab_size", None)
    if vocab_size is None:
      raise ValueError(f"pass vocab_size: {source!r} has no vocab_size attribute")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} must lie in"
                     f" [0, process_count={process_count})")
  if batch_size_per_process <= 0:
    raise ValueError(f"batch_size_per_process must be positive, got {batch_size_per_process}")
  if num_epochs is not None and num_epochs <= 0:
    raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
  if not drop_remainder and process_count > 1:
    raise ValueError("drop_remainder=False would give processes different numbers of batches")
  if len(source) == 0:
    raise ValueError(f"{source!r} is empty")

  dataset = grain.MapDataset.source(source).map_with_index(
      _CheckTokenIds(vocab_size, repr(source), len(source)))
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  dataset = dataset.repeat(num_epochs)
  global_batch = batch_size_per_process * process_count
  if num_epochs is not None and drop_remainder:
    num_global_batches = len(dataset) // global_batch
    if num_global_batches == 0:
      raise ValueError(f"{len(source)} examples x {num_epochs} epochs make no global batch of"
                       f" {global_batch} ({batch_size_per_process} x {process_count} processes)")
    dataset = dataset[:num_global_batches * global_batch]
  # Process p reads rows [p*b, (p+1)*b) of each global batch: the processes' rows stacked in
  # process order are the one-process batch, so the training step needs no reordering and
  # compiles to the same program on any number of processes.
  dataset = dataset.batch(batch_size_per_process, drop_remainder=drop_remainder)
  dataset = dataset[process_index::process_count]
  read_options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_batches)
  return iter(dataset.to_iter_dataset(read_options))
