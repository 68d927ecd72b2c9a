"""Multi-process start-up and failure bounds: `jax.distributed` on localhost or a cluster.

Every process of a run calls `initialize_distributed` before touching a JAX device. Settings come
from the arguments or else from the environment:
  LALTE_COORDINATOR_ADDRESS  "host:port" of process 0's coordination service
  LALTE_NUM_PROCESSES        number of processes
  LALTE_PROCESS_ID           this process's index in [0, num_processes)
  LALTE_HEARTBEAT_TIMEOUT_S  seconds without a heartbeat after which a peer counts as dead
                             (default 100)
  LALTE_INIT_TIMEOUT_S       seconds to wait for every process to join, and for the slowest
                             process to finish compiling a step (default 300)

Failure bound. When a process dies (crash, OOM kill, SIGKILL, lost node), the survivors are stuck
in a collective that can never complete: XLA's collectives have no timeout of their own. The
coordination service notices the missing heartbeats after `heartbeat_timeout_seconds` and tells
every live process, whose client then aborts it (SIGABRT: exit status 134, or -6 seen from
Python's subprocess) with "The tasks have crashed" in its log. So a run with a dead rank ends
within about `heartbeat_timeout_seconds` (+ a few seconds of polling) on every process, whichever
process died (the coordinator, process 0, included). A small timeout fails faster but risks
declaring a process dead that is only stalled (swapping, a long host-side pause); heartbeats come
from a background thread, so long compilations do not miss them. A process that never joins
makes the others fail after `initialization_timeout` seconds.

CPU collectives: multi-process CPU runs (tests, CPU clusters) exchange data through gloo over TCP,
the default of jax's `jax_cpu_collectives_implementation` in 0.10.x; it is set when unset. It
concerns only the CPU client; GPUs use NCCL. The first collective over a set of devices sets up a
gloo context, whose rendezvous gives up after a fixed 30 s (gloo's default, which jaxlib 0.10.2
exposes no setting for), so processes that reach their first step further apart than that fail
with "Gloo context initialization failed: DEADLINE_EXCEEDED". Compilation alone can make them:
on a loaded machine, or when one process finds the step in the compilation cache and another does
not. So every process compiles a step before running it and then waits for the others at
`wait_for_all_processes`, a barrier of the coordination service whose timeout is ours
(`lalte_jax.train.sharding.MeshJit`).
"""

from __future__ import annotations

import os
import socket

import jax

ENV_COORDINATOR = "LALTE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "LALTE_NUM_PROCESSES"
ENV_PROCESS_ID = "LALTE_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "LALTE_HEARTBEAT_TIMEOUT_S"
ENV_INIT_TIMEOUT = "LALTE_INIT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
DEFAULT_INIT_TIMEOUT_S = 300

# The settings a launched process reads (tools/bench_scaling.py clears them for one-process runs).
ENV_PROCESS_SETTINGS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)


def free_port() -> int:
  """A TCP port on localhost that is free now, for the coordinator of processes on one host."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def _int_setting(value: int | None, env_name: str, argument: str, default: int | None
                 ) -> int | None:
  """`value`, else the integer in environment variable `env_name`, else `default`."""
  if value is None and os.environ.get(env_name, "").strip():
    text = os.environ[env_name].strip()
    try:
      value = int(text)
    except ValueError:
      raise ValueError(f"distributed: {env_name}={text!r} (for {argument}) is not an integer"
                       ) from None
  return default if value is None else value


def wait_for_all_processes(name: str, timeout_seconds: int | None = None) -> None:
  """Returns once every process of the run has called this with `name` (in the same order);
  at once without `jax.distributed`. Waits at most `timeout_seconds` (else LALTE_INIT_TIMEOUT_S,
  else 300) and then raises; unlike a collective it sets up nothing that times out sooner."""
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  client = jax_distributed.global_state.client  # no public accessor in jax 0.10-0.11
  if client is None or jax.process_count() == 1:
    return
  timeout_seconds = _int_setting(timeout_seconds, ENV_INIT_TIMEOUT, "timeout_seconds",
                                 DEFAULT_INIT_TIMEOUT_S)
  client.wait_at_barrier(f"lalte:{name}", timeout_seconds * 1000)


def _use_gloo_on_cpu() -> None:
  """Selects gloo for cross-process CPU collectives unless another implementation is chosen."""
  try:
    current = jax.config.jax_cpu_collectives_implementation
  except AttributeError:  # a jax without the option: nothing to choose
    return
  if not current:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None, *,
                           heartbeat_timeout_seconds: int | None = None,
                           initialization_timeout: int | None = None) -> bool:
  """Starts `jax.distributed` for a multi-process run; returns whether it did.

  Each argument falls back to its environment variable (module doc). With no coordinator, or one
  process, nothing happens (single-process run). A dead peer makes this process abort within
  about `heartbeat_timeout_seconds` instead of hanging in a collective (module doc).
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = _int_setting(num_processes, ENV_NUM_PROCESSES, "num_processes", None)
  process_id = _int_setting(process_id, ENV_PROCESS_ID, "process_id", None)
  if coordinator_address is None or (num_processes or 1) == 1:
    return False
  heartbeat_timeout_seconds = _int_setting(heartbeat_timeout_seconds, ENV_HEARTBEAT_TIMEOUT,
                                           "heartbeat_timeout_seconds",
                                           DEFAULT_HEARTBEAT_TIMEOUT_S)
  initialization_timeout = _int_setting(initialization_timeout, ENV_INIT_TIMEOUT,
                                        "initialization_timeout", DEFAULT_INIT_TIMEOUT_S)
  if num_processes < 1:
    raise ValueError(f"distributed: num_processes must be positive, got {num_processes}")
  if process_id is None or not 0 <= process_id < num_processes:
    raise ValueError(f"distributed: process id {process_id!r} must be given and lie in"
                     f" [0, {num_processes}) (flag or {ENV_PROCESS_ID})")
  if heartbeat_timeout_seconds <= 0:
    raise ValueError(f"distributed: heartbeat_timeout_seconds must be positive, got"
                     f" {heartbeat_timeout_seconds} (flag or {ENV_HEARTBEAT_TIMEOUT})")
  if initialization_timeout <= 0:
    raise ValueError(f"distributed: initialization_timeout must be positive, got"
                     f" {initialization_timeout} (or {ENV_INIT_TIMEOUT})")
  _use_gloo_on_cpu()
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                             initialization_timeout=initialization_timeout)
  return True
