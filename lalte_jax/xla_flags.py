"""XLA flags that the entry points set in the environment before JAX creates its backends.

XLA reads `XLA_FLAGS` once, when the first backend starts, so every command-line tool calls
`apply_workarounds()` at import time, before anything touches a device. It overrides nothing: a
flag that `XLA_FLAGS` already names keeps the user's value.

`REPRODUCIBLE_GPU`: flags for bit-for-bit repeatable GPU training, the same numbers whatever the
process layout (one process over N GPUs, or N processes of one GPU each, as a multi-host job):
- `--xla_gpu_deterministic_ops=true`: scatters and reductions without atomics, and no autotuning
  (its choices follow timings, so they differ between runs and between processes);
- `--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false`: every all-reduce through NCCL.
  Where one process holds every GPU of a reduction, XLA otherwise sums small all-reduces with its
  own one-shot Triton kernel, in another order than NCCL's ring, which a multi-process job cannot
  use.
The trainer's `reproducible=true` sets them (docs/benchmarks.md, section 6.1, measures them).

`SERVING_GPU`: what the serving entry points (`python -m lalte_jax.generate`, the decode and
serving benchmarks) set, through `apply_serving()`:
- `--xla_gpu_graph_enable_concurrent_region=true`: a CUDA graph runs a step's independent
  kernels side by side instead of one after another. XLA's GPU runtime reads this from the
  process's flags, not from a program's compile options (set as a compile option it changed
  nothing). One H200, 2026-11-29, lalte-1.4b after a 4K prompt, bf16 parameters, one process
  with and one without: decode step at batch 1 4.41 -> 2.88 ms, at batch 32 3.78 -> 3.60 ms;
  `generate` 1.90 -> 1.61 ms a token at batch 1, 2.65 -> 2.43 at batch 32. It costs memory in
  the programs of large batches: the B32 4K prefill 10.9 -> 12.7 GiB (the decode step's is
  unchanged), and a training step 18.4 -> 26.2 GiB (gdn_swa-0.4b at B4, for 3% more tokens/s),
  which is why training does not set it. A user's own XLA_FLAGS setting wins.

Workarounds (CPU backend only; GPUs ignore them):
- `--xla_cpu_use_xnnpack=false`: XLA:CPU in jaxlib 0.10.2 can deadlock (every thread idle,
  `block_until_ready` never returns) when its XNNPACK fusions run on a small thread pool, as on
  2-core machines; seen with the tiny laLTE train step.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CPU_WORKAROUNDS = ("--xla_cpu_use_xnnpack=false",)
SERVING_GPU = ("--xla_gpu_graph_enable_concurrent_region=true",)
REPRODUCIBLE_GPU = ("--xla_gpu_deterministic_ops=true",
                    "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false")


def _name(flag: str) -> str:
  return flag.split("=", 1)[0]


def with_flags(text: str, *flags: str, replace: bool = False) -> str:
  """`text` (an XLA_FLAGS value) with `flags` added. A flag whose name `text` already holds is
  kept as it is there, unless `replace`, which drops the old setting for the new one."""
  names = {_name(flag) for flag in flags}
  kept = [item for item in text.split() if not (replace and _name(item) in names)]
  present = {_name(item) for item in kept}
  return " ".join(kept + [flag for flag in flags if _name(flag) not in present])


def without_flags(text: str, *flags: str) -> str:
  """`text` without the settings of the flags named in `flags` (values are ignored)."""
  names = {_name(flag) for flag in flags}
  return " ".join(item for item in text.split() if _name(item) not in names)


def apply(*flags: str, environ: MutableMapping[str, str] = os.environ,
          replace: bool = False) -> None:
  """Adds `flags` to `environ["XLA_FLAGS"]` (flags already named there keep their value, unless
  `replace`)."""
  environ["XLA_FLAGS"] = with_flags(environ.get("XLA_FLAGS", ""), *flags, replace=replace)


def missing(*flags: str, environ: MutableMapping[str, str] = os.environ) -> list[str]:
  """The settings of `flags` (name=value) that `environ["XLA_FLAGS"]` does not hold."""
  present = set(environ.get("XLA_FLAGS", "").split())
  return [flag for flag in flags if flag not in present]


def apply_workarounds(environ: MutableMapping[str, str] = os.environ) -> None:
  """The platform workarounds above; call before JAX creates a backend."""
  apply(*CPU_WORKAROUNDS, environ=environ)


def apply_serving(environ: MutableMapping[str, str] = os.environ) -> None:
  """The workarounds and SERVING_GPU; call before JAX creates a backend."""
  apply(*CPU_WORKAROUNDS, *SERVING_GPU, environ=environ)
