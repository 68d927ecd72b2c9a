"""tools/bench_decode_attention.py: the looped timing computes the calls it claims (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
from tests.tools import load_tool


def test_looped_call_chains_every_decode_call_of_every_round():
  """rounds x sets decode calls, each query chained to the previous output: the result equals the
  same chain written out call by call, and the looped copy adds 1 once per round."""
  bench = load_tool("bench_decode_attention")
  inputs, _ = bench.attention_case("lalte-0.4b", 1, 2, jax.random.key(3))
  rounds = 3
  looped = bench.looped_timed(inputs, "xla", None, rounds)
  result = looped.fn(*looped.input_sets[0])
  qs, ks, vs, length, valid = inputs
  expected = jnp.zeros_like(qs[0])
  for _ in range(rounds):
    for q, k, v in zip(qs, ks, vs):
      expected = bench.decode_attention(q + 0 * expected, k, v, length_BK=length,
                                        key_valid=valid, implementation="xla")
  np.testing.assert_array_equal(np.asarray(result, np.float32), np.asarray(expected, np.float32))

  copy = bench.Timed(jax.jit(lambda x: x + 1), [(jnp.zeros((4, 8), jnp.bfloat16),)])
  looped_copy = bench.looped_copy(copy, rounds)
  np.testing.assert_array_equal(np.asarray(looped_copy.fn(*looped_copy.input_sets[0]), np.float32),
                                np.full((4, 8), rounds, np.float32))
