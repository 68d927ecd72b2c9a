"""How fast is JAX's own Mosaic GPU flash attention (warp-specialised, FA3-style) at our shape?

    python tools/probe_mgpu_attention.py

A probe before writing a Mosaic GPU version of our forward kernel: if
`jax.experimental.pallas.ops.gpu.attention_mgpu` (two compute warpgroups in ping-pong and a TMA
producer warpgroup) runs causal attention at B8 T4096 Hq32 Hkv8 D64 (float16: its shared-memory
buffers are float16) as fast per visited tile
as cuDNN, a windowed version of it would put the LTE prefill near 0.8x cuDNN SWA-1024 (832 of
1152 keys per query visited, plus the kept list); if it is no faster than our Triton kernel, that
route is closed. Forward only, each candidate timed in alternation with cuDNN causal.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_kernels.benchmarking import Timed, paired_ms, run_for_seconds
from pallas_kernels.masked_attention import masked_attention

BATCH, LENGTH, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4096, 32, 8, 64


def main() -> int:
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(0), 12)
  sets = [tuple(jax.random.normal(keys[3 * i + j], (BATCH, LENGTH, heads, HEAD_DIM), jnp.float16)
                for j, heads in enumerate((NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)))
          for i in range(4)]
  cudnn = Timed(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn")), sets)
  cudnn_swa = Timed(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn", local_window_size=(1023, 0))), sets)
  run_for_seconds(cudnn, seconds=3.0)
  candidates = {
      "ours (Pallas Triton) causal": lambda q, k, v: masked_attention(q, k, v,
                                                                      implementation="pallas"),
      "ours (Pallas Triton) SWA-769": lambda q, k, v: masked_attention(
          q, k, v, window_size=769, implementation="pallas"),
  }
  for block_kv in (64, 128):
    for steps in (2, 3, 4):
      config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv,
                                           max_concurrent_steps=steps, causal=True)
      candidates[f"attention_mgpu causal block_kv {block_kv} steps {steps}"] = (
          lambda q, k, v, config=config: attention_mgpu.attention(q, k, v, config))
  reference = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"))(*sets[0]).astype(jnp.float32)
  print(f"device {jax.devices()[0].device_kind}, B{BATCH} T{LENGTH} Hq{NUM_Q_HEADS}"
        f" Hkv{NUM_KV_HEADS} D{HEAD_DIM} float16 (attention_mgpu stages float16 only), forward")
  swa_ms, causal_ms = paired_ms(cudnn_swa, cudnn, warmup=3, rounds=10)
  print(f"cuDNN SWA-1024 {swa_ms:.3f} ms, cuDNN causal {causal_ms:.3f} ms")
  for name, fn in candidates.items():
    try:
      jitted = jax.jit(fn)
      error = float(jnp.max(jnp.abs(jitted(*sets[0]).astype(jnp.float32) - reference)))
      ms, anchor_ms = paired_ms(Timed(jitted, sets), cudnn, warmup=3, rounds=10)
      print(f"{name}: {ms:.3f} ms, {ms / anchor_ms:.2f}x cuDNN causal"
            f" (paired {anchor_ms:.3f} ms), max abs diff {error:.1e}", flush=True)
    except Exception as error:  # pylint: disable=broad-except
      print(f"{name}: FAILED {str(error)[:1500]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
