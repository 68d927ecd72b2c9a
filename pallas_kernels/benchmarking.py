"""Wall-clock timing for the kernel benchmarks (tools/bench_attention.py, tools/compare_fla.py).

`median_ms` times one function alone; `paired_ms` times two in alternation (one pass of each over
its input sets per round), so both see the same GPU clocks and the ratio of their medians is
what a benchmark reports. Timed apart, the same kernel read up to ~15% differently within one run
on an H100, and the first function timed in a fresh process ran slowest while the clocks ramped
up (H100, 2026-11-22, docs/benchmarks.md). `sync` blocks until a pass's work is done: jax's
block_until_ready for JAX, a torch.cuda.synchronize wrapper for PyTorch.
"""

from __future__ import annotations

import dataclasses
import glob
import shutil
import statistics
import tempfile
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


@dataclasses.dataclass(frozen=True)
class KernelTimes:
  """Device time per pass of one profiled function, from the profiler's GPU stream events."""
  wall_us: float  # host wall time per pass (dispatch to sync), profiler on
  span_us: float  # first kernel start to last kernel end on the GPU, per pass
  busy_us: float  # sum of kernel durations per pass (overlapping kernels counted twice)
  kernels: dict[str, tuple[float, float]]  # kernel name -> (launches, device us) per pass


def kernel_times_from_profile(profile, passes: int, wall_s: float) -> KernelTimes:
  """Sums the kernel events of the GPU planes' stream lines of a `jax.profiler.ProfileData`."""
  launches, durations_ps, starts, ends = {}, {}, [], []
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):
        continue  # the derived "XLA Ops"/"XLA Modules" lines repeat the stream's kernels
      for event in line.events:
        launches[event.name] = launches.get(event.name, 0) + 1
        durations_ps[event.name] = durations_ps.get(event.name, 0) + event.duration_ns * 1e3
        starts.append(event.start_ns)
        ends.append(event.start_ns + event.duration_ns)
  if not launches:
    raise RuntimeError("the profile has no GPU kernel events (no GPU, or no CUPTI in this"
                       " environment); planes: " + ", ".join(p.name for p in profile.planes))
  kernels = {name: (launches[name] / passes, durations_ps[name] / 1e6 / passes)
             for name in sorted(durations_ps, key=durations_ps.get, reverse=True)}
  return KernelTimes(wall_us=wall_s * 1e6 / passes,
                     span_us=(max(ends) - min(starts)) / 1e3 / passes,
                     busy_us=sum(us for _, us in kernels.values()), kernels=kernels)


def kernel_times(timed: Timed, *, passes: int, warmup: int = 2,
                 keep_trace: str | None = None) -> KernelTimes:
  """Per-kernel GPU time of `passes` passes of `timed`, traced with jax.profiler (CUPTI).

  What wall-clock medians cannot tell apart: which kernels of a jitted call take the time, and
  how much of the call the GPU is idle (launch gaps, host dispatch). Spans and walls include the
  profiler's own overhead, so compare kernel times, not walls, with untraced runs.
  keep_trace: also copy the trace (.xplane.pb, host threads included) to this path.
  """
  for _ in range(warmup):
    timed.one_pass()
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      wall_s = sum(timed.one_pass() for _ in range(passes))
    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
      raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    if keep_trace:
      shutil.copyfile(files[0], keep_trace)
    profile = jax.profiler.ProfileData.from_file(files[0])
    return kernel_times_from_profile(profile, passes, wall_s)
