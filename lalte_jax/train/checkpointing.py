"""Training checkpoints: the train state, the data position and the config, saved together per step.

Layout: `<run_dir>/checkpoints/<step>/` with three items, written by one Orbax `CheckpointManager`:
- `state/`: the whole TrainState (float32 master weights, AdamW moments and count, step, rng,
  LTE controller lambda and EMA, skip counters), each process writing its own shards;
- `data/`: the Grain iterator state of every process (`process_<i>-of-<n>.json`);
- `config/`: the TrainConfig as JSON, for provenance (written by process 0 only).

Saves are asynchronous (the device-to-host copy blocks, the file writes run in the background)
and atomic: Orbax writes into `<step>.orbax-checkpoint-tmp-<n>` and renames it when every item
is complete, so a save killed half-way leaves a temporary directory that listing and restoring
never see (and that the next start deletes). Resuming picks the newest complete step.

Restoring never assumes the saved layout: the state is read onto abstract arrays that carry the
current mesh's shardings (`restore(abstract_state)` with `ShapeDtypeStruct(..., sharding=...)`),
so a run can continue on another number of devices or another mesh. The data position is the same
on every process (global step k reads elements [kG, (k+1)G) of one stream, see
`lalte_jax.data.pipeline`), so it also restores onto another number of processes.

Stopping: `StopSignals` turns SIGTERM (and SIGINT) into a flag that the run loop reads after each
step; the loop then saves at that step, waits for the write and exits 0 (we do not rely on
Orbax's preemption hook, which needs the JAX coordination service).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import signal
import threading

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
STATE_ITEM, DATA_ITEM, CONFIG_ITEM = "state", "data", "config"


class _IteratorSnapshot:
  """The iterator position at save time, for Grain's handler: later `next()` calls cannot leak
  into a save that finishes later. Grain writes what `get_state()` returns; for objects that are
  not a `DatasetIterator` it expects JSON bytes (as its DataLoader iterator gives)."""

  def __init__(self, iterator: grain.DatasetIterator):
    self._state_json = json.dumps(iterator.get_state(), indent=2).encode()

  def get_state(self) -> bytes:
    return self._state_json


class RunCheckpoints:
  """Saves and restores (TrainState, data iterator) under `directory`, keeping the newest `keep`.

  Every process must construct it and call `save`/`restore` with the same steps: Orbax
  coordinates the processes, each writes its own array shards and data state, process 0 the rest.
  """

  def __init__(self, directory: str | pathlib.Path, *, keep: int, config_json: dict | None = None,
               async_save: bool = True, read_only: bool = False):
    """`read_only` (for readers such as the export while the run may still be training): never
    creates, deletes or cleans anything, so a save in flight elsewhere is left alone."""
    if keep <= 0:
      raise ValueError(f"RunCheckpoints: keep must be positive, got {keep}")
    self.directory = pathlib.Path(directory).absolute()
    self.config_json = config_json
    self.read_only = read_only
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, create=not read_only,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only)  # removes what a killed save left behind
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._last_saved_step = None

  @classmethod
  def for_run(cls, config) -> RunCheckpoints:
    """The checkpoints of the run `config` (a TrainConfig) in `<run_dir>/checkpoints`."""
    return cls(pathlib.Path(config.run_dir) / CHECKPOINT_DIR, keep=config.checkpoint_keep,
               config_json=json.loads(json.dumps(dataclasses.asdict(config))))

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, data_iterator: grain.DatasetIterator | None = None, *,
           wait: bool = False) -> bool:
    """Starts saving `state` (a pytree of jax.Arrays) and the iterator position as `step`;
    returns False when `step` is already saved. `wait=True` blocks until it is on disk."""
    if self.read_only:
      raise ValueError(f"checkpoints: {self.directory} was opened read-only")
    if step == self._last_saved_step or step in self.manager.all_steps():
      if wait:
        self.wait()
      return False
    items = {STATE_ITEM: ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items[DATA_ITEM] = grain.checkpoint.CheckpointSave(_IteratorSnapshot(data_iterator))
    if self.config_json is not None:
      items[CONFIG_ITEM] = ocp.args.JsonSave(self.config_json)
    saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._last_saved_step = step  # may still be in flight, so not yet in all_steps()
    if wait:
      self.wait()
    return saved

  def restore(self, abstract_state, data_iterator: grain.DatasetIterator | None = None, *,
              step: int | None = None):
    """The state saved at `step` (default: the newest complete one), laid out as
    `abstract_state` says (a pytree of jax.ShapeDtypeStruct with `sharding=`, or arrays), and
    `data_iterator` moved to the saved position. Raises FileNotFoundError without checkpoints."""
    step = self.latest_step() if step is None else step
    if step is None or step not in self.manager.all_steps():
      raise FileNotFoundError(f"checkpoints: no complete checkpoint"
                              f"{'' if step is None else f' of step {step}'} in {self.directory}"
                              f" (have {self.all_steps()})")
    restored = self.manager.restore(
        step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)}))
    if data_iterator is not None:
      data_iterator.set_state(self._data_state(step))
    return restored[STATE_ITEM]

  def restore_config(self, step: int):
    """The TrainConfig saved with `step` (ValueError if it has none or it no longer validates)."""
    from lalte_jax.train.config import config_from_dict  # pylint: disable=import-outside-toplevel
    restored = self.manager.restore(
        step, args=ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))
    if restored[CONFIG_ITEM] is None:
      raise ValueError(f"checkpoints: step {step} in {self.directory} has no config")
    return config_from_dict(restored[CONFIG_ITEM])

  def _data_state(self, step: int) -> dict:
    """This process's saved iterator state. Another process count is fine when every process
    saved the same state (the stream position is global); otherwise it is an error."""
    folder = self.directory / str(step) / DATA_ITEM
    index, count = jax.process_index(), jax.process_count()
    own = folder / f"process_{index}-of-{count}.json"
    if own.is_file():
      return json.loads(own.read_text())
    states = [json.loads(path.read_text()) for path in sorted(folder.glob("process_*.json"))]
    if not states:
      raise FileNotFoundError(f"checkpoints: step {step} in {self.directory} has no data"
                              " iterator state")
    if any(state != states[0] for state in states):
      raise ValueError(f"checkpoints: step {step} was saved by another number of processes with"
                       f" differing data positions; cannot restore on {count} process(es)")
    return states[0]

  def wait(self) -> None:
    """Blocks until every started save is on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(state_shapes, shardings):
  """ShapeDtypeStructs of `state_shapes` carrying `shardings` (restore targets on this mesh)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state_shapes, shardings)


class StopSignals:
  """While active (`with StopSignals():`), SIGTERM and SIGINT set `requested` instead of killing
  the process; a second SIGINT interrupts as usual. Outside the main thread (where Python cannot
  install handlers) it does nothing. `stop_now()` agrees over all processes."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self.signal_name = None
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.requested = True
    self.signal_name = signal.Signals(signum).name

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def stop_now(self, step: int = 0, check_every: int = 1) -> bool:
    """Whether to stop after `step`. With several processes a signal may reach them at
    different steps, so they agree (any process asked -> all stop) through a tiny all-gather,
    which waits for the step in flight; they do so only at steps divisible by `check_every`,
    the same steps everywhere, so that the other steps keep dispatching ahead."""
    if jax.process_count() == 1:
      return self.requested
    if step % check_every:
      return False
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
    return bool(np.any(flags))
