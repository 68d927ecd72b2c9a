"""Training CLI runs in child processes for the multi-process tests: one process alone or one of a
2-process run on localhost, its output in a log of the run's directory, its metrics read back from
the JSONL log that process 0 writes.

Each process is `python -m lalte_jax.train --config lalte_jax/configs/tiny_mqar.py --set ...` with
its own CPU device count (fixed when XLA's backend starts; `jax.distributed` starts once per
process) and the distributed timeouts of `DISTRIBUTED_ENV`.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import pytest

from lalte_jax.train import distributed
from tests.child_processes import DISTRIBUTED_ENV, REPO, ChildProcesses, child_env

CONFIG = REPO / "lalte_jax" / "configs" / "tiny_mqar.py"
# float32 so that 1e-6 is meaningful; fsdp=2 shards the parameters across the two processes of a
# 2 x 2-device run; a metrics record every step; the step watchdog armed (it must stay quiet).
SETTINGS = ("model_dtype=float32", "seq_len=64", "global_batch_size=8", "warmup_steps=1",
            "lr=3e-3", "mesh_fsdp=2", "log_every=1", "eval_batches=1", "num_eval_examples=8",
            "progress_bar=false", "tensorboard=false", "step_timeout_s=600")

# `python -c LATE_START SECONDS ARGS...` is `python -m lalte_jax.train ARGS...` that sleeps SECONDS
# before its first training step: it compiles that step, and reaches the step's collectives, that
# much later than the other processes, as a process slowed down by a loaded machine does. (Sleeping
# any earlier would be absorbed by the checkpoint manager's start, where the processes meet.)
LATE_START = """
import runpy, sys, time
from lalte_jax.train.trainer import Trainer
late_s, train_step = [float(sys.argv.pop(1))], Trainer.train_step
def late_train_step(self, local_batch):
  time.sleep(late_s.pop() if late_s else 0)
  return train_step(self, local_batch)
Trainer.train_step = late_train_step
runpy.run_module("lalte_jax.train", run_name="__main__", alter_sys=True)
"""


def launch(children: ChildProcesses, run_dir: pathlib.Path, settings: Sequence[str], *,
           devices: int, process_id: int | None = None, port: int | None = None,
           extra_flags: tuple[str, ...] = (), late_s: float = 0.0) -> subprocess.Popen:
  """Starts one CLI process with `devices` CPU devices (process `process_id` of 2 with a
  coordinator on `port`, or alone); its output goes to `run_dir`/process<id>.log. `late_s` > 0
  makes it sleep that long before its first step, and compile without the persistent compilation
  cache (which would otherwise hand it what the punctual process compiled meanwhile)."""
  env = child_env(devices=devices, **DISTRIBUTED_ENV)
  for name in distributed.ENV_PROCESS_SETTINGS:
    env.pop(name, None)
  command = [sys.executable, "-m", "lalte_jax.train"]
  if late_s:
    command = [sys.executable, "-c", LATE_START, str(late_s)]
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
  command += ["--config", str(CONFIG), *extra_flags]
  if process_id is not None:
    command += ["--coordinator_address", f"localhost:{port}", "--num_processes", "2",
                "--process_id", str(process_id)]
  for setting in (*settings, f"output_dir={run_dir}"):
    command += ["--set", setting]
  run_dir.mkdir(parents=True, exist_ok=True)
  log = open(run_dir / f"process{0 if process_id is None else process_id}.log", "w",
             encoding="utf-8")
  with log:  # the child holds its own copy of the descriptor
    return children.start(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def wait(proc: subprocess.Popen, run_dir: pathlib.Path, timeout: float) -> int:
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:  # the `children` fixture kills it
    pytest.fail(f"process {proc.pid} ran past {timeout} s; logs in {run_dir}")


def log_tail(run_dir: pathlib.Path, chars: int = 3000) -> str:
  return "\n".join(f"--- {path.name}\n{path.read_text()[-chars:]}"
                   for path in sorted(run_dir.glob("process*.log")))


def records(run_dir: pathlib.Path) -> list[dict]:
  """The complete records of the run's metrics log so far (a line being written is left out)."""
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
