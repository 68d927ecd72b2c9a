"""Multi-process training through the real CLI on localhost: 2 processes x 2 CPU devices give the
losses of 1 process x 4 devices, and a dead process makes the survivor exit within a bound.

Each run is `python -m lalte_jax.train --config lalte_jax/configs/tiny_mqar.py --set ...` in child processes (the CPU
device count is fixed when XLA's backend starts; `jax.distributed` starts once per process), with
a fresh coordinator port per run. Losses come from the JSONL metrics log that process 0 writes.
"""

import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from lalte_jax.train import distributed
from tests.child_processes import DISTRIBUTED_ENV, child_env

REPO = pathlib.Path(__file__).resolve().parents[3]
CONFIG = REPO / "lalte_jax" / "configs" / "tiny_mqar.py"
# float32 so that 1e-6 is meaningful; fsdp=2 shards the parameters across the two processes;
# two micro-batches exercise accumulation; a metrics record every step; the step watchdog armed
# (it must stay quiet).
COMMON_SETTINGS = ("model_dtype=float32", "seq_len=64", "global_batch_size=8", "warmup_steps=1",
                   "lr=3e-3", "mesh_fsdp=2", "log_every=1", "eval_batches=1",
                   "num_eval_examples=8", "progress_bar=false", "tensorboard=false",
                   "step_timeout_s=600")
COMPARED_METRICS = ("loss", "ce_loss", "grad_norm", "lte_retained")



def _launch(children, run_dir: pathlib.Path, settings: list[str], *, devices: int,
            process_id: int | None = None, port: int | None = None,
            extra_flags: tuple[str, ...] = ()) -> subprocess.Popen:
  """Starts one CLI process with `devices` CPU devices (one of `children`); its output goes to a
  log in `run_dir`. Distributed timeouts come from DISTRIBUTED_ENV unless `extra_flags` set them."""
  env = child_env(devices=devices, **DISTRIBUTED_ENV)
  for name in ("LALTE_COORDINATOR_ADDRESS", "LALTE_NUM_PROCESSES", "LALTE_PROCESS_ID"):
    env.pop(name, None)
  command = [sys.executable, "-m", "lalte_jax.train", "--config", str(CONFIG), *extra_flags]
  if process_id is not None:
    command += ["--coordinator_address", f"localhost:{port}", "--num_processes", "2",
                "--process_id", str(process_id)]
  for setting in (*COMMON_SETTINGS, f"output_dir={run_dir}", *settings):
    command += ["--set", setting]
  run_dir.mkdir(parents=True, exist_ok=True)
  log = open(run_dir / f"process{0 if process_id is None else process_id}.log", "w",
             encoding="utf-8")
  with log:  # the child holds its own copy of the descriptor
    return children.start(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, run_dir: pathlib.Path, timeout: float) -> int:
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:  # the `children` fixture kills it
    pytest.fail(f"process {proc.pid} ran past {timeout} s; logs in {run_dir}")


def _log_tail(run_dir: pathlib.Path) -> str:
  return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}"
                   for path in sorted(run_dir.glob("process*.log")))


def _records(run_dir: pathlib.Path) -> list[dict]:
  path = run_dir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(tmp_path, children):
  num_steps = 3
  settings = [f"steps={num_steps}", "grad_accum_steps=2"]
  port = distributed.free_port()
  single_dir, multi_dir = tmp_path / "one_process", tmp_path / "two_processes"
  procs = [(_launch(children, single_dir, settings, devices=4), single_dir)]
  procs += [(_launch(children, multi_dir, settings, devices=2, process_id=i, port=port),
             multi_dir) for i in (0, 1)]
  for proc, run_dir in procs:
    assert _wait(proc, run_dir, timeout=600) == 0, _log_tail(run_dir)

  single, multi = _records(single_dir), _records(multi_dir)
  assert [r["step"] for r in single] == list(range(1, num_steps + 1)), _log_tail(single_dir)
  assert [r["step"] for r in multi] == [r["step"] for r in single], _log_tail(multi_dir)
  assert "4 devices on 2 process(es)" in (multi_dir / "process0.log").read_text()
  assert all(np.isfinite(r["loss"]) for r in single)
  assert len({r["loss"] for r in single}) == num_steps  # the model trains: losses move
  for name in COMPARED_METRICS:
    np.testing.assert_allclose([r[name] for r in multi], [r[name] for r in single],
                               rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["worker_dies", "coordinator_dies"])
