"""The cross-entropy's custom backward: the value is optax's to the bit, the gradient optax's
autodiff gradient within float32 rounding, ignored positions get none, and the backward is one
elementwise pass (no scatter of the label term)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lalte_jax.data import IGNORE_LABEL
from lalte_jax.loss import masked_cross_entropy_sum, next_token_cross_entropy


def _autodiff_sum(logits_BTV, labels_BT):
  scored_BT = labels_BT != IGNORE_LABEL
  losses_BT = optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV, jnp.where(scored_BT, labels_BT, 0))
  return jnp.sum(jnp.where(scored_BT, losses_BT, 0.0))


def _inputs(seed=0, vocab=97):
  keys = jax.random.split(jax.random.key(seed), 2)
  logits_BTV = 5.0 * jax.random.normal(keys[0], (3, 11, vocab), jnp.float32)
  labels_BT = jax.random.randint(keys[1], (3, 11), 0, vocab)
  return logits_BTV, labels_BT.at[1, 4].set(IGNORE_LABEL).at[2, 0].set(IGNORE_LABEL)


def test_value_is_optax_and_gradient_matches_autodiff():
  logits_BTV, labels_BT = _inputs()
  assert masked_cross_entropy_sum(logits_BTV, labels_BT) == _autodiff_sum(logits_BTV, labels_BT)
  ours = jax.grad(masked_cross_entropy_sum)(logits_BTV, labels_BT)
  expected = jax.grad(_autodiff_sum)(logits_BTV, labels_BT)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=0, atol=1e-6)
  assert not np.any(np.asarray(ours)[1, 4]) and not np.any(np.asarray(ours)[2, 0])


def test_next_token_mean_matches_optax():
  logits_BTV, labels_BT = _inputs(seed=1)
  tokens_BT = jnp.maximum(labels_BT, 0)
  expected = lambda l: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      l[:, :-1], tokens_BT[:, 1:]))
  assert next_token_cross_entropy(logits_BTV, tokens_BT) == expected(logits_BTV)
  np.testing.assert_allclose(
      np.asarray(jax.grad(next_token_cross_entropy)(logits_BTV, tokens_BT)),
      np.asarray(jax.grad(expected)(logits_BTV)), rtol=0, atol=1e-7)


def test_backward_has_no_scatter():
  logits_BTV, labels_BT = _inputs(seed=2)
  ours = jax.jit(jax.grad(masked_cross_entropy_sum)).lower(logits_BTV, labels_BT).as_text()
  autodiff = jax.jit(jax.grad(_autodiff_sum)).lower(logits_BTV, labels_BT).as_text()
  assert "scatter" in autodiff and "scatter" not in ours
