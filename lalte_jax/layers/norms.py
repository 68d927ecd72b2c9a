"""RMSNorm: statistics in float32, output in the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def inverse_rms(x32: jax.Array, eps: float) -> jax.Array:
  """1 / sqrt(mean(x^2, -1) + eps) of a float32 x, keeping the reduced axis."""
  return jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2, -1) + eps), computed in float32."""
  x32 = x.astype(jnp.float32)
  return x32 * inverse_rms(x32, eps)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * weight over the last axis; weight starts at 1, no bias."""

  def __init__(self, dim: int, *, eps: float = 1e-6):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

  def __call__(self, x: jax.Array) -> jax.Array:
    return (rms_normalize(x, self.eps) * self.weight[...]).astype(x.dtype)
