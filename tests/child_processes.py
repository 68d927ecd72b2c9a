"""Child processes of tests: each in its own process group, killed with that group on any exit.

Tests that start trainers, benchmarks or multi-process runs do so through `ChildProcesses` (the
`children` fixture of tests/conftest.py, or a `with` block): every child starts a new session
(`start_new_session=True`), so that it and whatever it starts in turn form one process group, and
leaving the block -- normally, on a failure, on KeyboardInterrupt (SIGINT, and SIGTERM, which
tests/conftest.py turns into one), on a timeout -- SIGKILLs every group still alive. Only a
SIGKILL of the test process itself leaves them running.

`DISTRIBUTED_ENV` holds generous `jax.distributed` timeouts for multi-process children: on a loaded
2-core machine joining and compiling take minutes, and a peer's heartbeats can stall for seconds.
"""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import signal
import subprocess
from collections.abc import Sequence

from lalte_jax import xla_flags

REPO = pathlib.Path(__file__).resolve().parents[1]

# XLA:CPU compile options of the test session (tests/conftest.py) and of its children. The tests
# compile far more than they run (tiny models, a few steps each), and LLVM's optimisations are most
# of XLA:CPU's compile time: with the first two flags the two tiny-lalte training tests of
# tests/lalte_jax/train/test_step.py took 27.9 s instead of 62.9 s (2026-11-26, jax 0.10.2, 2-core
# CPU, cold compilation cache). XLA:CPU's MLIR fusion emitters take most of what is left: without
# them (the third flag) the tiny laLTE bfloat16 value-and-grad compiles in 2.3 s instead of 6.2 s
# and tests/lalte_jax/test_model.py runs in 77 s instead of 143 s (same day and machine). jaxlib
# 0.11.2 has no such flag (and XLA aborts on a flag it does not know), so it is set only on jaxlib
# 0.10. So is the fourth: one thread per matmul, since the two pytest workers already use both
# cores and Eigen's thread pools only oversubscribe them (cold compilation caches, -n 2, 2026-11-28:
# tests/lalte_jax/test_model.py with test_generate.py 117 -> 100 s; train/test_step.py, test_lte.py
# and train/test_router_warmup.py 62 -> 58 s). Every process of a test uses the same flags, so
# comparisons between them stay exact; the README demo's test drops them to run the command as
# users do.
_LEGACY_CPU_FLAGS = (("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_multi_thread_eigen=false")
                     if importlib.metadata.version("jaxlib").startswith("0.10.") else ())
TEST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true", *_LEGACY_CPU_FLAGS)

# Seconds: every process joins and compiles each step within LALTE_INIT_TIMEOUT_S of the others
# (lalte_jax/train/distributed.py); a peer silent for LALTE_HEARTBEAT_TIMEOUT_S counts as dead.
DISTRIBUTED_ENV = {"LALTE_INIT_TIMEOUT_S": "900", "LALTE_HEARTBEAT_TIMEOUT_S": "120"}


def kill_group(process: subprocess.Popen) -> None:
  """SIGKILLs the process group that `process` leads (it and its descendants) and reaps it."""
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except ProcessLookupError:  # the whole group has exited
    pass
  process.wait()


def child_env(*, devices: int | None = None, flags: Sequence[str] = (), **variables: str
              ) -> dict[str, str]:
  """The environment of a test's child process: this process's (whose XLA_FLAGS hold the
  workarounds and TEST_COMPILE_FLAGS), JAX on the CPU with `devices` devices, the repository
  importable, `flags` added to XLA_FLAGS (replacing earlier values of the same flags) and
  `variables` set."""
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", **variables)
  if devices is not None:
    flags = (f"--xla_force_host_platform_device_count={devices}", *flags)
  env["XLA_FLAGS"] = xla_flags.with_flags(env.get("XLA_FLAGS", ""), *flags, replace=True)
  return env


class ChildProcesses:
  """Starts children in their own process groups; `close()` (or leaving `with`) kills them."""

  def __init__(self):
    self.processes: list[subprocess.Popen] = []

  def start(self, command: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    process = subprocess.Popen(list(command), start_new_session=True, **popen_kwargs)
    self.processes.append(process)
    return process

  def run(self, command: Sequence[str], *, timeout: float, **popen_kwargs
          ) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout)`, the child in
    its own group (a timeout raises `subprocess.TimeoutExpired`; `close()` kills it)."""
    process = self.start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **popen_kwargs)
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

  def close(self) -> None:
    for process in self.processes:
      kill_group(process)  # also when the leader exited: its descendants may still run
    self.processes.clear()

  def __enter__(self) -> ChildProcesses:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
