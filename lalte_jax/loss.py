"""Losses on model outputs: next-token CE on logits, the trainer's masked CE sum on shifted labels,
and the same sum computed chunk by chunk from the final hidden states."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from lalte_jax.data import IGNORE_LABEL


@jax.custom_vjp
def token_cross_entropy(logits_BTV: jax.Array, labels_BT: jax.Array) -> jax.Array:
  """-log softmax(logits)[label] per position, float32 [B, T] (the value of optax's
  softmax_cross_entropy_with_integer_labels, computed the same way).

  Its backward writes (softmax - onehot(label)) * g in one elementwise pass over the logits, the
  one-hot as a comparison with the vocabulary index. Left to autodiff, the label term is a
  scatter-add into the float32 gradient, which splits the pass in two and keeps XLA from fusing
  the LM head's cast to bf16 into it: two more passes over a [B, T, V] float32 buffer (3.5 ms of
  a gdn_swa-0.4b step at B8 T4096 on one H200, 2026-11-30).
  """
  return _cross_entropy_forward(logits_BTV, labels_BT)[0]


def _cross_entropy_forward(logits_BTV, labels_BT):
  lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  label_logit_BT = jnp.take_along_axis(logits_BTV, labels_BT[..., None], axis=-1)[..., 0]
  return lse_BT - label_logit_BT, (logits_BTV, labels_BT, lse_BT)


def _cross_entropy_backward(residuals, g_BT):
  logits_BTV, labels_BT, lse_BT = residuals
  vocab_V = jnp.arange(logits_BTV.shape[-1], dtype=labels_BT.dtype)
  onehot_BTV = vocab_V == labels_BT[..., None]
  dlogits_BTV = (jnp.exp(logits_BTV - lse_BT[..., None]) - onehot_BTV) * g_BT[..., None]
  return dlogits_BTV, None


token_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


def next_token_cross_entropy(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting token t+1 from position t; the last position has no label
  and is ignored (§1.1). Computed in float32."""
  return jnp.mean(token_cross_entropy(logits_BTV[:, :-1].astype(jnp.float32), tokens_BT[:, 1:]))


def masked_cross_entropy_sum(logits_BTV: jax.Array, labels_BT: jax.Array) -> jax.Array:
  """Sum of float32 CE over positions whose label is not IGNORE_LABEL (labels already shifted:
  labels[t] is the target of logits[t])."""
  scored_BT = labels_BT != IGNORE_LABEL
  losses_BT = token_cross_entropy(logits_BTV.astype(jnp.float32),
                                  jnp.where(scored_BT, labels_BT, 0))
  return jnp.sum(jnp.where(scored_BT, losses_BT, 0.0))


def chunked_cross_entropy_sum(head: Callable[[jax.Array], jax.Array], hidden_BTD: jax.Array,
                              labels_BT: jax.Array, chunk_tokens: int) -> jax.Array:
  """`masked_cross_entropy_sum(head(hidden_BTD), labels_BT)`, without the [B, T, V] logits when
  `chunk_tokens` > 0 (0: the whole logits at once, as one chunk).

  `head` maps hidden states [B, T, D] to float32 logits [B, T, V] (`HybridLM.logits_from_hidden`;
  each chunk goes in as [1, chunk_tokens, D]). The B*T positions are cut into chunks of
  `chunk_tokens`, the last one padded with unscored positions when it does not divide B*T (one
  chunk of B*T or more is the whole path), and a `lax.scan` sums each chunk's CE. The chunk body
  is rematerialised, so the backward pass recomputes a chunk's logits instead of keeping them:
  the V-sized live buffers are [chunk_tokens, V] rather than [B, T, V] and its gradient, at the
  cost of a second head matmul per chunk.
  """
  hidden_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
  labels_N = labels_BT.reshape(-1)
  num_tokens = labels_N.shape[0]
  chunk = min(chunk_tokens or num_tokens, num_tokens)
  num_chunks = -(-num_tokens // chunk)
  if num_chunks == 1:  # nothing to save, and a one-step remat scan would only add a recompute
    return masked_cross_entropy_sum(head(hidden_BTD), labels_BT)
  pad = num_chunks * chunk - num_tokens
  hidden_CKD = jnp.pad(hidden_ND, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
  labels_CK = jnp.pad(labels_N, (0, pad), constant_values=IGNORE_LABEL).reshape(num_chunks, chunk)

  @jax.checkpoint
  def chunk_sum(hidden_KD, labels_K):
    return masked_cross_entropy_sum(head(hidden_KD[None]), labels_K[None])

  def body(total, xs):
    return total + chunk_sum(*xs), None

  total, _ = jax.lax.scan(body, jnp.float32(0.0), (hidden_CKD, labels_CK))
  return total
