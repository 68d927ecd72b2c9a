"""Kernels run per shard under a mesh (`lalte_jax.sharding.per_shard`).

The loss and gradients of tiny hybrids without a mesh and under a data x tensor mesh, where every
mixer kernel must sit inside a `shard_map` (rows split over data, heads over tensor). On the CPU a
child process with 4 devices runs it (XLA's device count is fixed when its backend starts) and
prints the comparison as one JSON line; on a machine with several GPUs it runs in the test process
with the platform's default kernels (Triton).
"""

import json
import pathlib
import sys

import pytest
from tests.child_processes import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
# variant -> kernel implementation of its mixers; laLTE runs the Pallas kernels (interpret mode on
# the CPU) so the per-shard path is the one GPUs take; laNSA covers the NSA call site (the plain
# attention mixer's call is the LTE one without the kept flags).
CASES = {"lalte-tiny": "pallas", "lansa-tiny": "xla"}


def compare(cases: dict[str, str | None], mesh_shape: tuple[int, int, int]) -> dict:
  """variant -> {loss_err, grad_err, shard_maps, pallas_calls} of the mesh run against the plain one."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from lalte_jax.config import get_model_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.model import HybridLM  # pylint: disable=import-outside-toplevel
  from lalte_jax.train import model_overrides, sharding  # pylint: disable=import-outside-toplevel

  mesh = sharding.make_mesh(*mesh_shape, devices=jax.devices()[:int(np.prod(mesh_shape))])
  tokens = jax.random.randint(jax.random.key(1), (2 * mesh_shape[0], 64), 0, 256,
                              dtype=jnp.int32)
  results = {}
  for name, implementation in cases.items():
    config = get_model_config(name)
    config = model_overrides.apply(config, tuple(
        model_overrides.implementation_overrides(config, implementation).items()))
    graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))

    def loss(params, tokens):
      # With the LTE router's dropout on: its masks hash global rows, so a shard of rows draws
      # its part of the unsharded batch's masks.
      logits = nnx.merge(graphdef, params)(tokens, dropout_key=jax.random.key(2))
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

    loss_and_grad = jax.value_and_grad(loss)
    plain_loss, plain_grad = jax.jit(loss_and_grad)(params, tokens)
    sharded_tokens = jax.device_put(tokens, sharding.batch_sharding(mesh))
    sharded_params = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      closed = jax.make_jaxpr(loss_and_grad)(sharded_params, sharded_tokens)
      jaxpr = str(closed)
      mesh_loss, mesh_grad = jax.jit(loss_and_grad)(sharded_params, sharded_tokens)
    grad_err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(plain_grad), jax.tree.leaves(mesh_grad)))
    results[name] = {"loss_err": abs(float(plain_loss) - float(mesh_loss)),
                     "grad_err": grad_err, "shard_maps": jaxpr.count("shard_map["),
                     "pallas_calls": jaxpr.count("pallas_call["),
                     "pallas_calls_outside_shard_maps":
                         pallas_calls_outside_shard_maps(closed.jaxpr)}
  return results


def pallas_calls_outside_shard_maps(jaxpr, inside: bool = False) -> int:
  """Pallas calls of a jaxpr (its sub-jaxprs included) not nested in a shard_map: XLA would run
  each on the whole batch on every device."""
  from jax.extend import core  # pylint: disable=import-outside-toplevel
  count = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "pallas_call":
      count += not inside
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, core.Jaxpr):
          count += pallas_calls_outside_shard_maps(sub, inside or name == "shard_map")
  return count


def check(results: dict, tolerance: float) -> None:
  for name, got in results.items():
    # forward + backward of the scanned block's two mixers (GDN and the attention-like one)
    assert got["shard_maps"] >= 2, (name, got)
    assert got["loss_err"] < tolerance and got["grad_err"] < tolerance, (name, got)
    assert got["pallas_calls_outside_shard_maps"] == 0, (name, got)


@pytest.mark.slow
def test_mixer_kernels_run_per_shard_and_match_the_unsharded_model(children):
  env = child_env(devices=4)
  proc = children.run([sys.executable, __file__], env=env, cwd=REPO, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
  results = json.loads(line[len("RESULTS "):])
  check(results, 1e-5)
  assert results["lalte-tiny"]["pallas_calls"] > 0


@pytest.mark.gpu
def test_mixer_kernels_run_per_shard_on_several_gpus():
  import jax  # pylint: disable=import-outside-toplevel
  if jax.device_count() < 2:
    pytest.skip(f"needs >= 2 GPUs, found {jax.device_count()}")
  # float32 kernels with full-precision matmuls (tests/conftest.py): 1e-4 covers the Triton
  # kernels' own float32 rounding against the unsharded call of the same kernels.
  results = compare({name: None for name in CASES}, (jax.device_count(), 1, 1))
  check(results, 1e-4)
  assert all(got["pallas_calls"] > 0 for got in results.values()), results


if __name__ == "__main__":
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_default_matmul_precision", "highest")
  assert jax.device_count() == 4, jax.devices()
  print("RESULTS " + json.dumps(compare(CASES, (2, 1, 2))), flush=True)
