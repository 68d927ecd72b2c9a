"""A step watchdog: ends the process when the training loop stops making progress.

The distributed heartbeat (lalte_jax/train/distributed.py) bounds the wait when a peer process dies; a peer
that is alive but stuck (a deadlocked collective, a hung filesystem read in the input pipeline)
keeps its heartbeat going. `StepWatchdog` covers that case: the loop calls `feed()` after every
step, and a daemon thread ends the process with exit status `EXIT_CODE` once `timeout_s` seconds
pass without one. It arms at the first `feed()`, so the first step's compilation is never timed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_CODE = 4


def _exit_process(idle_s: float) -> None:
  print(f"error: no training step finished for {idle_s:.0f} s (step_timeout_s); a process is"
        " stuck, ending this one so that the job can be restarted from its last checkpoint",
        file=sys.stderr, flush=True)
  os._exit(EXIT_CODE)  # pylint: disable=protected-access  # a hung collective ignores exceptions


class StepWatchdog:
  """`with StepWatchdog(timeout_s) as watchdog: ... watchdog.feed()`; timeout_s <= 0 disables it.

  on_timeout(idle_seconds) runs on the watchdog thread (default: print and `os._exit(4)`).
  """

  def __init__(self, timeout_s: float, *, on_timeout: Callable[[float], None] = _exit_process,
               poll_s: float | None = None):
    self.timeout_s = float(timeout_s)
    self._on_timeout = on_timeout
    self._poll_s = poll_s if poll_s is not None else min(5.0, max(self.timeout_s / 10, 0.01))
    self._last_feed: float | None = None
    self._stopped = threading.Event()
    self._thread: threading.Thread | None = None

  def feed(self) -> None:
    self._last_feed = time.monotonic()

  def _watch(self) -> None:
    while not self._stopped.wait(self._poll_s):
      last = self._last_feed
      if last is not None and time.monotonic() - last > self.timeout_s:
        self._on_timeout(time.monotonic() - last)
        return

  def __enter__(self) -> StepWatchdog:
    if self.timeout_s > 0:
      self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self._stopped.set()
    if self._thread is not None:
      self._thread.join()
