"""Shared pieces of the kernel tests: the per-dtype tolerance table and comparison helpers.

A fast version is compared with its reference computed in float64 (or float32 where a reference
has no float64 path). Errors are relative to the reference's largest magnitude, so that tolerances
mean the same for outputs of any scale.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Relative error allowed against a float64 reference, by the dtype of the inputs.
#   float32: the rounding of a few hundred float32 additions and one triangular solve per chunk.
#   bfloat16: inputs rounded to 8 bits of mantissa; bf16 matmuls with float32 accumulation.
TOLERANCE = {
    jnp.dtype(jnp.float64): 1e-10,
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
    jnp.dtype(jnp.float16): 5e-3,
}


def tolerance(dtype) -> float:
  return TOLERANCE[jnp.dtype(dtype)]


def relative_error(actual, expected) -> float:
  """max |actual - expected| / max |expected|, computed in float64 on the host."""
  actual = np.asarray(actual).astype(np.float64)  # ml_dtypes makes bf16 arrays convertible
  expected = np.asarray(expected).astype(np.float64)
  assert actual.shape == expected.shape, (actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), "output has non-finite values"
  scale = max(np.max(np.abs(expected)), 1e-30)
  return float(np.max(np.abs(actual - expected)) / scale)


def assert_close(actual, expected, dtype, *, factor: float = 1.0, name: str = "output"):
  err = relative_error(actual, expected)
  tol = tolerance(dtype) * factor
  assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.1e} ({jnp.dtype(dtype)})"


@contextlib.contextmanager
def float64():
  """Enables float64 inside the block only (other tests keep JAX's float32 default)."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


# Decode ops read and write one layer group of caches stacked over the groups (`group=`).
POISONED_GROUPS = 3
GROUP = 1


def stacked_in_poison(x):
  """x as layer group GROUP of a stack of POISONED_GROUPS whose other groups hold NaN (-1 for
  integers): an op that reads another group's part returns NaN, one that writes it changes the
  poison (`assert_other_groups_untouched`)."""
  x = jnp.asarray(x)
  poison = jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else -1
  return jnp.full((POISONED_GROUPS, *x.shape), poison, x.dtype).at[GROUP].set(x)


def assert_other_groups_untouched(stacked):
  other = np.delete(np.asarray(stacked), GROUP, axis=0)
  if np.issubdtype(other.dtype, np.floating):
    assert np.isnan(other).all(), "another layer group's part was written"
  else:
    assert (other == -1).all(), "another layer group's part was written"
