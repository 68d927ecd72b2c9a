"""Choosing an op's implementation: one rule shared by every op folder.

`implementation=None` picks the fastest version registered for the current platform and falls back
to "xla" (the jnp reference lowered by XLA). Naming a version that the op does not have raises
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
    if on_gpu():
      for name in GPU_PREFERENCE:
        if name in versions:
          return versions[name]
    return versions["xla"]
  if implementation not in KNOWN_IMPLEMENTATIONS:
    raise ValueError(
        f"{op_name}: implementation={implementation!r} is unknown; expected one of"
        f" {KNOWN_IMPLEMENTATIONS} or None")
  if implementation not in versions:
    raise NotImplementedError(
        f"{op_name}: implementation={implementation!r} does not exist yet; available:"
        f" {sorted(versions)}")
  return versions[implementation]
