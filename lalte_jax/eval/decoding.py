"""The model calls of every evaluation task, all through the inference path of lalte_jax.generate.

- `teacher_forced_predictions`: argmax of the prefill logits at every position (MQAR accuracy);
- `token_logprobs`: log-probabilities of each next token from the prefill logits (perplexity,
  lm-eval log-likelihoods);
- `greedy_generate`: greedy completions with the constant-memory prefill + decode loop.

Every call goes through `prefill` / `generate` with their caches, so LTE layers keep at most `cap`
out-of-window tokens per head, computed at the end of the input (G24: the
paper's evaluations ran the cached path, not the uncapped training mask). Rows are processed in
batches of `batch_size`; prompts of different lengths are left-padded, as `prefill` requires. A
last, partial batch is filled up with copies of its last row (results dropped), so that one
compiled program serves every batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lalte_jax import generate as generation
from lalte_jax.inference import prompts as prompt_utils


def _check_batch_size(batch_size: int) -> None:
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size: must be a positive int, got {batch_size!r}")


def _batches(num_rows: int, batch_size: int, progress=None) -> Iterator[slice]:
  for start in range(0, num_rows, batch_size):
    yield slice(start, min(start + batch_size, num_rows))
    if progress is not None:
      progress.update(min(batch_size, num_rows - start))


def _fill(rows: list, batch_size: int) -> list:
  """`rows` padded to `batch_size` entries with copies of the last one."""
  return rows + [rows[-1]] * (batch_size - len(rows))


def _prefill_logits(model, tokens_BT: np.ndarray, valid_BT: np.ndarray | None) -> jax.Array:
  """Prefill logits [B, T, V] of left-padded rows through a fresh cache."""
  batch, length = tokens_BT.shape
  cache = generation.init_cache(model, batch, max_length=length)
  logits_BTV, _ = generation.prefill(model, tokens_BT, cache, pad_mask=valid_BT, all_logits=True)
  return logits_BTV


def teacher_forced_predictions(model, tokens_NT, *, batch_size: int = 16,
                               progress=None) -> np.ndarray:
  """Argmax prediction int32 [N, T] at every position of equal-length rows `tokens_NT`."""
  _check_batch_size(batch_size)
  tokens_NT = np.asarray(tokens_NT, np.int32)
  if tokens_NT.ndim != 2:
    raise ValueError(f"tokens_NT: expected [rows, length], got shape {tokens_NT.shape}")
  batch_size = min(batch_size, max(1, len(tokens_NT)))  # never pad beyond the data
  predictions = []
  for rows in _batches(len(tokens_NT), batch_size, progress):
    count = rows.stop - rows.start
    tokens_BT = np.stack(_fill(list(tokens_NT[rows]), batch_size))
    logits_BTV = _prefill_logits(model, tokens_BT, None)
    predictions.append(np.asarray(jnp.argmax(logits_BTV, axis=-1), np.int32)[:count])
  return np.concatenate(predictions)


def token_logprobs(model, sequences: Sequence[Sequence[int]], *, batch_size: int = 8,
                   progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
  """For each token sequence s (length n >= 2): (logp float64 [n-1], greedy bool [n-1]) where
  logp[t] = log P(s[t+1] | s[:t+1]) and greedy[t] says whether s[t+1] is the argmax there."""
  _check_batch_size(batch_size)
  sequences = [np.asarray(s, np.int64) for s in sequences]
  for i, s in enumerate(sequences):
    if s.ndim != 1 or s.size < 2:
      raise ValueError(f"sequences[{i}]: needs at least 2 tokens (a context and a target), got"
                       f" shape {s.shape}")
  # Sorting by length keeps padding (and the number of compiled shapes) small.
  order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
  batch_size = min(batch_size, max(1, len(sequences)))
  results: list = [None] * len(sequences)
  for rows in _batches(len(order), batch_size, progress):
    indices = order[rows]
    tokens_BT, valid_BT = prompt_utils.left_pad_prompts(
        _fill([sequences[i] for i in indices], batch_size), vocab_size=model.config.vocab_size)
    logits_BTV = _prefill_logits(model, tokens_BT, valid_BT)
    # Gather on the device: only [B, T] values come back, never the [B, T, V] logits.
    targets_BT = jnp.asarray(np.concatenate([tokens_BT[:, 1:], tokens_BT[:, :1]], axis=1))
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    logp_BT = np.asarray(jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0])
    greedy_BT = np.asarray(jnp.argmax(logits_BTV, axis=-1) == targets_BT)
    length = tokens_BT.shape[1]
    for row, i in enumerate(indices):
      n = len(sequences[i])
      # Real tokens fill the last n positions; position t predicts t + 1.
      results[i] = (logp_BT[row, length - n:length - 1].astype(np.float64),
                    greedy_BT[row, length - n:length - 1])
  return results


def greedy_generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    stop_ids: Sequence[int] = (), batch_size: int = 8,
                    progress=None) -> list[list[int]]:
  """Greedy completions (token ids, stop token removed) of each prompt, in order."""
  _check_batch_size(batch_size)
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  batch_size = min(batch_size, max(1, len(prompts)))
  completions: list = [None] * len(prompts)
  stop = set(int(i) for i in stop_ids)
  for rows in _batches(len(order), batch_size, progress):
    indices = order[rows]
    batch = _fill([np.asarray(prompts[i], np.int32) for i in indices], batch_size)
    out = generation.generate(model, batch, max_new_tokens, temperature=0.0,
                              stop_tokens=tuple(stop))
    tokens_BN, lengths_B = np.asarray(out.tokens), np.asarray(out.lengths)
    for row, i in enumerate(indices):
      ids = [int(t) for t in tokens_BN[row, :lengths_B[row]]]
      if ids and ids[-1] in stop:
        ids = ids[:-1]
      completions[i] = ids
  return completions
