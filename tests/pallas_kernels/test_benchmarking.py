"""pallas_kernels.benchmarking: the kernel benchmarks' timing (CPU)."""

import jax
import jax.numpy as jnp
import pytest

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


# Two kernels on one GPU stream (the first launch with its HLO instruction's stats), the derived
# "XLA Ops" line (a repeat of the stream's kernels, to be ignored) and a host plane, as a 2-pass
# CUPTI trace would have them.
GPU_TRACE = """
planes { name: "/device:GPU:0"
  lines { name: "Stream #1(Compute)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000
             stats { metadata_id: 7 str_value: "custom-call.3" }
             stats { metadata_id: 8 str_value: "jit_step" } }
    events { metadata_id: 2 offset_ps: 6000000 duration_ps: 2000000 }
    events { metadata_id: 1 offset_ps: 9000000 duration_ps: 5000000 } }
  lines { name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 5000000 } }
  event_metadata { key: 1 value { id: 1 name: "decode_attention" } }
  event_metadata { key: 2 value { id: 2 name: "fusion" } }
  stat_metadata { key: 7 value { id: 7 name: "hlo_op" } }
  stat_metadata { key: 8 value { id: 8 name: "hlo_module" } } }
planes { name: "/host:CPU" }
"""

# The CPU backend's trace: an XLA thunk (with an hlo_op stat) and its end marker on a worker
# thread, and a Python call on the main thread.
CPU_TRACE = """
planes { name: "/host:CPU"
  lines { name: "tf_XLAPjRtCpuClient/1" timestamp_ns: 2000
    events { metadata_id: 1 offset_ps: 1000000 duration_ps: 3000000
             stats { metadata_id: 7 str_value: "dot.3" }
             stats { metadata_id: 8 str_value: "jit_f" } }
    events { metadata_id: 2 offset_ps: 4000000 duration_ps: 1000000 } }
  lines { name: "python" timestamp_ns: 2000
    events { metadata_id: 3 offset_ps: 0 duration_ps: 9000000 } }
  event_metadata { key: 1 value { id: 1 name: "dot.3" } }
  event_metadata { key: 2 value { id: 2 name: "end: dot.3" } }
  event_metadata { key: 3 value { id: 3 name: "PjitFunction(f)" } }
  stat_metadata { key: 7 value { id: 7 name: "hlo_op" } }
  stat_metadata { key: 8 value { id: 8 name: "hlo_module" } } }
"""


def profile_of(text_proto):
  return jax.profiler.ProfileData.from_serialized_xspace(
      jax.profiler.ProfileData.text_proto_to_serialized_xspace(text_proto))


def test_device_events_carry_the_hlo_instruction_where_the_trace_names_it():
  events = benchmarking.device_events(profile_of(GPU_TRACE))
  assert {e.plane for e in events} == {"/device:GPU:0"}
  assert [(e.name, e.start_ns, e.duration_ns, e.hlo_op, e.hlo_module) for e in events] == [
      ("decode_attention", 1000, 5000, "custom-call.3", "jit_step"),
      ("fusion", 7000, 2000, None, None), ("decode_attention", 10000, 5000, None, None)]
  assert benchmarking.device_events(profile_of(GPU_TRACE), cpu_thunks=True) == []


def test_device_events_of_the_cpu_backend_are_its_xla_thunks():
  profile = profile_of(CPU_TRACE)
  assert benchmarking.device_events(profile) == []
  assert benchmarking.device_events(profile, cpu_thunks=True) == [benchmarking.DeviceEvent(
      name="dot.3", start_ns=3000, duration_ns=3000, hlo_op="dot.3", hlo_module="jit_f",
      plane="/host:CPU")]


def test_kernel_times_from_profile_sums_stream_kernels_per_pass():
  times = benchmarking.kernel_times_from_profile(profile_of(GPU_TRACE), passes=2, wall_s=1e-3)
  # Largest first; per pass: 2 x 5 us of decode_attention / 2, one 2 us fusion / 2.
  assert list(times.kernels.items()) == [("decode_attention", (1.0, 5.0)), ("fusion", (0.5, 1.0))]
  assert times.busy_us == 6.0
  assert times.span_us == 7.0  # 0 .. 14 us over two passes
  assert times.wall_us == 500.0


def test_kernel_times_names_the_planes_when_there_are_no_gpu_kernels():
  profile = profile_of('planes { name: "/host:CPU" }')
  with pytest.raises(RuntimeError, match="no GPU kernel events.*/host:CPU"):
    benchmarking.kernel_times_from_profile(profile, passes=1, wall_s=1.0)


def test_kernel_times_traces_a_real_run_on_cpu_and_reports_no_gpu():
  timed = benchmarking.Timed(jax.jit(lambda x: x * 2), [(jnp.ones(8),)])
  with pytest.raises(RuntimeError, match="no GPU kernel events"):
    benchmarking.kernel_times(timed, passes=1, warmup=1)
