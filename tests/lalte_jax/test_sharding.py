"""Kernels run per shard under a mesh (`lalte_jax.sharding.per_shard`).

A child process with 4 CPU devices (XLA's device count is fixed when its backend starts) runs the
loss and gradients of tiny hybrids without a mesh and under a data=2 x tensor=2 mesh, where every
mixer kernel must sit inside a `shard_map` (rows split over data, heads over tensor), and prints
the comparison as one JSON line.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# variant -> kernel implementation of its mixers; laLTE runs the Pallas kernels (interpret mode on
# the CPU) so the per-shard path is the one GPUs take; laNSA covers the NSA call site (the plain
# attention mixer's call is the LTE one without the kept flags).
CASES = {"lalte-tiny": "pallas", "lansa-tiny": "xla"}


def _child() -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from lalte_jax.config import get_model_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.model import HybridLM  # pylint: disable=import-outside-toplevel
  from train import model_overrides, sharding  # pylint: disable=import-outside-toplevel

  jax.config.update("jax_default_matmul_precision", "highest")
  assert jax.device_count() == 4, jax.devices()
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2)
  tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, 256, dtype=jnp.int32)
  results = {}
  for name, implementation in CASES.items():
    config = get_model_config(name)
    config = model_overrides.apply(config, tuple(
        model_overrides.implementation_overrides(config, implementation).items()))
    graphdef, params = nnx.split(HybridLM(config, rngs=nnx.Rngs(0)))

    def loss(params, tokens):
      logits = nnx.merge(graphdef, params)(tokens)
      return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

    loss_and_grad = jax.value_and_grad(loss)
    plain_loss, plain_grad = jax.jit(loss_and_grad)(params, tokens)
    sharded_tokens = jax.device_put(tokens, sharding.batch_sharding(mesh))
    sharded_params = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      jaxpr = str(jax.make_jaxpr(loss_and_grad)(sharded_params, sharded_tokens))
      mesh_loss, mesh_grad = jax.jit(loss_and_grad)(sharded_params, sharded_tokens)
    grad_err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(plain_grad), jax.tree.leaves(mesh_grad)))
    results[name] = {"loss_err": abs(float(plain_loss) - float(mesh_loss)),
                     "grad_err": grad_err, "shard_maps": jaxpr.count("shard_map["),
                     "pallas_calls": jaxpr.count("pallas_call[")}
  print("RESULTS " + json.dumps(results), flush=True)


@pytest.mark.slow
def test_mixer_kernels_run_per_shard_and_match_the_unsharded_model():
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_cpu_use_xnnpack=false")
  proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                        text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULTS "))
  results = json.loads(line[len("RESULTS "):])
  for name, got in results.items():
    # forward + backward of the scanned block's two mixers (GDN and the attention-like one)
    assert got["shard_maps"] >= 2, (name, got)
    assert got["loss_err"] < 1e-5 and got["grad_err"] < 1e-5, (name, got)
  assert results["lalte-tiny"]["pallas_calls"] > 0


if __name__ == "__main__":
  _child()
