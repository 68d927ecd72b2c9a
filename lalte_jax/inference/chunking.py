"""Prefill in token chunks: less memory for a long prompt, the same result.

A prefill runs the layers one after another over the whole prompt, so its temporaries grow with
the prompt: the MLP's hidden activations, the GDN layers' projections and the chunked delta rule's
per-chunk states (tens of KB a token at 1.4b). With `chunk_tokens` (`StepContext.chunk_tokens`)
the position-wise work (the MLP) runs over the prompt's tokens a chunk at a time, and a GDN layer
runs its whole mixer chunk by chunk, carrying the recurrent state and the short convolutions'
last inputs from one chunk to the next: the same computation as in one piece, so outputs and
caches are unchanged (to rounding of the state at the chunk boundaries). What still grows with
the prompt: the residual stream between layers and the attention mixers, which see the whole
prompt at once (their projections and kernels, a few KB a token each).

`chunk_loop` runs a body over the chunks; `add_chunks` adds a position-wise function's output.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def check_chunk_tokens(chunk_tokens) -> int | None:
  """`chunk_tokens` as an int, or None (no chunking); raises ValueError naming it otherwise."""
  if chunk_tokens is None:
    return None
  if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
    raise ValueError(f"chunk_tokens: must be a positive int or None, got {chunk_tokens!r}")
  return int(chunk_tokens)


def chunk_loop(body, carry, length: int, chunk_tokens: int):
  """carry = body(start, size, carry) for the chunks [start, start + size) of [0, length): a
  `fori_loop` over the full chunks (dynamic start, static size), then the remainder (static).
  Bodies read their chunk with `lax.dynamic_slice_in_dim` and write whole-prompt arrays in the
  carry with `lax.dynamic_update_slice_in_dim`, which XLA does in place: no stacked copy of the
  chunks and no joined copy of the results."""
  count, rest = divmod(length, chunk_tokens)
  if count:
    carry = jax.lax.fori_loop(
        0, count, lambda i, c: body(i * chunk_tokens, chunk_tokens, c), carry)
  if rest:
    carry = body(count * chunk_tokens, rest, carry)
  return carry


def add_chunks(fn: Callable[[jax.Array], jax.Array], x_BTD: jax.Array,
               chunk_tokens: int | None) -> jax.Array:
  """x + fn(x) for a position-wise fn (token t's output reads token t only), `chunk_tokens`
  tokens at a time, each chunk's sum written over x's own chunk; at once when chunk_tokens is
  None or covers T."""
  length = x_BTD.shape[1]
  if chunk_tokens is None or length <= chunk_tokens:
    return x_BTD + fn(x_BTD)

  def body(start, size, x_BTD):
    x_BCD = jax.lax.dynamic_slice_in_dim(x_BTD, start, size, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(x_BTD, x_BCD + fn(x_BCD), start, axis=1)

  return chunk_loop(body, x_BTD, length, chunk_tokens)
