"""Exact resume through the CLI: SIGTERM, SIGKILL between checkpoints, damaged checkpoints,
another device count.

Every run is `python -m lalte_jax.train` in a subprocess on 4 (or 2) virtual CPU devices, tiny laLTE in
float32, logging every step to metrics.jsonl; an uninterrupted run is the reference. After a stop
or a kill, relaunching the same command must reproduce the reference's losses and gradient norms
bit for bit on the same mesh (with single-threaded XLA:CPU kernels, see `_launch`), and within
1e-5 on another one.
"""

import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.inference import checkpoint as params_checkpoint
from lalte_jax.train import checkpointing, export
from tests import damage
from tests.child_processes import ChildProcesses, child_env
from tests.lalte_jax.train import cli_runs

REPO = pathlib.Path(__file__).resolve().parents[3]
STEPS = 10
RUN_SETTINGS = (
    "model_dtype=float32", "seq_len=32", "global_batch_size=8", f"steps={STEPS}",
    "warmup_steps=1", "checkpoint_every=2", "checkpoint_keep=5", "log_every=1",
    "progress_bar=false", "tensorboard=false", "eval_batches=1", "num_eval_examples=16")
MESH_4 = ("mesh_data=2", "mesh_fsdp=2")  # parameters and moments sharded over fsdp
TIMEOUT_S = 900

pytestmark = pytest.mark.slow


