"""Does cuDNN's SWA attention run under shard_map on several GPUs? Each variant in its own process.

    python tools/repro_cudnn_multigpu.py            # every variant, one child process each
    python tools/repro_cudnn_multigpu.py --variant cudnn

On 2026-11-23 the gdn_swa-0.4b FSDP step (2 x H200) died with SIGSEGV while lalte-0.4b ran; the SWA
layers of the first went to cuDNN, the LTE layers of the second to our Pallas kernels. This
isolates that call: a jitted forward + backward of SWA-1024 attention at 2 rows of T4096 Hq32 Hkv8
D64 bf16 per GPU, inside `jax.shard_map` over all GPUs (as `lalte_jax.sharding.per_shard` runs
it), five times. Variants:
  cudnn          jax.nn.dot_product_attention(implementation="cudnn"), XLA's defaults
  cudnn_no_cmdbuf  the same with XLA's command buffers off (--xla_gpu_enable_command_buffer=)
  default        our masked_attention with implementation=None (routes to cuDNN on one device,
                 to the Pallas kernels under a mesh of several)
A child that crashes shows as a negative exit status (-11: SIGSEGV).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS = ("cudnn", "cudnn_no_cmdbuf", "default")
ROWS_PER_GPU, LENGTH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, WINDOW = 2, 4096, 32, 8, 64, 1024


def run_variant(variant: str) -> None:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel

  from pallas_kernels.masked_attention import masked_attention  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("batch",), devices=devices)
  batch = ROWS_PER_GPU * len(devices)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (batch, LENGTH, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
  k, v = (jax.random.normal(key, (batch, LENGTH, NUM_KV_HEADS, HEAD_DIM), jnp.bfloat16)
          for key in keys[1:3])
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  rows = NamedSharding(mesh, P("batch"))
  q, k, v, do = (jax.device_put(x, rows) for x in (q, k, v, do))

  if variant.startswith("cudnn"):
    attention = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn", local_window_size=(WINDOW - 1, 0))
  else:
    attention = lambda q, k, v: masked_attention(q, k, v, window_size=WINDOW)

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attention, q, k, v)
    return (out, *vjp(do))

  sharded = jax.jit(jax.shard_map(fwd_bwd, mesh=mesh, in_specs=(P("batch"),) * 4,
                                  out_specs=(P("batch"),) * 4, check_vma=False))
  with jax.set_mesh(mesh):
    for _ in range(5):
      outputs = sharded(q, k, v, do)
    jax.block_until_ready(outputs)
  print(f"{variant}: ok on {len(devices)} devices, |dq| mean"
        f" {float(jnp.mean(jnp.abs(outputs[1].astype(jnp.float32)))):.4g}", flush=True)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--variant", choices=VARIANTS, default=None,
                      help="run one variant in this process (default: each in a child)")
  args = parser.parse_args()
  if args.variant:
    run_variant(args.variant)
    return 0
  failures = 0
  for variant in VARIANTS:
    env = dict(os.environ)
    if variant == "cudnn_no_cmdbuf":
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    start = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--variant", variant], env=env,
                           capture_output=True, text=True, check=False)
    print(f"{variant}: exit {child.returncode} after {time.perf_counter() - start:.1f} s")
    if child.returncode:
      failures += 1
      print("\n".join((child.stdout + child.stderr).splitlines()[-15:]))
    else:
      print(child.stdout.strip())
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
