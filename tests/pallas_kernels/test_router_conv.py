"""The router conv layer: the Pallas kernels (interpret mode off the GPU) against the float64 jnp
reference, forward and gradients, with and without dropout, at lengths that are not a multiple
of the block; no row or head reads another's; the LTE router with either implementation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.mixers.lte_router import LTERouter
from pallas_kernels import counter_hash
from pallas_kernels.router_conv import conv_silu, reference
from tests.kernel_testing import assert_close, float64

HEADS, BATCH, CHANNELS, OUT = 2, 2, 32, 16


def _inputs(length, taps, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (HEADS, BATCH, length, CHANNELS))
  weight = jax.random.normal(keys[1], (HEADS, taps, CHANNELS, OUT)) / np.sqrt(taps * CHANNELS)
  bias = jax.random.normal(keys[2], (HEADS, OUT))
  cotangent = jax.random.normal(keys[3], (HEADS, BATCH, length, OUT))
  return x.astype(dtype), weight, bias, cotangent


def _value_and_grads(implementation, x, weight, bias, seed, cotangent, rate, dilation):
  def run(x, weight, bias):
    if implementation == "float64":
      return reference.conv_silu(x, weight, bias, seed, None, rate, dilation)
    return conv_silu(x, weight, bias, seed, rate=rate, dilation=dilation,
                     implementation=implementation)
  out, vjp = jax.vjp(run, x, weight, bias)
  return (out,) + vjp(cotangent.astype(out.dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length, taps, dilation, rate", [
    (100, 3, 2, 0.1), (37, 3, 2, 0.0), (70, 1, 1, 0.1), (64, 5, 1, 0.0), (130, 3, 3, 0.25)])
def test_pallas_matches_the_float64_reference(dtype, length, taps, dilation, rate):
  x, weight, bias, cotangent = _inputs(length, taps, dtype)
  seed = counter_hash.seed_words(jax.random.key(7)) if rate else None
  got = _value_and_grads("pallas", x, weight, bias, seed, cotangent, rate, dilation)
  with float64():
    want = _value_and_grads("float64", x.astype(jnp.float64), weight.astype(jnp.float64),
                            bias.astype(jnp.float64), seed, cotangent.astype(jnp.float64),
                            rate, dilation)
  for name, actual, expected in zip(("output", "dx", "dweight", "dbias"), got, want):
    assert_close(actual, expected, dtype, factor=2.0, name=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_dropout_scales_the_kept_units_and_keeps_one_minus_rate(implementation):
  """A 1-tap identity conv without bias shows the dropped input: silu(x / (1 - rate)) where kept,
  silu(0) = 0 where dropped, with the hash's mask."""
  x = jnp.abs(jax.random.normal(jax.random.key(0), (2, 2, 256, 16))) + 0.5
  identity = jnp.broadcast_to(jnp.eye(16), (2, 1, 16, 16))
  seed = counter_hash.seed_words(jax.random.key(1))
  out = conv_silu(x, identity, jnp.zeros((2, 16)), seed, rate=0.25, dilation=1,
                  implementation=implementation)
  keep = counter_hash.keep_mask(seed, x.shape, 0.25, layout="KBTC")
  np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.where(keep, jax.nn.silu(x / 0.75), 0)),
                             rtol=1e-5, atol=1e-6)
  assert abs(float(keep.mean()) - 0.75) < 0.01


def test_no_row_or_head_reads_another():
  """NaN in one row and in one head: every other (head, row) pair's outputs and input gradients
  stay finite and equal those of a clean input."""
  x, weight, bias, cotangent = _inputs(90, 3, jnp.float32)
  seed = counter_hash.seed_words(jax.random.key(3))
  poisoned = x.at[1, :].set(jnp.nan).at[:, 1].set(jnp.nan)  # head 1, row 1
  clean = _value_and_grads("pallas", x, weight, bias, seed, cotangent, 0.1, 2)
  dirty = _value_and_grads("pallas", poisoned, weight, bias, seed, cotangent, 0.1, 2)
  for got, want in ((dirty[0], clean[0]), (dirty[1], clean[1])):
    np.testing.assert_allclose(np.asarray(got[0, 0]), np.asarray(want[0, 0]), rtol=1e-6)


def test_unsupported_inputs_are_refused():
  x, weight, bias, _ = _inputs(20, 3, jnp.float32)
  with pytest.raises(NotImplementedError, match="output channels 8"):
    conv_silu(x, weight[..., :8], bias[:, :8], rate=0.0, dilation=1, implementation="pallas")
  with pytest.raises(NotImplementedError, match="padding mask"):
    conv_silu(x, weight, bias, None, jnp.ones((BATCH, 20), bool), rate=0.0, dilation=1,
              implementation="pallas")
  with pytest.raises(ValueError, match="odd tap count"):
    conv_silu(x, weight[:, :2], bias, rate=0.0, dilation=1, implementation="xla")


def test_router_scores_and_gradients_agree_across_implementations():
  """lalte-0.4b's router widths (2D = 128 -> 64 -> 32 -> 16) on a short sequence, dropout on."""
  base = get_model_config("lalte-0.4b").lte
  lte = dataclasses.replace(base, num_heads=4, num_kv_heads=2)
  keys = jax.random.split(jax.random.key(0), 3)
  k = jax.random.normal(keys[0], (2, 48, 2, lte.head_dim))
  v = jax.random.normal(keys[1], (2, 48, 2, lte.head_dim))

  def score_and_grads(implementation):
    router = LTERouter(dataclasses.replace(lte, implementation=implementation),
                       rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(router)
    loss = lambda p, k, v: jnp.sum(jnp.sin(7 * nnx.merge(graphdef, p)(k, v, dropout_key=keys[2])))
    return (nnx.merge(graphdef, params)(k, v, dropout_key=keys[2]),
            jax.grad(loss, argnums=(0, 1, 2))(params, k, v))

  (xla_score, xla_grads), (pallas_score, pallas_grads) = (score_and_grads("xla"),
                                                          score_and_grads("pallas"))
  assert_close(pallas_score, xla_score, jnp.float32, factor=10.0, name="score")
  for got, want in zip(jax.tree.leaves(pallas_grads), jax.tree.leaves(xla_grads)):
    assert_close(got, want, jnp.float32, factor=10.0, name="gradient")


@pytest.mark.gpu
def test_pallas_matches_xla_on_the_gpu_at_the_router_widths():
  x = jax.random.normal(jax.random.key(0), (16, 2, 1000, 128), jnp.bfloat16)
  weight = jax.random.normal(jax.random.key(1), (16, 3, 128, 64)) / np.sqrt(384)
  bias = jax.random.normal(jax.random.key(2), (16, 64))
  cotangent = jax.random.normal(jax.random.key(3), (16, 2, 1000, 64))
  seed = counter_hash.seed_words(jax.random.key(4))
  got = _value_and_grads("pallas", x, weight, bias, seed, cotangent, 0.1, 2)
  want = _value_and_grads("xla", x, weight, bias, seed, cotangent, 0.1, 2)
  for name, actual, expected in zip(("output", "dx", "dweight", "dbias"), got, want):
    assert_close(actual, expected, jnp.bfloat16, name=name)
