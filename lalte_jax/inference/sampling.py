"""Next-token choice from logits: greedy at temperature 0, else temperature, top-k, top-p sampling.

All parameters are traced values, so changing them does not recompile the generation loop.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array  # [] float32; 0 = greedy (argmax, ties to the lower id)
  top_k: jax.Array  # [] int32; 0 = no top-k filter
  top_p: jax.Array  # [] float32 in (0, 1]; 1 = no nucleus filter


def make_sampling_params(temperature: float, top_k: int | None, top_p: float | None
                         ) -> SamplingParams:
  """Validated parameters; raises ValueError naming the bad argument."""
  if not isinstance(temperature, (int, float)) or not temperature >= 0:
    raise ValueError(f"temperature: must be a number >= 0 (0 = greedy), got {temperature!r}")
  if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
    raise ValueError(f"top_k: must be a positive int or None, got {top_k!r}")
  if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
    raise ValueError(f"top_p: must be in (0, 1] or None, got {top_p!r}")
  return SamplingParams(temperature=jnp.asarray(temperature, jnp.float32),
                        top_k=jnp.asarray(top_k or 0, jnp.int32),
                        top_p=jnp.asarray(1.0 if top_p is None else top_p, jnp.float32))


def _filter(logits_BV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """-inf outside the top-k and outside the smallest top set whose probability reaches top_p."""
  vocab = logits_BV.shape[-1]
  sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  sorted_BV = jnp.where(jnp.arange(vocab) < k, sorted_BV, -jnp.inf)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
  # The top token is always kept (mass before it is 0 < top_p).
  kept_BV = (mass_before_BV < top_p) & jnp.isfinite(sorted_BV)
  threshold_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV >= threshold_B1, logits_BV, -jnp.inf)


def sample_tokens(logits_BV: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Token ids [B] int32."""
  def greedy():
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def sample():
    scaled_BV = logits_BV.astype(jnp.float32) / jnp.maximum(params.temperature, 1e-6)
    filtered_BV = jax.lax.cond((params.top_k > 0) | (params.top_p < 1.0),
                               lambda x: _filter(x, params.top_k, params.top_p), lambda x: x,
                               scaled_BV)
    return jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)

  return jax.lax.cond(params.temperature > 0, sample, greedy)
