"""Host-side prompt handling: validation, left padding, shape buckets.

Generation compiles once per (batch, prompt bucket, new-token bucket): prompts are left-padded to
the bucket of the longest one and the output buffer is sized to the bucket of `max_new_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BUCKET = 16
LARGE_BUCKET_STEP = 4096  # above this, round up to a multiple instead of doubling (<= 2x waste)


def bucket_length(n: int) -> int:
  """Powers of two from 16 up to 4096, then multiples of 4096."""
  if n <= LARGE_BUCKET_STEP:
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())
  return -(-n // LARGE_BUCKET_STEP) * LARGE_BUCKET_STEP


def check_token_ids(ids: np.ndarray, vocab_size: int, what: str) -> None:
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
    raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")


def _rows_from_array(tokens, pad_mask, prompt_lengths) -> list[np.ndarray]:
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"prompt_tokens: expected [batch, length] or a list of sequences, got shape"
                     f" {tokens.shape}")
  if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"prompt_tokens: expected integer token ids, got dtype {tokens.dtype}")
  if pad_mask is not None and prompt_lengths is not None:
    raise ValueError("pad_mask / prompt_lengths: give at most one of them")
  if pad_mask is not None:
    pad_mask = np.asarray(pad_mask)
    if pad_mask.shape != tokens.shape or pad_mask.dtype != bool:
      raise ValueError(f"pad_mask: expected bool of shape {tokens.shape} (True = real token), got"
                       f" {pad_mask.dtype} {pad_mask.shape}")
    return [row[mask] for row, mask in zip(tokens, pad_mask)]
  if prompt_lengths is not None:
    lengths = np.asarray(prompt_lengths)
    if lengths.shape != (tokens.shape[0],) or not np.issubdtype(lengths.dtype, np.integer) \
        or lengths.min(initial=0) < 0 or lengths.max(initial=0) > tokens.shape[1]:
      raise ValueError(f"prompt_lengths: expected {tokens.shape[0]} ints in [0,"
                       f" {tokens.shape[1]}] (the first L tokens of each row are real), got"
                       f" {prompt_lengths!r}")
    return [row[:n] for row, n in zip(tokens, lengths)]
  return list(tokens)


def left_pad_prompts(prompt_tokens, *, pad_mask=None, prompt_lengths=None, vocab_size: int,
                     pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Validated, left-padded prompts: (tokens [B, P] int32, valid [B, P] bool), P a bucket.

  `prompt_tokens` is a list of token-id sequences (any lengths) or an int array [B, T] whose real
  tokens are given by `pad_mask` ([B, T] bool, True = real; any padding side) or `prompt_lengths`
  (the first L_b tokens of row b), or all real when neither is given.
  """
  if isinstance(prompt_tokens, Sequence) and not isinstance(prompt_tokens, (str, bytes)) and (
      len(prompt_tokens) == 0 or not np.isscalar(prompt_tokens[0])):
    if pad_mask is not None or prompt_lengths is not None:
      raise ValueError("pad_mask / prompt_lengths: only for an array of prompts, not a list of"
                       " sequences (whose lengths already say which tokens are real)")
    rows = [np.asarray(row) for row in prompt_tokens]
    for i, row in enumerate(rows):
      if row.ndim != 1 or (row.size and not np.issubdtype(row.dtype, np.integer)):
        raise ValueError(f"prompt_tokens[{i}]: expected a 1-D sequence of int token ids, got"
                         f" {row.dtype} {row.shape}")
  else:
    rows = _rows_from_array(prompt_tokens, pad_mask, prompt_lengths)
  if not rows:
    raise ValueError("prompt_tokens: the batch is empty (no prompt)")
  for i, row in enumerate(rows):
    if row.size == 0:
      raise ValueError(f"prompt_tokens: prompt {i} is empty; every prompt needs at least one"
                       " token (e.g. BOS)")
    check_token_ids(row, vocab_size, f"prompt_tokens[{i}]")
  check_token_ids(np.asarray([pad_id]), vocab_size, "pad_id")
  length = bucket_length(max(row.size for row in rows))
  tokens = np.full((len(rows), length), pad_id, np.int32)
  valid = np.zeros((len(rows), length), bool)
  for i, row in enumerate(rows):
    tokens[i, length - row.size:] = row
    valid[i, length - row.size:] = True
  return tokens, valid


def check_left_padded(valid_BT: np.ndarray) -> None:
  """Raises unless every row is pads then at least one real token (False..., True...)."""
  for i, row in enumerate(valid_BT):
    real = int(row.sum())
    if real == 0:
      raise ValueError(f"pad_mask: row {i} has no real token (empty prompt)")
    if not row[len(row) - real:].all():
      raise ValueError(f"pad_mask: row {i} is not left-padded (pads first, then the real tokens);"
                       " generate() accepts any padding, prefill() needs left padding")
