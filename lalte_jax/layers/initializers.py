"""Parameter initialisers of the reference (§1.4), as `jax.nn.initializers`-style functions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def normal(std: float):
  """Normal(0, std): every projection, conv and embedding of the reference (std 0.006)."""
  return jax.nn.initializers.normal(stddev=std)


def symmetric_uniform(bound: float):
  """U(-bound, bound)."""
  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)
  return init


def kaiming_uniform_bound(fan_in: int) -> float:
  """PyTorch's default Linear/Conv bound, kaiming-uniform with a = sqrt(5): 1 / sqrt(fan_in)."""
  return 1.0 / math.sqrt(fan_in)


def residual_output(std: float, fan_in: int, rescale_num_layers: int | None):
  """Init of o_proj / down_proj, whose outputs are added to the residual stream.

  Hybrid-family models (G17) use kaiming-uniform divided by sqrt(2 * num_layers); the others keep
  Normal(0, std).
  """
  if rescale_num_layers is None:
    return normal(std)
  return symmetric_uniform(kaiming_uniform_bound(fan_in) / math.sqrt(2 * rescale_num_layers))


def kaiming_normal_relu(fan_in: int):
  """Normal(0, sqrt(2 / fan_in)): the LTE router's conv and projection weights (§1.4)."""
  return jax.nn.initializers.normal(stddev=math.sqrt(2.0 / fan_in))
