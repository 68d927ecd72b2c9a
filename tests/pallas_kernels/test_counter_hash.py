"""Dropout masks from the counter hash (pallas_kernels/lte_router/counter_hash.py): rate,
determinism, independence of neighbouring elements, the documented index contract and a batch
shard's rows."""

import jax
import numpy as np
import pytest

from pallas_kernels.lte_router import counter_hash
from pallas_kernels.lte_router.counter_hash import keep_threshold, mix32


def keep_mask(key, shape, rate, *, layout="BTKC"):
  return counter_hash.keep_mask(counter_hash.seed_words(key), shape, rate, layout=layout)

SHAPE_BTKC = (2, 512, 4, 64)  # 262,144 elements: the keep share's standard error is ~6e-4


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_mask_keeps_one_minus_rate(rate):
  keep = np.asarray(keep_mask(jax.random.key(3), SHAPE_BTKC, rate))
  sigma = np.sqrt(rate * (1 - rate) / keep.size)
  assert abs(keep.mean() - (1 - rate)) < 5 * sigma


def test_mask_is_a_function_of_the_key():
  first = np.asarray(keep_mask(jax.random.key(0), SHAPE_BTKC, 0.5))
  again = np.asarray(keep_mask(jax.random.key(0), SHAPE_BTKC, 0.5))
  other = np.asarray(keep_mask(jax.random.key(1), SHAPE_BTKC, 0.5))
  np.testing.assert_array_equal(first, again)
  # Independent masks at rate 0.5 agree on half the elements.
  assert abs((first == other).mean() - 0.5) < 5 * np.sqrt(0.25 / first.size)


def test_neighbouring_elements_are_uncorrelated():
  keep = np.asarray(keep_mask(jax.random.key(7), SHAPE_BTKC, 0.5), np.float64)
  centred = keep - keep.mean()
  bound = 5 / np.sqrt(keep.size)
  for axis in range(4):  # next row, token, head and channel
    ahead = np.take(centred, np.arange(1, keep.shape[axis]), axis=axis)
    behind = np.take(centred, np.arange(keep.shape[axis] - 1), axis=axis)
    correlation = (ahead * behind).mean() / centred.var()
    assert abs(correlation) < bound, (axis, correlation)


def _numpy_mix32(x):
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x21F0AAAD)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0xD35A2D97)
  return x ^ (x >> np.uint32(15))


def test_mask_bits_follow_the_token_and_unit_index():
  """Element (b, t, k, c) hashes token b * T + t and unit k * C + c (numpy, uint32 wrap-around),
  and a heads-first layout of the same activations gets the same bits."""
  shape = (2, 5, 3, 4)
  length, channels = shape[1], shape[3]
  key = jax.random.key(11)
  seed = np.asarray(jax.random.bits(key, (2,), np.uint32))
  b, t, k, c = np.meshgrid(*[np.arange(n, dtype=np.uint32) for n in shape], indexing="ij")
  with np.errstate(over="ignore"):
    token_bits = _numpy_mix32((b * np.uint32(length) + t) ^ seed[0])
    bits = _numpy_mix32((token_bits ^ seed[1])
                        + (k * np.uint32(channels) + c) * np.uint32(0x9E3779B9))
  rate = 0.3
  expected = bits >= np.uint32(round(rate * 2 ** 32))
  np.testing.assert_array_equal(np.asarray(keep_mask(key, shape, rate)), expected)
  heads_first = keep_mask(key, (3, 2, 5, 4), rate, layout="KBTC")
  np.testing.assert_array_equal(np.asarray(heads_first), expected.transpose(2, 0, 1, 3))
  np.testing.assert_array_equal(np.asarray(mix32(np.uint32([0, 1, 2 ** 31]))),
                                _numpy_mix32(np.uint32([0, 1, 2 ** 31])))


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_rate_outside_zero_one_is_refused(rate):
  with pytest.raises(ValueError, match="dropout rate"):
    keep_threshold(rate)


def test_layout_must_name_the_four_axes():
  with pytest.raises(ValueError, match="layout"):
    keep_mask(jax.random.key(0), (2, 3, 4, 5), 0.1, layout="BTKK")


def test_a_shard_of_rows_draws_its_part_of_the_whole_mask():
  seed = counter_hash.seed_words(jax.random.key(3))
  whole = counter_hash.keep_mask(seed, (2, 6, 5, 32), 0.3, layout="KBTC")
  shard = counter_hash.keep_mask(seed, (2, 2, 5, 32), 0.3, layout="KBTC", row_offset=3)
  np.testing.assert_array_equal(np.asarray(shard), np.asarray(whole[:, 3:5]))

