"""Test session setup shared by every test module."""

import os
import pathlib
import signal

from lalte_jax import xla_flags  # pylint: disable=wrong-import-position
from tests.child_processes import TEST_COMPILE_FLAGS  # pylint: disable=wrong-import-position

# Before JAX creates its CPU backend: the platform workarounds of the entry points, and the tests'
# compile flags (tests/child_processes.py says why); child processes inherit both.
xla_flags.apply_workarounds()
xla_flags.apply(*TEST_COMPILE_FLAGS)

# One persistent XLA compilation cache for the whole run, shared by the xdist workers and by the
# child processes that tests start (they inherit the environment): many tests compile the same
# tiny train step (the CLI, resume and multi-process tests launch it several times each), which
# takes ~25 s on a 2-core machine and ~4 s from the cache. Results do not depend on it: a cached
# executable is the one the same HLO compiles to.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")

import jax  # pylint: disable=wrong-import-position
import pytest

from tests.child_processes import ChildProcesses  # pylint: disable=wrong-import-position

# Tests check semantics in full float32: GPUs would otherwise run float32 matmuls in TF32, which
# moves results by ~1e-3 relative and flips LTE keep/drop decisions that sit near the threshold.
# Production code keeps JAX's default; the kernel tolerance tables cover bf16 separately.
jax.config.update("jax_default_matmul_precision", "highest")


def _interrupt(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


# SIGTERM (a CI job's timeout, `kill`) ends the session as Ctrl-C does, through the tests' cleanups,
# so that no child process of a test (`children` below) outlives it.
if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
  signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture
def children():
  """A `tests.child_processes.ChildProcesses`: the test's children, killed when it ends."""
  with ChildProcesses() as processes:
    yield processes


def pytest_configure(config):
  # pytest-xdist's load scheduling first hands each worker a block of a quarter of its share of the
  # collection; with the slow tests sorted first (below), one worker's block held every slow test
  # and ran ~870 s while the other finished the rest in ~500 s (2 workers, 2-core CPU,
  # 2026-11-28). Handing out tests one at a time keeps both busy to the end.
  if getattr(config.option, "maxschedchunk", "absent") is None:
    config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
  del config
  # The slow end-to-end tests first, so that with two workers none of them is left to run alone
  # at the end (a stable sort: the order is otherwise the collection's, the same on every worker).
  items.sort(key=lambda item: "slow" not in item.keywords)
  if jax.default_backend() == "gpu":
    return
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
