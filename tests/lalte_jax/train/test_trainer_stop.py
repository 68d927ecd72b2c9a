"""A stop signal ends the training loop whether or not the run checkpoints (tools/repro.py relies
on it to cut trainings at a deadline and still evaluate what they learned)."""

import os
import signal

import pytest

from lalte_jax.train.config import TrainConfig
from lalte_jax.train.metrics import MetricsLogger
from lalte_jax.train.trainer import Trainer


@pytest.mark.slow  # init + compile of a tiny model
def test_sigterm_stops_a_run_without_checkpoints_after_the_step_in_flight():
  config = TrainConfig(variant="gdn_swa", size="tiny", model_dtype="float32", data="mqar",
                       seq_len=32, mqar_num_kv_pairs=2, global_batch_size=2, steps=50,
                       warmup_steps=1, progress_bar=False, tensorboard=False,
                       model_overrides={"num_layers": 2, "layer_pattern": ("gdn", "attention")})
  trainer = Trainer(config, logger=MetricsLogger("", total_steps=50, enabled=False))
  assert trainer.checkpoints is None
  trainer.callbacks.append(
      lambda _, step: os.kill(os.getpid(), signal.SIGTERM) if step == 3 else None)
  previous = signal.getsignal(signal.SIGTERM)
  summary = trainer.run()
  assert summary["stopped_at"] == 3 and summary["signal"] == "SIGTERM"
  assert summary["started_at"] == 0  # the step it began from in this invocation
  assert "checkpoint" not in summary and int(trainer.state.step) == 3
  assert signal.getsignal(signal.SIGTERM) is previous  # the handler is restored after the loop
  assert 0.0 <= trainer.evaluate()["eval_recall_accuracy"] <= 1.0  # the state is still usable
