"""Resuming a run: from the newest intact checkpoint, and only with the model it was saved with.

`restore_newest_intact` tries the checkpoints newest first. A damaged one (files that differ from
their checksums, a missing or unreadable item, any failure to read the state: see
`RunCheckpoints.problem` and `DamagedCheckpoint`) is skipped with one warning line on stderr
naming its step and the reason. Once an intact one is restored, the damaged newer ones are moved
into `checkpoints/damaged/` (the run then saves those steps afresh, and keep-N never counts
them). With none intact nothing is moved and a ValueError names the directory.

Several processes agree on the verdict of `problem` (any process finding damage skips the step
everywhere), so all restore the same step. A failure while reading the arrays, however, is
skipped only by a single process: with several, the processes that read their part fine wait in
Orbax's restore barrier for the one that failed, so the failing one stops the run with a
ValueError (the others then abort after the distributed heartbeat timeout). The checksums,
verified before anything is read, find that kind of damage first.

Before restoring, the checkpoint's saved TrainConfig is compared with the current one: the model
must be the same (preset and every ModelConfig field, overrides included), apart from the fields
that only change how it computes (activation dtype, remat, scan_layers) and
max_position_embeddings (which follows seq_len and holds no parameters). Everything else may
change on resume (steps, learning-rate schedule, batch, seq_len, data, mesh), and the run follows
the new values from the restored step on.
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from lalte_jax.train import checkpointing
from lalte_jax.train.config import TrainConfig

# ModelConfig fields that a resumed run may change: no parameter depends on them.
COMPUTE_ONLY_FIELDS = ("dtype", "remat", "scan_layers", "max_position_embeddings")


def _flat_fields(config, prefix: str = "") -> dict[str, object]:
  """A (nested) config dataclass as {dotted field name: value}."""
  flat = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if dataclasses.is_dataclass(value):
      flat.update(_flat_fields(value, f"{prefix}{field.name}."))
    else:
      flat[prefix + field.name] = value
  return flat


def model_changes(saved: TrainConfig, current: TrainConfig) -> list[str]:
  """How `current`'s model differs from `saved`'s, as "field: saved -> current" items, naming
  the preset fields (variant, size) when they differ, else the ModelConfig fields
  (`model.<dotted name>`, as `--set` writes them); [] when a resume can continue the model."""
  presets = [f"{name}: {getattr(saved, name)!r} -> {getattr(current, name)!r}"
             for name in ("variant", "size") if getattr(saved, name) != getattr(current, name)]
  if presets:
    return presets
  old, new = _flat_fields(saved.model_config()), _flat_fields(current.model_config())
  return [f"model.{name}: {old.get(name)!r} -> {new.get(name)!r}"
          for name in sorted(set(old) | set(new))
          if name not in COMPUTE_ONLY_FIELDS and old.get(name) != new.get(name)]


def _warn(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def restore_newest_intact(checkpoints: checkpointing.RunCheckpoints, config: TrainConfig,
                          abstract_state, data_iterator) -> tuple[int, object]:
  """(step, state) of the newest intact checkpoint, `data_iterator` moved to its position.

  Raises ValueError (one line) when `config`'s model differs from the checkpoint's or no
  checkpoint is intact. Every process calls it."""
  directory = checkpoints.directory
  damaged = []
  for step in reversed(checkpoints.all_steps()):
    reason = checkpoints.problem(step)
    if not checkpointing.any_process(reason is not None):
      changes = model_changes(checkpoints.restore_config(step), config)
      if changes:
        raise ValueError(
            f"TrainConfig: the checkpoints in {directory} were saved with another model"
            f" ({'; '.join(changes)}); resuming needs the same model: undo the change, or train"
            " the changed model in a new output_dir")
      try:
        state = checkpoints.restore(abstract_state, data_iterator, step=step)
      except checkpointing.DamagedCheckpoint as error:
        if jax.process_count() > 1:
          raise ValueError(
              f"{error}; with several processes a checkpoint found damaged only while reading"
              f" cannot be skipped (the others wait in Orbax's restore): move"
              f" {directory / str(step)} into {directory / checkpointing.DAMAGED_DIR} and start"
              " again") from error
        reason = error.reason
      else:
        checkpoints.set_aside(damaged)
        return step, state
    if reason is not None or jax.process_index() == 0:
      _warn(f"warning: checkpoint {step} in {directory} is damaged"
            f" ({reason or 'found by another process'}); skipping it (damaged checkpoints move to"
            f" {directory / checkpointing.DAMAGED_DIR} once an earlier one is restored)")
    damaged.append(step)
  raise ValueError(f"checkpoints: no intact checkpoint in {directory} (damaged: steps"
                   f" {sorted(damaged)}; nothing was moved); to start afresh move that directory"
                   " away, or choose another output_dir")
