"""pallas_kept_list.compact (interpret mode) against the XLA stream compaction."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.masked_attention import compaction, pallas_kept_list


@pytest.mark.parametrize("key_len,capacity,fraction", [
    (50, 64, 0.3),      # one block of 64 keys, capacity past the keys
    (2100, 2112, 0.2),  # three blocks of 1024, the last one partial
    (40, 48, 0.0),      # nothing listed: all padding
    (40, 40, 1.0),      # everything listed: no padding
])
def test_compact_matches_xla(key_len, capacity, fraction):
  rng = np.random.default_rng(key_len)
  listed = jnp.asarray(rng.random((2, 3, key_len)) < fraction)
  positions, listed_before = pallas_kept_list.compact(listed, capacity=capacity, interpret=True)
  expected_positions, expected_before = compaction.compact(listed, capacity=capacity)
  np.testing.assert_array_equal(np.asarray(listed_before), np.asarray(expected_before))
  np.testing.assert_array_equal(np.asarray(positions), np.asarray(expected_positions))


def test_compact_rejects_a_capacity_below_the_keys():
  with pytest.raises(ValueError, match="capacity 8 < key length 16"):
    pallas_kept_list.compact(jnp.zeros((1, 1, 16), bool), capacity=8, interpret=True)


@pytest.mark.gpu
def test_compact_on_gpu_matches_xla():
  # Compiled by Triton at the benchmark's longest row (16 blocks), 256 listed keys per row.
  rng = np.random.default_rng(3)
  listed = jnp.asarray(rng.random((2, 8, 16384)) < 256 / 16384)
  positions, listed_before = pallas_kept_list.compact(listed, capacity=16384, interpret=False)
  expected_positions, expected_before = compaction.compact(listed, capacity=16384)
  np.testing.assert_array_equal(np.asarray(listed_before), np.asarray(expected_before))
  np.testing.assert_array_equal(np.asarray(positions), np.asarray(expected_positions))
