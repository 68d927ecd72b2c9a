"""Wall-clock timing for the kernel benchmarks (tools/bench_attention.py, tools/compare_fla.py).

`median_ms` times one function alone; `paired_ms` times two in alternation (one pass of each over
its input sets per round), so both see the same GPU clocks and the ratio of their medians is
what a benchmark reports. Timed apart, the same kernel read up to ~15% differently within one run
on an H100, and the first function timed in a fresh process ran slowest while the clocks ramped
up (sessions 6-7, docs/benchmarks.md). `sync` blocks until a pass's work is done: jax's
block_until_ready for JAX, a torch.cuda.synchronize wrapper for PyTorch.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Timed:
  """A function, the argument tuples it cycles through, and how to wait for its results."""
  fn: Callable[..., Any]
  input_sets: Sequence[Sequence[Any]]
  sync: Callable[[Any], Any] = jax.block_until_ready

  def one_pass(self) -> float:
    """Seconds for one call per input set, back to back, then one sync."""
    start = time.perf_counter()
    outputs = [self.fn(*inputs) for inputs in self.input_sets]
    self.sync(outputs)
    return time.perf_counter() - start


def median_ms(fn, input_sets, *, warmup: int, repeats: int, sync=jax.block_until_ready) -> float:
  """Median wall time of fn(*inputs) in ms over `repeats` single calls (cycling through the input
  sets, each call synced), after `warmup` calls."""
  for i in range(warmup):
    sync(fn(*input_sets[i % len(input_sets)]))
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    sync(fn(*input_sets[i % len(input_sets)]))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def paired_ms(first: Timed, second: Timed, *, warmup: int, rounds: int) -> tuple[float, float]:
  """(first's, second's) ms per call: medians over `rounds` rounds of one pass of `second` then
  one of `first`, after `warmup` such rounds."""
  times = ([], [])
  for round_index in range(warmup + rounds):
    second_s = second.one_pass() / len(second.input_sets)
    first_s = first.one_pass() / len(first.input_sets)
    if round_index >= warmup:
      times[0].append(first_s)
      times[1].append(second_s)
  return 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1])


def run_for_seconds(timed: Timed, *, seconds: float) -> None:
  """Passes of `timed` until `seconds` of wall time have passed (sustained load before timing)."""
  end = time.perf_counter() + seconds
  while time.perf_counter() < end:
    timed.one_pass()
