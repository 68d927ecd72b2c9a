"""Prefill in token chunks: the prompt's memory bounded by the chunk, its result unchanged.

A prefill runs the layers one after another over the whole prompt, so its temporaries grow with
the prompt: the MLP's hidden activations, the GDN layers' projections and the chunked delta rule's
per-chunk states (tens of KB a token at 1.4b). With `chunk_tokens` (`StepContext.chunk_tokens`)
the position-wise work (the MLP) runs over the prompt's tokens a chunk at a time, and a GDN layer
runs its whole mixer chunk by chunk, carrying the recurrent state and the short convolutions'
last inputs from one chunk to the next: the same computation as in one piece, so outputs and
caches are unchanged (to rounding of the state at the chunk boundaries). The attention mixers still
see the whole prompt at once (their keys and values are a few KB a token).

`spans` splits a length into chunks; `map_chunks` runs a position-wise function over them.
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


def split_chunks(x_BT_: jax.Array, chunk_tokens: int) -> tuple[jax.Array | None, jax.Array | None]:
  """(full chunks [n, B, chunk, ...] or None, the remainder [B, r, ...] or None) of x along T."""
  length = x_BT_.shape[1]
  count, rest = divmod(length, chunk_tokens)
  full = None
  if count:
    head = x_BT_[:, :count * chunk_tokens]
    full = jnp.moveaxis(head.reshape(head.shape[0], count, chunk_tokens, *head.shape[2:]), 1, 0)
  return full, (x_BT_[:, count * chunk_tokens:] if rest else None)


def join_chunks(full_NBC_: jax.Array | None, rest_BR_: jax.Array | None) -> jax.Array:
  """The inverse of `split_chunks`: [B, T, ...]."""
  parts = []
  if full_NBC_ is not None:
    count, batch, chunk = full_NBC_.shape[:3]
    parts.append(jnp.moveaxis(full_NBC_, 0, 1).reshape(batch, count * chunk,
                                                       *full_NBC_.shape[3:]))
  if rest_BR_ is not None:
    parts.append(rest_BR_)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def map_chunks(fn: Callable[[jax.Array], jax.Array], x_BTD: jax.Array,
               chunk_tokens: int | None) -> jax.Array:
  """fn (position-wise: token t's output reads token t only) over x [B, T, D] `chunk_tokens`
  tokens at a time (a `lax.map` over the full chunks, then the remainder); fn(x) at once when
  chunk_tokens is None or covers T."""
  if chunk_tokens is None or x_BTD.shape[1] <= chunk_tokens:
    return fn(x_BTD)
  full, rest = split_chunks(x_BTD, chunk_tokens)
  return join_chunks(None if full is None else jax.lax.map(fn, full),
                     None if rest is None else fn(rest))
