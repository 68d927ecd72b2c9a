"""Choosing an op's implementation: one rule shared by every op folder.

Names: "xla" (plain jnp lowered by XLA, every op has it: the reference, or for the decode ops
that read a cache a blocked reading of it, `stacked.py`), "pallas" (our Pallas kernels, Triton
backend on GPU) and "cudnn" (a cuDNN kernel reached through a JAX API). Naming a version that
the op does not have raises `NotImplementedError`; a name outside these three raises `ValueError`.

`implementation=None` runs "xla" off the GPU (Pallas there would run in interpret mode, which exists
for tests, not for speed). On the GPU it runs the op's default: a preference list, fastest first,
that each op declares in one place in its `__init__.py` (`GPU_DEFAULT`, or a `gpu_default`
function where the choice depends on the inputs); a version that raises NotImplementedError for the
given inputs (a head dim it does not tile, say) hands them to the next one in the list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeVar

import jax

Implementation = Literal["xla", "pallas", "cudnn"] | None
KNOWN_IMPLEMENTATIONS = ("xla", "pallas", "cudnn")

F = TypeVar("F", bound=Callable)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(op_name: str, implementation: Implementation, versions: Mapping[str, F], *,
            gpu_default: Sequence[str]) -> F:
  """Returns the version of `op_name` that `implementation` names (see module doc).

  gpu_default: the names that implementation=None tries on the GPU, fastest first.
  """
  if implementation is None:
    if not on_gpu():
      return versions["xla"]
    candidates = [versions[name] for name in gpu_default]
    return candidates[0] if len(candidates) == 1 else _first_that_handles(op_name, candidates)
  if implementation not in KNOWN_IMPLEMENTATIONS:
    raise ValueError(
        f"{op_name}: implementation={implementation!r} is unknown; expected one of"
        f" {KNOWN_IMPLEMENTATIONS} or None")
  if implementation not in versions:
    raise NotImplementedError(
        f"{op_name}: implementation={implementation!r} does not exist for this op; available:"
        f" {sorted(versions)}")
  return versions[implementation]


def _first_that_handles(op_name: str, candidates: list[F]) -> F:
  """Calls the candidates in order until one accepts the inputs. Versions refuse inputs with
  NotImplementedError while tracing, before any work is launched, so trying the next is free."""
  def call(*args, **kwargs):
    reasons = []
    for version in candidates:
      try:
        return version(*args, **kwargs)
      except NotImplementedError as error:
        reasons.append(str(error))
    raise NotImplementedError(f"{op_name}: no version handles these inputs: {reasons}")
  return call  # type: ignore[return-value]
