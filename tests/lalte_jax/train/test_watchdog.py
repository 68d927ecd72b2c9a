"""The step watchdog: silent while steps keep finishing, fires once when they stop."""

import time

import pytest

from lalte_jax.train.config import TrainConfig
from lalte_jax.train.watchdog import StepWatchdog


def test_fires_after_the_loop_stalls_and_not_before():
  fired = []
  with StepWatchdog(0.3, on_timeout=fired.append, poll_s=0.02) as watchdog:
    time.sleep(0.5)  # not armed yet: the first step (compilation) is never timed
    assert not fired
    for _ in range(10):  # steps every 0.1 s keep it quiet
      watchdog.feed()
      time.sleep(0.1)
    assert not fired
    time.sleep(0.6)  # a stall
  assert len(fired) == 1 and fired[0] > 0.3


def test_zero_disables_it_and_negative_is_refused():
  with StepWatchdog(0, on_timeout=pytest.fail) as watchdog:
    watchdog.feed()
    time.sleep(0.05)
  with pytest.raises(ValueError, match="step_timeout_s"):
    TrainConfig(step_timeout_s=-1)
