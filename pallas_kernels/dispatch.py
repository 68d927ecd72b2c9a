"""Choosing an op's implementation: one rule shared by every op folder.

`implementation=None` picks the fastest version registered for the current platform and falls back
to "xla" (the jnp reference lowered by XLA); on GPU, a version that raises NotImplementedError for
the given inputs (a head dim it does not tile, say) hands them to the next one in preference order. Naming a version that the op does not have raises
`NotImplementedError`; a name that no op knows raises `ValueError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

import jax

Implementation = Literal["xla", "pallas", "triton"] | None
KNOWN_IMPLEMENTATIONS = ("xla", "pallas", "triton")
# Fastest first; consulted only on GPU. On CPU, None always means "xla" (Pallas there would run in
# interpret mode, which exists for tests, not for speed).
GPU_PREFERENCE = ("triton", "pallas", "xla")

F = TypeVar("F", bound=Callable)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(op_name: str, implementation: Implementation, versions: Mapping[str, F]) -> F:
  """Returns the version of `op_name` that `implementation` names (see module doc)."""
  if implementation is None:
    if not on_gpu():
      return versions["xla"]
    candidates = [versions[name] for name in GPU_PREFERENCE if name in versions]
    return candidates[0] if len(candidates) == 1 else _first_that_handles(op_name, candidates)
  if implementation not in KNOWN_IMPLEMENTATIONS:
    raise ValueError(
        f"{op_name}: implementation={implementation!r} is unknown; expected one of"
        f" {KNOWN_IMPLEMENTATIONS} or None")
  if implementation not in versions:
    raise NotImplementedError(
        f"{op_name}: implementation={implementation!r} does not exist yet; available:"
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