def test_survivor_exits_when_a_process_dies(tmp_path, victim, children):
  heartbeat_timeout_s, bound_s = 10, 60
  port = distributed.free_port()
  # Any model shows the failure; plain GDN compiles fastest.
  procs = [_launch(children, tmp_path, ["variant=gdn", "steps=100000", "grad_accum_steps=1"],
                   devices=2, process_id=i, port=port,
                   extra_flags=("--heartbeat_timeout_s", str(heartbeat_timeout_s)))
           for i in (0, 1)]
  deadline = time.monotonic() + 600
  while len(_records(tmp_path)) < 2:  # both processes are past compilation and stepping
    assert all(p.poll() is None for p in procs), _log_tail(tmp_path)
    assert time.monotonic() < deadline, _log_tail(tmp_path)
    time.sleep(0.5)
  procs[victim].send_signal(signal.SIGKILL)
  killed_at = time.monotonic()
  survivor = procs[1 - victim]
  returncode = _wait(survivor, tmp_path, timeout=bound_s + 60)
  elapsed_s = time.monotonic() - killed_at
  assert returncode != 0, _log_tail(tmp_path)
  assert elapsed_s < bound_s, f"survivor took {elapsed_s:.1f} s\n{_log_tail(tmp_path)}"
  # It stopped because the distributed service saw the peer die, not for some other reason.
  assert "distributed service detected fatal errors" in (
      tmp_path / f"process{1 - victim}.log").read_text(), _log_tail(tmp_path)


# One device per process; process 1 reaches the first collective LATE_S after process 0, later
# than gloo's fixed 30 s rendezvous allows, as a slow compilation on a loaded machine makes it.
LATE_S = 35
LATE_PROCESS = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from lalte_jax.train import distributed, sharding
process_id, port, late_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
distributed.initialize_distributed(f"localhost:{port}", 2, process_id)
mesh = sharding.make_mesh(2, 1, 1)
rows = jax.make_array_from_process_local_data(sharding.batch_sharding(mesh),
                                              np.full((1, 4), process_id + 1, np.float32))
total = sharding.MeshJit(jnp.sum, mesh, out_shardings=sharding.replicated(mesh))
if process_id == 1:
  time.sleep(late_s)
print("TOTAL", float(sharding.to_host(total(rows))), flush=True)
"""


@pytest.mark.slow
def test_first_step_waits_for_a_process_that_compiles_late(children):
  env = child_env(devices=1, **DISTRIBUTED_ENV)
  port = distributed.free_port()
  procs = [children.start([sys.executable, "-c", LATE_PROCESS, str(i), str(port), str(LATE_S)],
                          env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) for i in (0, 1)]
  for proc in procs:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "TOTAL 12.0" in output, output[-3000:]


def test_single_process_settings_start_nothing(monkeypatch):
  from lalte_jax.train.distributed import initialize_distributed  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("LALTE_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setenv("LALTE_NUM_PROCESSES", "2")
  assert not initialize_distributed()  # no coordinator
  assert not initialize_distributed("localhost:1234", 1, 0)  # one process


@pytest.mark.parametrize("arguments,environment,message", [
    (("localhost:1", 2, None), {}, "process id None"),
    (("localhost:1", 2, 2), {}, r"lie in \[0, 2\)"),
    ((None, None, None), {"LALTE_COORDINATOR_ADDRESS": "localhost:1",
                          "LALTE_NUM_PROCESSES": "two"}, "LALTE_NUM_PROCESSES='two'"),
    (("localhost:1", 2, 0), {"LALTE_HEARTBEAT_TIMEOUT_S": "0"}, "heartbeat_timeout_seconds"),
])
def test_bad_distributed_settings_fail_before_starting(monkeypatch, arguments, environment,
                                                        message):
  from lalte_jax.train.distributed import initialize_distributed  # pylint: disable=import-outside-toplevel
  for name in ("LALTE_COORDINATOR_ADDRESS", "LALTE_NUM_PROCESSES", "LALTE_PROCESS_ID",
               "LALTE_HEARTBEAT_TIMEOUT_S", "LALTE_INIT_TIMEOUT_S"):
    monkeypatch.delenv(name, raising=False)
  for name, value in environment.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=message):
    initialize_distributed(*arguments)
