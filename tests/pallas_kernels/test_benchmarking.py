"""pallas_kernels.benchmarking: the kernel benchmarks' timing (CPU)."""

import jax.numpy as jnp

from pallas_kernels import benchmarking


def test_paired_ms_times_both_functions_in_alternation():
  calls = []
  slow = lambda x: (calls.append("slow"), jnp.sum(jnp.ones((400, 400)) @ jnp.ones((400, 400))))[1]
  fast = lambda x: (calls.append("fast"), x + 1)[1]
  sets = [(jnp.float32(i),) for i in range(3)]
  slow_ms, fast_ms = benchmarking.paired_ms(benchmarking.Timed(slow, sets),
                                            benchmarking.Timed(fast, sets), warmup=1, rounds=4)
  assert slow_ms > 0 and fast_ms > 0
  # Each round (1 warm-up, 4 timed): the second over all sets, then the first over all sets.
  assert calls == (["fast"] * 3 + ["slow"] * 3) * 5


def test_median_ms_syncs_every_call():
  synced = []
  ms = benchmarking.median_ms(lambda x: x * 2, [(jnp.float32(1),), (jnp.float32(2),)], warmup=2,
                              repeats=3, sync=synced.append)
  assert ms >= 0 and [float(x) for x in synced] == [2.0, 4.0, 2.0, 4.0, 2.0]
