"""Dropout masks from a counter-based hash: cheap enough to draw in the training step's forward
pass and again in its rematerialised backward pass.

`jax.random.bernoulli` runs threefry (20 rounds per pair of 32-bit words) for every element. The
LTE router draws three masks per layer call ([Hkv, B, T, C] for C = 2D, D, D/2) in the forward
pass, and the block's recomputation draws them again: at lalte-0.4b, B4 T4096 on one H200
(2026-11-29, tools/bench_router.py) the three threefry masks took 0.40 ms per call, these 0.18 ms,
and the training step went from 160.7 to 157.0 ms (tools/bench_train.py --profile). Here an
element's 32 random bits are a hash of its index: two 32-bit seed words are drawn from the key
once, each token's index is mixed with the first, and each element adds its unit index
(head * C + channel) in the golden-ratio sequence and is mixed with the second; the mixer is
Wellons' `lowbias32` (an invertible xor-shift-multiply avalanche). That is one mix per element,
elementwise and fusable into the dropout's multiply, and it partitions over any mesh like the
iota it starts from (no generator state).

A mask depends only on the key, the element's (token, unit) index and the rate, so the same key
drops the same units whatever the layout the activations are in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)  # 2^32 / golden ratio: consecutive units spread over 32 bits


def mix32(x: jax.Array) -> jax.Array:
  """lowbias32 (C. Wellons, 2018): a bijection of uint32 in which every input bit flips each
  output bit with probability close to 1/2."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * np.uint32(0xD35A2D97)
  return x ^ (x >> 15)


def keep_threshold(rate: float) -> np.uint32:
  """Bits below this are dropped: P(drop) = threshold / 2^32, within 2^-32 of `rate`."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate: must be in [0, 1), got {rate}")
  return np.uint32(min(round(rate * 2.0 ** 32), 2 ** 32 - 1))


def keep_mask(key: jax.Array, shape: tuple[int, int, int, int], rate: float, *,
              layout: str = "BTKC") -> jax.Array:
  """Bool mask of `shape`: True where the unit survives dropout at `rate`.

  `layout` names the four axes (a permutation of "BTKC": row, token, head, channel). Element
  (b, t, k, c) is token b * T + t and unit k * C + c in every layout, so the same key drops the
  same units of token-major [B, T, K, C] and heads-first [K, B, T, C] activations.
  """
  if sorted(layout) != sorted("BTKC"):
    raise ValueError(f"keep_mask: layout must be a permutation of 'BTKC', got {layout!r}")
  size = dict(zip(layout, shape))
  if size["B"] * size["T"] >= 2 ** 32 or size["K"] * size["C"] >= 2 ** 32:
    raise ValueError(f"keep_mask: shape {shape} has more tokens or units than a 32-bit index"
                     " holds")

  def index(axis: str) -> jax.Array:  # the axis' coordinate, broadcastable to `shape`
    dims = [size[a] if a == axis else 1 for a in layout]
    return jax.lax.broadcasted_iota(jnp.uint32, dims, layout.index(axis))

  seed = jax.random.bits(key, (2,), jnp.uint32)
  token = index("B") * np.uint32(size["T"]) + index("T")
  unit = index("K") * np.uint32(size["C"]) + index("C")
  bits = mix32((mix32(token ^ seed[0]) ^ seed[1]) + unit * _GOLDEN)
  return bits >= keep_threshold(rate)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *, layout: str = "BTKC"
            ) -> jax.Array:
  """Inverted dropout of [B, T, K, C] activations (or another `layout` of the four axes);
  identity when `key` is None (evaluation) or the rate is 0."""
  if key is None or rate == 0.0:
    return x
  keep = keep_mask(key, x.shape, rate, layout=layout)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
