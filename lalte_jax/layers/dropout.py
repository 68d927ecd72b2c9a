"""Dropout masks from a counter-based hash (pallas_kernels/counter_hash.py): cheap enough to draw
in the training step's forward pass and again in its rematerialised backward pass, and
reproducible inside a kernel.

`jax.random.bernoulli` runs threefry (20 rounds per pair of 32-bit words) for every element. The
LTE router draws three masks per layer call ([Hkv, B, T, C] for C = 2D, D, D/2) in the forward
pass, and the block's recomputation draws them again: at lalte-0.4b, B4 T4096 on one H200
(2026-11-29, tools/bench_router.py) the three threefry masks took 0.40 ms per call, these 0.18 ms,
and the training step went from 160.7 to 157.0 ms (tools/bench_train.py --profile). Here an
element's bits are a hash of its (token, unit) index and two seed words drawn from the key: one
mix per element, elementwise and fusable into the dropout's multiply.

A mask depends only on the key, the element's (token, unit) index and the rate, so the same key
drops the same units whatever the layout the activations are in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import counter_hash
from pallas_kernels.counter_hash import keep_threshold, mix32

__all__ = ["dropout", "keep_mask", "keep_threshold", "mix32"]


def keep_mask(key: jax.Array, shape: tuple[int, int, int, int], rate: float, *,
              layout: str = "BTKC") -> jax.Array:
  """Bool mask of `shape`: True where the unit survives dropout at `rate`
  (`counter_hash.keep_mask` of the key's seed words; `layout` names the axes, "BTKC" by
  default)."""
  return counter_hash.keep_mask(counter_hash.seed_words(key), shape, rate, layout=layout)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *, layout: str = "BTKC"
            ) -> jax.Array:
  """Inverted dropout of [B, T, K, C] activations (or another `layout` of the four axes);
  identity when `key` is None (evaluation) or the rate is 0."""
  if key is None or rate == 0.0:
    return x
  keep = keep_mask(key, x.shape, rate, layout=layout)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
