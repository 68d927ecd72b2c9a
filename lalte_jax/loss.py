"""Losses on model outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def next_token_cross_entropy(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting token t+1 from position t; the last position has no label
  and is ignored (§1.1). Computed in float32."""
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits_BTV[:, :-1].astype(jnp.float32), tokens_BT[:, 1:])
  return jnp.mean(losses)
