"""Prefill in token chunks: less memory for a long prompt, the same result.

A prefill runs the layers one after another over the whole prompt, so its temporaries grow with
the prompt: the MLP's hidden activations, the GDN layers' projections and the chunked delta rule's
per-chunk states, the attention layers' queries and outputs (tens of KB a token at 1.4b). With
`chunk_tokens` (`StepContext.chunk_tokens`) the position-wise work (the MLP) runs over the prompt's
tokens a chunk at a time; a GDN layer runs its whole mixer chunk by chunk, carrying the recurrent
state and the short convolutions' last inputs from one chunk to the next; attention layers take
the keys, values (and LTE's scores and kept set) of the whole prompt, then their queries a chunk
at a time (projection, attention against the keys up to the chunk's end, o_proj), except a
full-attention layer with an eviction cache, which scores every query at once. A mixer's prefill
takes the block's residual stream and its RMSNorm, normalises each chunk and adds the chunk's
output into the stream in place, and the MLP does the same (`add_chunks`), so no normalised copy
of the prompt and no whole output exist. The same computation as in one piece, so outputs and
caches are unchanged (to rounding of the GDN state at the chunk boundaries). What still grows with
the prompt: the residual stream, and an attention layer's keys and values (and the input they
are projected from, while they are). For SWA and LTE layers a chunk's keys have the whole
prompt's length, zeros (invalid) in front of the keys up to the chunk's end, because the
attention ops align
queries with the last keys: the loop is one compiled body, and their kernels visit only the
window's tiles and the kept list. Full attention would also visit the zeros' tiles (about twice
its work in one piece), and NSA pools its blocks from position 0, so their chunks take the keys
up to their end as they are, in a Python loop (`unrolled_spans`; one compiled body a chunk).

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


def span_outputs(fn: Callable[[jax.Array | int, int, jax.Array], jax.Array],
                 out_BT_: jax.Array, chunk_tokens: int) -> jax.Array:
  """`out` with each chunk [start, start + size) replaced by fn(start, size, out) [B, size, ...],
  in place (`chunk_loop`): fn reads `out` as the earlier chunks left it (e.g. its own chunk's
  values, to update them)."""

  def body(start, size, out_BT_):
    return jax.lax.dynamic_update_slice_in_dim(out_BT_, fn(start, size, out_BT_), start, axis=1)

  return chunk_loop(body, out_BT_, out_BT_.shape[1], chunk_tokens)


def unrolled_spans(fn: Callable[[int, int, jax.Array], jax.Array], out_BT_: jax.Array,
                   chunk_tokens: int) -> jax.Array:
  """`out` with each chunk [start, end) replaced by fn(start, end, out) [B, end - start, ...], in
  place; a Python loop (static bounds), for chunks whose computation depends on where they end
  (each chunk compiles its own body)."""
  length = out_BT_.shape[1]
  for start in range(0, length, chunk_tokens):
    end = min(start + chunk_tokens, length)
    out_BT_ = jax.lax.dynamic_update_slice_in_dim(out_BT_, fn(start, end, out_BT_), start, axis=1)
  return out_BT_


def front_padded(x_BS_: jax.Array) -> jax.Array:
  """[B, 2S, ...]: S zeros (False for bool) then x; `keys_ending_at` slices it."""
  return jnp.concatenate([jnp.zeros_like(x_BS_), x_BS_], axis=1)


def keys_ending_at(padded_B2S_: jax.Array, end) -> jax.Array:
  """[B, S, ...]: the first `end` keys of `front_padded(x)` placed last, zeros before them.

  Attention ops align T queries with the last T of S keys; a query chunk that ends at `end` (its
  queries at positions end - T .. end - 1) then sees keys 0 .. end - 1 at their places, and the
  zeros in front are marked invalid by the same slice of the padded validity."""
  length = padded_B2S_.shape[1] // 2
  return jax.lax.dynamic_slice_in_dim(padded_B2S_, end, length, axis=1)
