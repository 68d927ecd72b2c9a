"""Sharded training equals single-device training: 4 CPU devices in one process, and 2 processes
x 2 devices through the training CLI and `jax.distributed` on localhost, one of them joining its
first step late; the parameter layout rules.

The in-process meshes run in a child process (XLA's device count is fixed when the backend starts)
that prints its losses as one JSON line; the 2-process run is `python -m lalte_jax.train` twice
(tests/lalte_jax/train/cli_runs.py), its losses read from the metrics log. Both use the same
config, so all start from the same initial state and read the same batches.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lalte_jax.train import distributed
from tests.child_processes import child_env
from tests.lalte_jax.train import cli_runs

REPO = pathlib.Path(__file__).resolve().parents[3]
# The optional tensor axis is covered by the layout test below; a third compiled mesh here would
# cost a minute of CI time for rules that XLA partitions correctly whatever they say.
MESHES = {"single": None, "data2_fsdp2": (2, 2, 1)}
NUM_STEPS = 3
# Two micro-batches exercise the accumulation layout on the mesh; router dropout stays on (keys
# do not depend on the layout).
SETTINGS = (*cli_runs.SETTINGS, "grad_accum_steps=2", f"steps={NUM_STEPS}")
# Process 1 of the 2-process run compiles and reaches its first step this many seconds after
# process 0: later than gloo's fixed 30 s rendezvous allows, as on a loaded machine; the run must
# wait for it at the barrier after compilation (lalte_jax/train/sharding.py, MeshJit).
LATE_S = 35
RESULTS = "RESULTS "  # the prefix of the in-process child's output line
# Per step: the metrics-log field and the name of the same value in the child's results.
COMPARED_METRICS = {"loss": "losses", "ce_loss": "ce_losses", "grad_norm": "grad_norms",
                    "lte_retained": "retained"}


def _child() -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from lalte_jax.train import sharding  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.config import load_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.metrics import MetricsLogger  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 4, jax.devices()
  config = load_config(cli_runs.CONFIG, list(SETTINGS))
  results, initial_state = {}, None
  for name, shape in MESHES.items():
    mesh = (sharding.make_mesh(devices=jax.devices()[:1]) if shape is None
            else sharding.make_mesh(*shape))
    # Every run starts from the single-device initial state, resharded.
    trainer = Trainer(config, mesh=mesh, state=initial_state,
                      logger=MetricsLogger("", total_steps=1, enabled=False))
    if initial_state is None:
      initial_state = jax.device_get(trainer.state)
    sharded = [p for p, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.params)
               if any(axis is not None for axis in leaf.sharding.spec)]
    steps = [sharding.to_host(trainer.train_step(next(trainer.data_iterator)))
             for _ in range(NUM_STEPS)]
    results[name] = {key: [np.asarray(metrics[field]).tolist() for metrics in steps]
                     for field, key in COMPARED_METRICS.items()}
    embedding = jax.device_get(trainer.state.params["embed"]["embedding"])
    results[name].update(num_sharded_params=len(sharded), embedding=embedding[:4].tolist(),
                         step=int(sharding.to_host(trainer.state.step)))
  print(RESULTS + json.dumps(results), flush=True)


@pytest.mark.slow
def test_sharded_and_multiprocess_steps_equal_single_device(tmp_path, children):
  in_process = children.start([sys.executable, __file__], env=child_env(devices=4), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  port, run_dir = distributed.free_port(), tmp_path / "two_processes"
  processes = [cli_runs.launch(children, run_dir, SETTINGS, devices=2, process_id=i, port=port,
                               late_s=LATE_S if i == 1 else 0) for i in (0, 1)]
  out, err = in_process.communicate(timeout=900)  # on a timeout `children` kills them all
  assert in_process.returncode == 0, err[-4000:]
  results = json.loads(next(l for l in out.splitlines() if l.startswith(RESULTS))[len(RESULTS):])
  for process in processes:
    assert cli_runs.wait(process, run_dir, timeout=900) == 0, cli_runs.log_tail(run_dir)

  single = results["single"]
  assert single["num_sharded_params"] == 0 and single["step"] == NUM_STEPS
  assert all(np.isfinite(single["losses"]))
  assert len(set(single["losses"])) == NUM_STEPS  # the model trains: losses move
  fsdp = results["data2_fsdp2"]
  assert fsdp["num_sharded_params"] > 10  # the FSDP rules actually sharded the model
  np.testing.assert_allclose(fsdp["embedding"], single["embedding"], rtol=0, atol=1e-6)
  records = cli_runs.records(run_dir)
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1)), cli_runs.log_tail(run_dir)
  assert "4 devices on 2 process(es)" in (run_dir / "process0.log").read_text()
  two_processes = {key: [r[field] for r in records] for field, key in COMPARED_METRICS.items()}
  for name, got in (("data2_fsdp2", fsdp), ("2_processes", two_processes)):
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["grad_norms"], single["grad_norms"], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["retained"], single["retained"], rtol=0, atol=1e-6,
                               err_msg=name)
  # The same mesh in one process and in two: every logged metric within 1e-6.
  for key in COMPARED_METRICS.values():
    np.testing.assert_allclose(two_processes[key], fsdp[key], rtol=0, atol=1e-6, err_msg=key)


class _FakeMesh:  # param_partition_spec reads only the axis sizes
  def __init__(self, fsdp, tensor):
    self.shape = {"data": 1, "fsdp": fsdp, "tensor": tensor}


@pytest.mark.parametrize("path,shape,fsdp,tensor,expected", [
    ("embed/embedding", (32000, 1024), 2, 2, ("tensor", "fsdp")),
    ("lm_head", (2048, 32000), 4, 2, ("fsdp", "tensor")),
    ("groups/blocks/1/mixer/proj/q_proj/kernel", (12, 1024, 1024), 4, 2, (None, "fsdp", "tensor")),
    ("groups/blocks/1/mlp/down_proj/kernel", (12, 2816, 1024), 4, 2, (None, "tensor", "fsdp")),
    ("groups/blocks/0/mixer/A_log", (12, 8), 4, 1, (None, "fsdp")),  # never the scanned axis
    ("groups/blocks/0/mixer/A_log", (12, 6), 4, 1, (None, None)),  # nothing divisible
    ("final_norm/weight", (1024,), 1, 1, (None,)),
    ("0/mu/groups/blocks/0/mlp/up_proj/kernel", (12, 1024, 2816), 2, 2,
     (None, "fsdp", "tensor")),  # optimizer moments follow their parameter
    ("1/count", (), 4, 2, ()),
])
def test_param_partition_specs(path, shape, fsdp, tensor, expected):
  from lalte_jax.train.sharding import param_partition_spec  # pylint: disable=import-outside-toplevel
  assert tuple(param_partition_spec(path, shape, _FakeMesh(fsdp, tensor))) == expected


if __name__ == "__main__":
  _child()
