"""Training checkpoints: the train state, the data position and the config, saved together per step.

Layout: `<run_dir>/checkpoints/<step>/` with three items, written by one Orbax `CheckpointManager`:
- `state/`: the whole TrainState (float32 master weights, AdamW moments and count, step, rng,
  LTE controller lambda and EMA, skip counters), each process writing its own shards;
- `data/`: the Grain iterator state of every process (`process_<i>-of-<n>.json`);
- `config/`: the TrainConfig as JSON, for provenance and for the model check on resume (written
  by process 0 only);
- `checksums.json`: the size and CRC32 of every file of those three (`lalte_jax.integrity`),
  written by process 0 once every process has written its files, before the commit below.

Saves are asynchronous (the device-to-host copy blocks, the file writes run in the background)
and atomic: Orbax writes into `<step>.orbax-checkpoint-tmp` (orbax-checkpoint 0.12.8) and renames
it when every item is complete, so a save killed half-way leaves a temporary directory that
listing and restoring never see (and that the next start deletes).

A complete checkpoint can still be damaged later (a truncated or overwritten file, a deleted one).
`problem(step)` finds what can be found without reading the arrays (files that differ from the
checksums, a missing or unreadable data position or config) and `restore` reports any failure to
read as `DamagedCheckpoint` (a ValueError with one line naming the step and the reason), so that
the trainer can resume from the newest intact checkpoint instead (`lalte_jax.train.resume`).

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
import shutil
import signal
import threading

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from lalte_jax import integrity

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged"  # inside CHECKPOINT_DIR; Orbax lists only folders named by a step
STATE_ITEM, DATA_ITEM, CONFIG_ITEM = "state", "data", "config"


class DamagedCheckpoint(ValueError):
  """A complete checkpoint that cannot be restored; `reason` is one line."""

  def __init__(self, directory: pathlib.Path, step: int, reason: str):
    super().__init__(f"checkpoints: step {step} in {directory} is damaged: {reason}")
    self.step, self.reason = step, reason


def any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process (a tiny all-gather when there are several)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


class _IteratorSnapshot:
  """The iterator position at save time, for Grain's handler: later `next()` calls cannot leak
  into a save that finishes later. Grain writes what `get_state()` returns; for objects that are
  not a `DatasetIterator` it expects JSON bytes (as its DataLoader iterator gives)."""

  def __init__(self, iterator: grain.DatasetIterator):
    self._state_json = json.dumps(iterator.get_state(), indent=2).encode()

  def get_state(self) -> bytes:
    return self._state_json


class RunCheckpoints:
  """Saves and restores (TrainState, data iterator) under `directory`, keeping the newest `keep`
  and, with `keep_every` > 0, every step that `keep_every` divides.

  Every process must construct it and call `save`/`restore` with the same steps: Orbax
  coordinates the processes, each writes its own array shards and data state, process 0 the rest.
  """

  def __init__(self, directory: str | pathlib.Path, *, keep: int, keep_every: int = 0,
               config_json: dict | None = None, read_only: bool = False):
    """`read_only` (for readers such as the export while the run may still be training): never
    creates, deletes or cleans anything, so a save in flight elsewhere is left alone."""
    if keep <= 0:
      raise ValueError(f"RunCheckpoints: keep must be positive, got {keep}")
    self.directory = pathlib.Path(directory).absolute()
    self.config_json = config_json
    self.read_only = read_only
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, keep_period=keep_every or None,
        create=not read_only,
        cleanup_tmp_directories=not read_only,  # removes what a killed save left behind
        async_options=ocp.AsyncOptions(post_finalization_callback=self._write_checksums))
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._last_saved_step = None
    self._checked_steps = set()  # steps whose `problem` found nothing

  @classmethod
  def for_run(cls, config) -> RunCheckpoints:
    """The checkpoints of the run `config` (a TrainConfig) in `<run_dir>/checkpoints`."""
    return cls(pathlib.Path(config.run_dir) / CHECKPOINT_DIR, keep=config.checkpoint_keep,
               keep_every=config.checkpoint_keep_every,
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
    self.manager.wait_until_finished()  # (Orbax's save waits too) the previous save's checksums
    self._last_saved_step = step  # may still be in flight, so not yet in all_steps()
    saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True)
    if wait:
      self.wait()
    return saved

  def _write_checksums(self) -> None:
    """Orbax calls this on process 0 once every process has written the checkpoint of the save
    in flight (`_last_saved_step`), before it renames the temporary directory to `<step>`, so
    that the record is committed with the files it describes."""
    step = self._last_saved_step
    # Orbax 0.12 writes into `<step>.orbax-checkpoint-tmp` (older versions added `-<time>`).
    temporary = [path for path in self.directory.glob(f"{step}.orbax-checkpoint-tmp*")
                 if path.is_dir()]
    if temporary:  # the newest, should a killed save of the same step have left one
      integrity.write_record(max(temporary, key=lambda path: path.stat().st_mtime_ns))
    else:  # storage where Orbax writes in place and commits with a marker file
      integrity.write_record(self.directory / str(step))

  def problem(self, step: int) -> str | None:
    """Why checkpoint `step` cannot be restored on this process, as far as can be told without
    reading the arrays (one short phrase), or None: files that differ from the checksums (each
    process reads its share of them), the state's tree metadata missing, this process's data
    position missing or unreadable, the config missing or unreadable when this run saves one.
    Every process makes the same Orbax calls here whatever it finds (Orbax's restore ends in a
    barrier)."""
    folder = self.directory / str(step)
    reasons = [integrity.verify(folder, part=jax.process_index(), parts=jax.process_count())]
    if not (folder / STATE_ITEM / integrity.TREE_METADATA_FILE).is_file():
      reasons.append(f"{STATE_ITEM}/{integrity.TREE_METADATA_FILE} is missing")
    for check, wanted in ((self._data_state, (folder / DATA_ITEM).is_dir()),
                          (self.restore_config, self.config_json is not None)):
      try:
        if wanted:
          check(step)
      except DamagedCheckpoint as error:
        reasons.append(error.reason)
    reason = next((reason for reason in reasons if reason is not None), None)
    if reason is None:
      self._checked_steps.add(step)
    return reason

  def restore(self, abstract_state, data_iterator: grain.DatasetIterator | None = None, *,
              step: int | None = None):
    """The state saved at `step` (default: the newest complete one), laid out as
    `abstract_state` says (a pytree of jax.ShapeDtypeStruct with `sharding=`, or arrays), and
    `data_iterator` moved to the saved position. Raises FileNotFoundError without checkpoints
    and DamagedCheckpoint when the checkpoint cannot be read."""
    step = self.latest_step() if step is None else step
    if step is None or step not in self.manager.all_steps():
      raise FileNotFoundError(f"checkpoints: no complete checkpoint"
                              f"{'' if step is None else f' of step {step}'} in {self.directory}"
                              f" (have {self.all_steps()})")
    if step not in self._checked_steps and (reason := self.problem(step)) is not None:
      raise DamagedCheckpoint(self.directory, step, reason)
    data_state = None if data_iterator is None else self._data_state(step)
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)}))
      if data_iterator is not None:
        data_iterator.set_state(data_state)
    except Exception as error:  # Orbax/TensorStore/Grain raise many types; all mean unreadable
      raise DamagedCheckpoint(self.directory, step, integrity.read_error_reason(error)) from error
    return restored[STATE_ITEM]

  def restore_config(self, step: int):
    """The TrainConfig saved with `step`: DamagedCheckpoint if it has none or it is unreadable,
    ValueError if it no longer validates."""
    from lalte_jax.train.config import config_from_dict  # pylint: disable=import-outside-toplevel
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))[CONFIG_ITEM]
    except Exception as error:  # pylint: disable=broad-exception-caught
      raise DamagedCheckpoint(self.directory, step,
                              f"config: {integrity.read_error_reason(error)}") from error
    if not isinstance(restored, dict):
      raise DamagedCheckpoint(self.directory, step, "no config")
    return config_from_dict(restored)

  def _data_state(self, step: int) -> dict:
    """This process's saved iterator state. Another process count is fine when every process
    saved the same state (the stream position is global); otherwise it is an error."""
    folder = self.directory / str(step) / DATA_ITEM
    index, count = jax.process_index(), jax.process_count()
    own = folder / f"process_{index}-of-{count}.json"
    try:
      if own.is_file():
        return json.loads(own.read_text())
      paths = sorted(folder.glob("process_*.json"))
      if any(path.name.endswith(f"-of-{count}.json") for path in paths):
        raise DamagedCheckpoint(self.directory, step, f"{DATA_ITEM}/{own.name} is missing")
      states = [json.loads(path.read_text()) for path in paths]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
      raise DamagedCheckpoint(self.directory, step,
                              f"data position: {integrity.read_error_reason(error)}") from error
    if not states:
      raise DamagedCheckpoint(self.directory, step, "no data iterator state")
    if any(state != states[0] for state in states):
      raise ValueError(f"checkpoints: step {step} was saved by another number of processes with"
                       f" differing data positions; cannot restore on {count} process(es)")
    return states[0]

  def set_aside(self, steps: list[int]) -> pathlib.Path | None:
    """Moves the checkpoints of `steps` (damaged ones) into `<directory>/damaged/`, where no
    listing, restore or keep-N deletion sees them and the run saves those steps afresh; returns
    that folder. Every process calls it."""
    if not steps:
      return None
    self.manager.wait_until_finished()
    self._checked_steps -= set(steps)
    if self._last_saved_step in steps:
      self._last_saved_step = None
    aside = self.directory / DAMAGED_DIR
    if jax.process_index() == 0:
      aside.mkdir(exist_ok=True)
      for step in steps:
        target, copy = aside / str(step), 1
        while target.exists():  # the same step damaged again in a later attempt
          target, copy = aside / f"{step}.{copy}", copy + 1
        shutil.move(self.directory / str(step), target)
    if jax.process_count() > 1:  # nobody lists the steps before they have moved
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      multihost_utils.sync_global_devices(f"set_aside:{self.directory}")
    self.manager.reload()
    return aside

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
    if jax.process_count() > 1 and step % check_every:
      return False
    return any_process(self.requested)
