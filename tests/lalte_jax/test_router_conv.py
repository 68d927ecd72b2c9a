"""The LTE router's conv layer (lalte_jax/layers/router_conv.py): the batched-matmul convolution
against a float64 conv written tap by tap over a shifted input, forward and gradients, at lengths,
tap counts and dilations the router uses and others; the dropout's scaling; the padding mask;
refused shapes; the remat policy "attention" keeping the pre-activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from lalte_jax.layers import counter_hash
from lalte_jax.layers.router_conv import conv_silu
from lalte_jax.mixers.lte_router import LTERouter
from lalte_jax.model import REMAT_CHECKPOINT_POLICIES
from lalte_jax.presets import get_model_config
from tests.kernel_testing import assert_close, float64

HEADS, BATCH, CHANNELS, OUT = 2, 2, 32, 16


def _inputs(length, taps, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (HEADS, BATCH, length, CHANNELS))
  weight = jax.random.normal(keys[1], (HEADS, taps, CHANNELS, OUT)) / np.sqrt(taps * CHANNELS)
  bias = jax.random.normal(keys[2], (HEADS, OUT))
  cotangent = jax.random.normal(keys[3], (HEADS, BATCH, length, OUT))
  return x.astype(dtype), weight, bias, cotangent


def _shifted_input_conv_silu(x, weight, bias, seed, rate, dilation):
  """The layer as the definition reads: out[t] = silu(b + sum_i drop(x)[t + i d - half] W_i)."""
  if seed is not None and rate:
    keep = counter_hash.keep_mask(seed, x.shape, rate, layout="KBTC")
    x = jnp.where(keep, x / (1.0 - rate), 0.0)
  taps, length = weight.shape[1], x.shape[2]
  half = (taps // 2) * dilation
  padded = jnp.pad(x, ((0, 0), (0, 0), (half, half), (0, 0)))
  pre = bias[:, None, None, :] + sum(
      jnp.einsum("kbtc,kco->kbto", padded[:, :, i * dilation:i * dilation + length], weight[:, i])
      for i in range(taps))
  return jax.nn.silu(pre)


def _value_and_grads(run, x, weight, bias, cotangent):
  out, vjp = jax.vjp(run, x, weight, bias)
  return (out,) + vjp(cotangent.astype(out.dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length, taps, dilation, rate", [
    (100, 3, 2, 0.1), (37, 3, 2, 0.0), (70, 1, 1, 0.1), (64, 5, 1, 0.0), (130, 3, 3, 0.25)])
def test_matches_the_tap_by_tap_float64_definition(dtype, length, taps, dilation, rate):
  x, weight, bias, cotangent = _inputs(length, taps, dtype)
  seed = counter_hash.seed_words(jax.random.key(7)) if rate else None
  got = _value_and_grads(
      lambda x, w, b: conv_silu(x, w, b, seed, rate=rate, dilation=dilation),
      x, weight, bias, cotangent)
  with float64():
    want = _value_and_grads(
        lambda x, w, b: _shifted_input_conv_silu(x, w, b, seed, rate, dilation),
        x.astype(jnp.float64), weight.astype(jnp.float64), bias.astype(jnp.float64),
        cotangent.astype(jnp.float64))
  for name, actual, expected in zip(("output", "dx", "dweight", "dbias"), got, want):
    assert_close(actual, expected, dtype, factor=2.0, name=name)


def test_dropout_scales_the_kept_units_and_keeps_one_minus_rate():
  """A 1-tap identity conv without bias shows the dropped input: silu(x / (1 - rate)) where kept,
  silu(0) = 0 where dropped, with the hash's mask."""
  x = jnp.abs(jax.random.normal(jax.random.key(0), (2, 2, 256, 16))) + 0.5
  identity = jnp.broadcast_to(jnp.eye(16), (2, 1, 16, 16))
  seed = counter_hash.seed_words(jax.random.key(1))
  out = conv_silu(x, identity, jnp.zeros((2, 16)), seed, rate=0.25, dilation=1)
  keep = counter_hash.keep_mask(seed, x.shape, 0.25, layout="KBTC")
  np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.where(keep, jax.nn.silu(x / 0.75), 0)),
                             rtol=1e-5, atol=1e-6)
  assert abs(float(keep.mean()) - 0.75) < 0.01


def test_the_padding_mask_zeroes_the_outputs_at_padded_tokens_only():
  """With zeros at the padded inputs (as the router feeds them), the mask zeroes the outputs there
  (silu(0) = 0, zero padding for the next layer) and leaves the real tokens' outputs as they are."""
  x, weight, bias, _ = _inputs(24, 3, jnp.float32)
  mask = jnp.arange(24)[None, :] < jnp.array([[24], [17]])
  x = x * mask[None, :, :, None]
  masked = conv_silu(x, weight, bias, None, mask, rate=0.0, dilation=2)
  plain = conv_silu(x, weight, bias, rate=0.0, dilation=2)
  assert not np.asarray(masked[:, 1, 17:]).any() and np.asarray(plain[:, 1, 17:]).any()
  np.testing.assert_array_equal(np.asarray(masked[:, 0]), np.asarray(plain[:, 0]))
  np.testing.assert_array_equal(np.asarray(masked[:, 1, :17]), np.asarray(plain[:, 1, :17]))


def test_unfit_weights_are_refused():
  x, weight, bias, _ = _inputs(20, 3, jnp.float32)
  with pytest.raises(ValueError, match="odd tap count"):
    conv_silu(x, weight[:, :2], bias, rate=0.0, dilation=1)
  with pytest.raises(ValueError, match="does not fit"):
    conv_silu(x, weight[:, :, :8], bias, rate=0.0, dilation=1)


def _dot_count(jaxpr) -> int:
  """dot_general equations of a jaxpr and of the jaxprs inside its equations."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          count += _dot_count(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          count += _dot_count(sub)
  return count


def test_remat_policy_attention_recomputes_no_router_convolution():
  """Under the group's checkpoint with policy "attention", the router's gradient program holds
  one convolution matmul per conv layer fewer than with everything recomputed ("block")."""
  lte = get_model_config("lalte-tiny").lte
  graphdef, params = nnx.split(LTERouter(lte, rngs=nnx.Rngs(0)))
  k_BTKD = jax.random.normal(jax.random.key(0), (1, 16, lte.num_kv_heads, lte.head_dim))

  def score_sum(params, k, v):
    return jnp.sum(nnx.merge(graphdef, params)(k, v, dropout_key=jax.random.key(1)))

  def dots(remat):
    grad = jax.grad(jax.checkpoint(score_sum, policy=REMAT_CHECKPOINT_POLICIES[remat]),
                    argnums=(0, 1, 2))
    return _dot_count(jax.make_jaxpr(grad)(params, k_BTKD, k_BTKD).jaxpr)

  assert dots("attention") == dots("block") - len(lte.router_kernel_sizes)