def _launch(children: ChildProcesses, run_dir: pathlib.Path, devices: int,
            mesh: tuple[str, ...]) -> subprocess.Popen:
  run_dir.mkdir(parents=True, exist_ok=True)
  settings = RUN_SETTINGS + mesh + (f"output_dir={run_dir}",)
  # Multi-threaded XLA:CPU (Eigen) is not run-to-run deterministic: two uninterrupted launches
  # of this run differ by an ulp from step 4 on. Single-threaded kernels are, so bit-for-bit
  # comparisons are meaningful.
  # No persistent compilation cache (tests/conftest.py) for these runs: in one of three CI runs
  # with it, the resumed 4-device run deadlocked in XLA:CPU's in-process collectives (devices
  # waiting at different collectives of one launch, 40 s rendezvous timeout, abort) on the loaded
  # 2-core machine. Cause not found; this keeps the test as it ran before the cache existed.
  env = child_env(devices=devices, flags=("--xla_cpu_multi_thread_eigen=false",
                                          "intra_op_parallelism_threads=1"))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  log = open(run_dir / f"stdout_{time.monotonic_ns()}.txt", "w", encoding="utf-8")
  command = [sys.executable, "-m", "lalte_jax.train", "--config", str(REPO / "lalte_jax" / "configs" / "tiny_mqar.py")]
  for setting in settings:
    command += ["--set", setting]
  with log:  # the child holds its own copy of the descriptor
    process = children.start(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  process.run_dir = run_dir
  return process


def _finish(process: subprocess.Popen) -> tuple[int, str]:
  """Exit code, and the output of every launch in the run's directory so far."""
  code = process.wait(timeout=TIMEOUT_S)
  text = "\n".join(p.read_text() for p in sorted(process.run_dir.glob("stdout_*.txt")))
  return code, text


def _wait_for_step(process: subprocess.Popen, run_dir: pathlib.Path, step: int) -> int:
  """Waits until the run has logged `step` (or later); returns the newest logged step."""
  deadline = time.monotonic() + TIMEOUT_S
  while time.monotonic() < deadline:
    records = cli_runs.records(run_dir)
    if records and records[-1]["step"] >= step:
      return records[-1]["step"]
    assert process.poll() is None, f"run ended early: {_finish(process)}"
    time.sleep(0.02)
  raise TimeoutError(f"step {step} not reached in {TIMEOUT_S} s")


def _metrics(records: list[dict]) -> dict[int, tuple[float, float]]:
  return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted 4-device run, started at once (the other runs start while it compiles)."""
  run_dir = tmp_path_factory.mktemp("reference")
  reference_children = ChildProcesses()
  process = _launch(reference_children, run_dir, 4, MESH_4)
  result = {}

  def wait() -> dict:
    if not result:
      code, text = _finish(process)
      assert code == 0, text
      records = cli_runs.records(run_dir)
      assert [r["step"] for r in records] == list(range(1, STEPS + 1))
      result.update(run_dir=run_dir, metrics=_metrics(records), output=text)
    return result
  try:
    yield wait
  finally:
    reference_children.close()


def test_sigterm_then_sigkill_between_checkpoints_resume_bit_for_bit(reference, tmp_path,
                                                                      children):
  run_dir = tmp_path / "run"
  # 1. SIGTERM mid-run: the run saves the step it is at and exits 0.
  process = _launch(children, run_dir, 4, MESH_4)
  _wait_for_step(process, run_dir, 2)
  process.send_signal(signal.SIGTERM)
  code, text = _finish(process)
  assert code == 0, text
  stopped_at = cli_runs.records(run_dir)[-1]["step"]
  assert stopped_at < STEPS and f"stopped by SIGTERM after step {stopped_at}" in text
  assert (run_dir / "checkpoints" / str(stopped_at)).is_dir()
  assert not (run_dir / "export").exists()  # an unfinished run exports nothing

  # 2. Relaunch: it continues from that step; SIGKILL it a little later (no chance to save).
  process = _launch(children, run_dir, 4, MESH_4)
  killed_at = _wait_for_step(process, run_dir, stopped_at + 2)
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=TIMEOUT_S)
  steps_logged = [r["step"] for r in cli_runs.records(run_dir)]
  assert steps_logged == list(range(1, steps_logged[-1] + 1))  # continued, every step once

  # 3. Relaunch again: it resumes from the newest complete checkpoint and finishes. The log drops
  # the records of the steps it redoes, so it holds every step once.
  process = _launch(children, run_dir, 4, MESH_4)
  code, text = _finish(process)
  assert code == 0, text
  resumed_from = int(re.findall(r"resumed from \S+/checkpoints/(\d+)", text)[-1])
  assert stopped_at <= resumed_from <= killed_at
  records = cli_runs.records(run_dir)
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  expected = reference()["metrics"]
  for record in records:
    assert (record["loss"], record["grad_norm"]) == expected[record["step"]], record["step"]
  assert (run_dir / "export" / "model.json").is_file()
  assert params_checkpoint.load_model(run_dir / "export").config.name == "lalte-tiny"


def test_damaged_checkpoints_are_skipped_and_the_run_resumes_bit_for_bit(reference, tmp_path,
                                                                          children):
  ref = reference()
  run_dir = tmp_path / "damaged"
  directory = run_dir / "checkpoints"
  shutil.copytree(ref["run_dir"] / "checkpoints", directory)
  damage.truncate(damage.largest_array_file(directory / "10" / "state"))
  (directory / "8" / "state" / "_METADATA").unlink()
  damage.overwrite_middle(damage.largest_array_file(directory / "6" / "state"))
  (directory / "4" / "data" / "process_0-of-1.json").unlink()
  code, text = _finish(_launch(children, run_dir, 4, MESH_4))
  assert code == 0, text
  assert "Traceback" not in text
  warnings = [line for line in text.splitlines() if line.startswith("warning:")]
  reasons = (r"state/ocdbt\.process_0/d/\w+ has \d+ bytes, \d+ were written",
             r"state/_METADATA is missing",
             r"state/ocdbt\.process_0/d/\w+ differs from what was written \(CRC32\)",
             r"data/process_0-of-1\.json is missing")
  assert len(warnings) == 4, text
  for line, step, reason in zip(warnings, (10, 8, 6, 4), reasons):
    assert re.match(f"warning: checkpoint {step} in {re.escape(str(directory))} is damaged"
                    f" \\({reason}\\);", line), line
  assert f"resumed from {directory}/2" in text
  records = cli_runs.records(run_dir)
  assert [r["step"] for r in records] == list(range(3, STEPS + 1))
  for record in records:
    assert (record["loss"], record["grad_norm"]) == ref["metrics"][record["step"]], record["step"]
  assert sorted(int(p.name) for p in (directory / "damaged").iterdir()) == [4, 6, 8, 10]
  checkpoints = checkpointing.RunCheckpoints(directory, keep=1, read_only=True)
  assert checkpoints.all_steps() == [2, 4, 6, 8, 10]  # saved afresh
  assert all(checkpoints.problem(step) is None for step in checkpoints.all_steps())


def test_resume_on_two_devices_matches_within_1e_5(reference, tmp_path, children):
  ref = reference()
  saved = sorted(int(p.name) for p in (ref["run_dir"] / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert saved == [2, 4, 6, 8, 10]  # every 2 steps, the newest 5 kept
  # The reference's checkpoint of step 6 (4 devices, fsdp=2), continued on 2 devices.
  run_dir = tmp_path / "two_devices"
  shutil.copytree(ref["run_dir"] / "checkpoints", run_dir / "checkpoints")
  for step in (8, 10):
    shutil.rmtree(run_dir / "checkpoints" / str(step))
  code, text = _finish(_launch(children, run_dir, 2, ("mesh_data=1", "mesh_fsdp=2")))
  assert code == 0, text
  assert "2 devices" in text and "resumed from" in text
  records = cli_runs.records(run_dir)
  assert [r["step"] for r in records] == list(range(7, STEPS + 1))
  for record in records:
    expected_loss, _ = ref["metrics"][record["step"]]
    assert abs(record["loss"] - expected_loss) <= 1e-5, (record["step"], record["loss"])


def test_export_cli_reads_a_4_device_checkpoint_on_one_device(reference, tmp_path):
  ref = reference()
  assert "held-out recall accuracy" in ref["output"]
  assert f"exported parameters: {ref['run_dir'] / 'export'}" in ref["output"]
  out = tmp_path / "bf16"
  assert export.main(["--run_dir", str(ref["run_dir"]), "--out", str(out),
                      "--dtype", "bfloat16"]) == 0
  exported = params_checkpoint.load_model(out)
  final = params_checkpoint.load_model(ref["run_dir"] / "export")  # the run's own float32 export
  assert exported.config == final.config
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 32)), jnp.int32)
  np.testing.assert_allclose(exported(tokens), final(tokens), atol=3e-2, rtol=0)
  assert export.main(["--run_dir", str(tmp_path / "nothing"), "--out", str(out)]) == 2
