"""Wall-clock timing for the kernel benchmarks (tools/bench_attention.py, tools/compare_fla.py).

`median_ms` times one function alone; `paired_ms` times two in alternation (one pass of each over
its input sets per round), so both see the same GPU clocks and the ratio of their medians is
what a benchmark reports. Timed apart, the same kernel read up to ~15% differently within one run
on an H100, and the first function timed in a fresh process ran slowest while the clocks ramped
up (H100, 2026-11-22, docs/benchmarks.md). `sync` blocks until a pass's work is done: jax's
block_until_ready for JAX, a torch.cuda.synchronize wrapper for PyTorch.

`kernel_times` traces passes with jax.profiler (`traced_passes`) and sums their GPU kernels
(`device_events`) per kernel name; tools/step_profile.py classifies the same events by the HLO
instruction each ran.
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


def looped_copy(copy: Timed, rounds: int) -> Timed:
  """A one-argument `copy` (e.g. a jitted `x + 1`) run `rounds` times in one jitted call: the
  anchor of a looped decode timing, which pays one dispatch per `rounds` steps the same way."""
  (x,), = copy.input_sets
  step = copy.fn
  return Timed(jax.jit(lambda x: jax.lax.fori_loop(0, rounds, lambda _, x: step(x), x)), [(x,)])


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
  """One kernel (GPU stream) or XLA thunk (CPU) of a trace, and the HLO instruction it ran."""
  name: str
  start_ns: float
  duration_ns: float
  hlo_op: str | None = None  # the profiler's `hlo_op` stat, where it records one
  hlo_module: str | None = None  # the profiler's `hlo_module` stat
  plane: str = ""  # the device's plane: "/device:GPU:0", ... ("/host:CPU" for CPU thunks)


def device_events(profile, *, cpu_thunks: bool = False) -> list[DeviceEvent]:
  """The kernel events of the GPU planes' stream lines of a `jax.profiler.ProfileData`, or with
  `cpu_thunks` the CPU backend's XLA thunks instead (the host threads' events that carry an
  `hlo_op` stat), so that a CPU run can go through the same analysis."""
  events = []
  for plane in profile.planes:
    if cpu_thunks and plane.name == "/host:CPU":
      for line in plane.lines:
        events.extend(event for event in (_device_event(e, plane.name) for e in line.events)
                      if event.hlo_op)
    elif not cpu_thunks and plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        if line.name.startswith("Stream"):  # the derived "XLA Ops"/"XLA Modules" lines repeat
          events.extend(_device_event(event, plane.name) for event in line.events)
  return events


def _device_event(event, plane: str) -> DeviceEvent:
  stats = dict(event.stats)
  op, module = stats.get("hlo_op"), stats.get("hlo_module")
  return DeviceEvent(name=event.name, start_ns=event.start_ns, duration_ns=event.duration_ns,
                     hlo_op=str(op) if op else None, hlo_module=str(module) if module else None,
                     plane=plane)


@dataclasses.dataclass(frozen=True)
class KernelTimes:
  """Device time per pass of one profiled function, from the profiler's GPU stream events."""
  wall_us: float  # host wall time per pass (dispatch to sync), profiler on
  span_us: float  # first kernel start to last kernel end on the GPU, per pass
  busy_us: float  # sum of kernel durations per pass (overlapping kernels counted twice)
  kernels: dict[str, tuple[float, float]]  # kernel name -> (launches, device us) per pass


def kernel_times_from_profile(profile, passes: int, wall_s: float) -> KernelTimes:
  """Sums the kernel events of the GPU planes' stream lines of a `jax.profiler.ProfileData`."""
  events = device_events(profile)
  if not events:
    raise RuntimeError("the profile has no GPU kernel events (no GPU, or no CUPTI in this"
                       " environment); planes: " + ", ".join(p.name for p in profile.planes))
  launches, durations_ns = {}, {}
  for event in events:
    launches[event.name] = launches.get(event.name, 0) + 1
    durations_ns[event.name] = durations_ns.get(event.name, 0) + event.duration_ns
  kernels = {name: (launches[name] / passes, durations_ns[name] / 1e3 / passes)
             for name in sorted(durations_ns, key=durations_ns.get, reverse=True)}
  span_ns = (max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events))
  return KernelTimes(wall_us=wall_s * 1e6 / passes, span_us=span_ns / 1e3 / passes,
                     busy_us=sum(us for _, us in kernels.values()), kernels=kernels)


def traced_passes(timed: Timed, *, passes: int, warmup: int = 2, keep_trace: str | None = None,
                  profiler_options=None):
  """(`jax.profiler.ProfileData`, wall seconds) of `passes` passes of `timed` traced with
  jax.profiler (CUPTI on a GPU), after `warmup` untraced passes.

  keep_trace: also copy the trace (.xplane.pb, host threads included) to this path.
  profiler_options: a `jax.profiler.ProfileOptions` (None: JAX's defaults).
  """
  for _ in range(warmup):
    timed.one_pass()
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, profiler_options=profiler_options):
      wall_s = sum(timed.one_pass() for _ in range(passes))
    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
      raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    if keep_trace:
      shutil.copyfile(files[0], keep_trace)
    return jax.profiler.ProfileData.from_file(files[0]), wall_s


def kernel_times(timed: Timed, *, passes: int, warmup: int = 2,
                 keep_trace: str | None = None) -> KernelTimes:
  """Per-kernel GPU time of `passes` passes of `timed`, traced with jax.profiler (CUPTI).

  What wall-clock medians cannot tell apart: which kernels of a jitted call take the time, and
  how much of the call the GPU is idle (launch gaps, host dispatch). Spans and walls include the
  profiler's own overhead, so compare kernel times, not walls, with untraced runs.
  keep_trace: also copy the trace (.xplane.pb, host threads included) to this path.
  """
  profile, wall_s = traced_passes(timed, passes=passes, warmup=warmup, keep_trace=keep_trace)
  return kernel_times_from_profile(profile, passes, wall_s)
