"""Random parameters of tiny models, and checkpoints written from them, for the convert tests."""

from __future__ import annotations

import jax
import numpy as np

from lalte_jax.convert import write_hf
from lalte_jax.inference import checkpoint


def random_params(config, seed: int = 0, scale: float = 0.1) -> dict:
  """Our pure param dict with every entry random (norm weights and biases too), so that a tensor
  placed at the wrong spot or in the wrong layout changes the outputs."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(np.float32),
                      checkpoint.param_shapes(config))


def write_checkpoint(config, directory, seed: int = 0, **kwargs) -> dict:
  params = random_params(config, seed)
  write_hf(config, params, directory, **kwargs)
  return params


def same_params(a: dict, b: dict) -> bool:
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  return tree_a == tree_b and all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b))
