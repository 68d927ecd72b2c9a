"""Counter-based random bits: a hash of an element's index (the LTE router's dropout masks).

An element's 32 bits come from two 32-bit seed words (drawn once from a PRNG key) and two indices
(a token and a unit, e.g. head * channels + channel): the token's index is mixed with the first
word, the unit's index is added in the golden-ratio sequence after xoring the second, and mixed
again. The mixer is Wellons' `lowbias32` (2018), an invertible xor-shift-multiply avalanche. No
generator state: any element's bits can be computed anywhere from its index (the backward pass
and a remat recompute redraw the forward's mask from the seed), and the bits partition over any
mesh like the iota they start from.

Why not `jax.random.bernoulli`: it runs threefry (20 rounds per pair of 32-bit words) for every
element. The LTE router draws three masks per layer call ([Hkv, B, T, C] for C = 2D, D, D/2) in
the forward pass, and the block's recomputation draws them again: at lalte-0.4b, B4 T4096 on one
H200 (2026-11-29, tools/bench_router.py) the three threefry masks took 0.40 ms per call, these
0.18 ms, and the training step went from 160.7 to 157.0 ms (tools/bench_train.py --profile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GOLDEN = np.uint32(0x9E3779B9)  # 2^32 / golden ratio: consecutive units spread over 32 bits


def mix32(x: jax.Array) -> jax.Array:
  """lowbias32: a bijection of uint32 in which every input bit flips each output bit with
  probability close to 1/2."""
  x = x ^ (x >> 16)
  x = x * np.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * np.uint32(0xD35A2D97)
  return x ^ (x >> 15)


def seed_words(key: jax.Array) -> jax.Array:
  """The two uint32 seed words [2] of a PRNG key."""
  return jax.random.bits(key, (2,), jnp.uint32)


def keep_threshold(rate: float) -> np.uint32:
  """Bits below this are dropped: P(drop) = threshold / 2^32, within 2^-32 of `rate`."""
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate: must be in [0, 1), got {rate}")
  return np.uint32(min(round(rate * 2.0 ** 32), 2 ** 32 - 1))


def keep_mask(seed: jax.Array, shape: tuple[int, ...], rate: float, *, layout: str = "BTKC",
              row_offset: jax.Array | int = 0) -> jax.Array:
  """Bool mask of `shape`: True where the unit survives dropout at `rate`, from the seed words.

  `layout` names the four axes (a permutation of "BTKC": row, token, head, channel). Element
  (b, t, k, c) is token (row_offset + b) * T + t and unit k * C + c in every layout, so the same
  seed drops the same units of token-major [B, T, K, C] and heads-first [K, B, T, C]
  activations, and a shard of rows starting at `row_offset` draws its part of the whole batch's
  mask.
  """
  if sorted(layout) != sorted("BTKC") or len(shape) != 4:
    raise ValueError(f"keep_mask: layout must be a permutation of 'BTKC' for a 4-d shape, got"
                     f" {layout!r} for {shape}")
  size = dict(zip(layout, shape))
  if size["B"] * size["T"] >= 2 ** 32 or size["K"] * size["C"] >= 2 ** 32:
    raise ValueError(f"keep_mask: shape {shape} has more tokens or units than a 32-bit index"
                     " holds")

  def index(axis: str) -> jax.Array:  # the axis' coordinate, broadcastable to `shape`
    dims = [size[a] if a == axis else 1 for a in layout]
    return jax.lax.broadcasted_iota(jnp.uint32, dims, layout.index(axis))

  row = index("B") + jnp.asarray(row_offset).astype(jnp.uint32)
  token = row * np.uint32(size["T"]) + index("T")
  unit = index("K") * np.uint32(size["C"]) + index("C")
  bits = mix32((mix32(token ^ seed[0]) ^ seed[1]) + unit * GOLDEN)
  return bits >= keep_threshold(rate)
