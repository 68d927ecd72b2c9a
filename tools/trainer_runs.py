"""The trainer (`python -m lalte_jax.train`) as N local processes, one per GPU (or per emulated
CPU device), joined by `jax.distributed` as a multi-host job is: the runner behind
tools/bench_scaling.py.

Each child gets its own process group (`ProcessGroups.close()` kills whatever a child started),
the devices it may use (CUDA_VISIBLE_DEVICES, or XLA's host device count on the CPU) and none of
the parent's process settings (lalte_jax/train/distributed.py's environment variables).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

_TOOLS = pathlib.Path(__file__).resolve().parent
REPO = _TOOLS.parent
for _path in (str(REPO), str(_TOOLS)):
  if _path not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, _path)

# pylint: disable=wrong-import-position
from lalte_jax import xla_flags
from lalte_jax.train import distributed

from lalte_jax.train.metrics import is_out_of_memory

LOG_TAIL_CHARS = 2000


def visible_gpus(platform: str, wanted: int) -> list[str]:
  """Device ids a case may use: CUDA_VISIBLE_DEVICES's, else `nvidia-smi -L`'s; on the CPU
  platform `wanted` emulated ones."""
  if platform == "cpu":
    return [str(index) for index in range(wanted)]
  listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
  if listed:
    return [item.strip() for item in listed.split(",") if item.strip()]
  try:
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60,
                          check=True)
  except (OSError, subprocess.SubprocessError) as error:
    raise SystemExit(f"cannot list GPUs with nvidia-smi ({error}); set"
                     " CUDA_VISIBLE_DEVICES or use --platform cpu") from None
  return [str(index) for index, line in enumerate(done.stdout.splitlines())
          if line.startswith("GPU ")]


class ProcessGroups:
  """Children in their own process groups (each with what it starts); `close()` SIGKILLs every
  group still alive, also when its leader has exited."""

  def __init__(self):
    self.processes: list[subprocess.Popen] = []

  def start(self, command: list[str], **popen_kwargs) -> subprocess.Popen:
    process = subprocess.Popen(command, start_new_session=True, **popen_kwargs)
    self.processes.append(process)
    return process

  def close(self) -> None:
    for process in self.processes:
      try:
        os.killpg(process.pid, signal.SIGKILL)
      except ProcessLookupError:  # the whole group has exited
        pass
      process.wait()
    self.processes.clear()


def child_env(platform: str, devices: list[str], timeout_s: float, *,
              extra_xla_flags: tuple[str, ...] = ()) -> dict[str, str]:
  """The environment of one trainer process on `devices` (GPU ids, or CPU devices counted), with
  `extra_xla_flags` added to (or replacing the same flags of) the inherited XLA_FLAGS."""
  env = {name: value for name, value in os.environ.items()
         if name not in distributed.ENV_PROCESS_SETTINGS}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))
  # Every process joins, and compiles a step, within this of the others.
  env["LALTE_INIT_TIMEOUT_S"] = str(max(60, int(timeout_s)))
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = xla_flags.with_flags(
        env.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={len(devices)}",
        replace=True)
  else:
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
  if extra_xla_flags:
    env["XLA_FLAGS"] = xla_flags.with_flags(env.get("XLA_FLAGS", ""), *extra_xla_flags,
                                            replace=True)
  return env


def mesh_settings(mesh: str, gpus: int) -> list[str]:
  """The trainer's mesh axes for `--mesh` over `gpus` devices."""
  return ([f"mesh_data={gpus}", "mesh_fsdp=1"] if mesh == "data" else
          ["mesh_data=1", f"mesh_fsdp={gpus}"])


def run_trainer(groups: ProcessGroups, run_dir: pathlib.Path, settings: list[str], *,
                processes: int, devices: list[str], timeout_s: float, platform: str = "gpu",
                extra_xla_flags: tuple[str, ...] = ()) -> dict:
  """Runs `python -m lalte_jax.train --config tiny_mqar --set ...` as `processes` processes
  sharing `devices` equally (joined on a free localhost port when more than one), logs in
  <run_dir>/process<i>.log; waits for all (a failed one ends the others).
  {"status": ok | error | oom | timeout, "wall_s", "command", ["error", "log_tail"]}."""
  run_dir.mkdir(parents=True, exist_ok=True)
  command = [sys.executable, "-m", "lalte_jax.train", "--config", "tiny_mqar"]
  for setting in settings:
    command += ["--set", setting]
  port = distributed.free_port()
  per_process = len(devices) // processes
  started, procs = time.monotonic(), []
  for index in range(processes):
    joined = ([] if processes == 1 else
              ["--coordinator_address", f"localhost:{port}", "--num_processes", str(processes),
               "--process_id", str(index)])
    env = child_env(platform, devices[index * per_process:(index + 1) * per_process],
                    timeout_s, extra_xla_flags=extra_xla_flags)
    with open(run_dir / f"process{index}.log", "w", encoding="utf-8") as log:
      procs.append(groups.start(command + joined, env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT))
  status = None
  while status is None:
    codes = [proc.poll() for proc in procs]
    if all(code == 0 for code in codes):
      status = "ok"
    elif any(code not in (None, 0) for code in codes):
      status = "error"
    elif time.monotonic() - started > timeout_s:
      status = "timeout"
    else:
      time.sleep(0.2)
  groups.close()  # the others of a failed run would wait for the heartbeat timeout
  result = {"status": status, "wall_s": time.monotonic() - started,
            "command": " ".join(command + (["--coordinator_address", "localhost:PORT",
                                            "--num_processes", str(processes),
                                            "--process_id", "I"] if processes > 1 else []))}
  if status != "ok":
    tail = "\n".join(f"--- process{i}.log\n" + (run_dir / f"process{i}.log").read_text(
        errors="replace")[-LOG_TAIL_CHARS:] for i in range(processes))
    result["error"] = (f"ran past {timeout_s:.0f} s" if status == "timeout" else
                       f"exit statuses {[proc.returncode for proc in procs]}")
    result["log_tail"] = tail
    if status == "error" and is_out_of_memory(Exception(tail)):
      result["status"] = "oom"
  return result


def read_records(run_dir: pathlib.Path) -> list[dict]:
  """The step records of a run's metrics.jsonl (process 0's), in step order."""
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return []
  records = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:  # a line torn by a kill
      continue
    if isinstance(record, dict) and "step" in record and "loss" in record:
      records.append(record)
  return sorted(records, key=lambda record: record["step"])
