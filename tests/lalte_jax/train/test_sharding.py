"""Sharded training equals single-device training: 4 CPU devices in one process, and 2 processes
x 2 devices through `jax.distributed` on localhost; the parameter layout rules.

The runs happen in child processes (XLA's device count is fixed when the backend starts, and
`jax.distributed` can start once per process); each prints its losses as one JSON line. The
multi-process children take their distributed timeouts from `DISTRIBUTED_ENV`
(tests/child_processes.py), generous enough for a loaded 2-core machine.
"""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from lalte_jax.train import distributed
from tests.child_processes import DISTRIBUTED_ENV, child_env

REPO = pathlib.Path(__file__).resolve().parents[3]
# The optional tensor axis is covered by the layout test below; a third compiled mesh here would
# cost a minute of CI time for rules that XLA partitions correctly whatever they say.
MESHES = {"single": None, "data2_fsdp2": (2, 2, 1)}
NUM_STEPS = 3


def _child(process_id: int | None, port: int | None) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  from lalte_jax.train import distributed, sharding  # pylint: disable=import-outside-toplevel
  if process_id is not None:
    distributed.initialize_distributed(f"localhost:{port}", 2, process_id)
  from lalte_jax.train.config import TrainConfig  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.metrics import MetricsLogger  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel

  assert jax.device_count() == 4, jax.devices()
  # float32 so that 1e-6 is meaningful; router dropout stays on (keys do not depend on layout);
  # two micro-batches exercise the accumulation layout on the mesh.
  config = TrainConfig(variant="lalte", size="tiny", model_dtype="float32", data="mqar",
                       seq_len=64, mqar_num_kv_pairs=4, global_batch_size=8, grad_accum_steps=2,
                       steps=10, warmup_steps=2, lr=3e-3, progress_bar=False, tensorboard=False)
  meshes = MESHES if process_id is None else {"data2_fsdp2": MESHES["data2_fsdp2"]}
  results, initial_state = {}, None
  for name, shape in meshes.items():
    mesh = (sharding.make_mesh(devices=jax.devices()[:1]) if shape is None
            else sharding.make_mesh(*shape))
    # Every single-process run starts from the single-device initial state, resharded.
    trainer = Trainer(config, mesh=mesh, state=initial_state,
                      logger=MetricsLogger("", total_steps=1, enabled=False))
    if initial_state is None and process_id is None:
      initial_state = jax.device_get(trainer.state)
    sharded = [p for p, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.params)
               if any(axis is not None for axis in leaf.sharding.spec)]
    losses, norms = [], []
    for _ in range(NUM_STEPS):
      metrics = sharding.to_host(trainer.train_step(next(trainer.data_iterator)))
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
    results[name] = {"losses": losses, "grad_norms": norms, "num_sharded_params": len(sharded),
                     "retained": metrics["lte_retained"].tolist(),
                     "step": int(sharding.to_host(trainer.state.step))}
    if process_id is None:
      embedding = jax.device_get(trainer.state.params["embed"]["embedding"])
      results[name]["embedding"] = embedding[:4].tolist()
  print("RESULTS " + json.dumps(results), flush=True)


def _start(children, device_count: int, *args) -> subprocess.Popen:
  env = child_env(devices=device_count, **DISTRIBUTED_ENV)
  return children.start([sys.executable, __file__, *map(str, args)], env=env, cwd=REPO,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(proc: subprocess.Popen) -> dict:
  out, err = proc.communicate(timeout=900)  # on a timeout the `children` fixture kills them all
  assert proc.returncode == 0, err[-4000:]
  line = next(l for l in out.splitlines() if l.startswith("RESULTS "))
  return json.loads(line[len("RESULTS "):])



@pytest.mark.slow
def test_sharded_and_multiprocess_steps_equal_single_device(children):
  port = distributed.free_port()
  procs = [_start(children, 4)] + [_start(children, 2, process_id, port)
                                   for process_id in (0, 1)]
  results, *per_process = [_results(proc) for proc in procs]
  single = results["single"]
  assert single["num_sharded_params"] == 0 and single["step"] == NUM_STEPS
  assert all(np.isfinite(single["losses"]))
  runs = {"data2_fsdp2": results["data2_fsdp2"]}
  runs.update({f"process{i}_of_2": r["data2_fsdp2"] for i, r in enumerate(per_process)})
  for name, got in runs.items():
    assert got["num_sharded_params"] > 10, name  # the FSDP rules actually sharded the model
    np.testing.assert_allclose(got["losses"], single["losses"], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["grad_norms"], single["grad_norms"], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["retained"], single["retained"], rtol=0, atol=1e-6,
                               err_msg=name)
    if "embedding" in got:
      np.testing.assert_allclose(got["embedding"], single["embedding"], rtol=0, atol=1e-6)


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
  if len(sys.argv) == 3:
    _child(int(sys.argv[1]), int(sys.argv[2]))
  else:
    _child(None, None)
