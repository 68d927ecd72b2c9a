"""Generation with constant-memory caches (GDN, SWA, LTE) and preallocated ones (full attention,
NSA): `init_cache`, `prefill`, `decode_step` and the jitted `generate` loop built on them.

    cache = init_cache(model, batch_size=2, max_length=256)
    logits_BV, cache = prefill(model, tokens_BT, cache, pad_mask=mask_BT)   # left-padded prompts
    logits_BV, cache = decode_step(model, next_token_B, cache)
    out = generate(model, [[1, 5, 9], [1, 7]], 32, temperature=0.0)        # out.tokens [B, 32]

Batches are left-padded. RoPE positions of full / SWA / NSA layers start at each row's first real
token (§3.1), LTE layers use padded-tensor indices (§5.5), and pads leave GDN states unchanged, so a
prompt gives the same tokens alone or in a batch. `generate` compiles once per (batch, prompt
bucket, new-token bucket, eviction) and takes temperature / top-k / top-p / stop tokens as traced
values. CLI: `python -m lalte_jax.generate --checkpoint DIR --prompt "..."` (see
`lalte_jax.inference.cli`).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax.inference import caches, chunking, prompts, sampling, stack
from lalte_jax.inference.caches import ModelCache
from lalte_jax.inference.eviction import EvictionConfig

__all__ = ["EvictionConfig", "GenerationOutput", "ModelCache", "decode_step", "decode_step_fn",
           "generate", "init_cache", "prefill"]

# Traces of the jitted entries (a trace precedes every compile): lets tests check the buckets.
TRACE_COUNTS: collections.Counter = collections.Counter()


def init_cache(model, batch_size: int, max_length: int | None = None, *,
               eviction: EvictionConfig | None = None) -> ModelCache:
  """An empty cache for `batch_size` rows.

  max_length: padded tokens (prompt + generated) the full-attention and NSA caches can hold;
    required for models with such layers, ignored otherwise (their cache has a constant size).
  eviction: `EvictionConfig("tova" | "uniform", cache_size)` replaces the full-attention caches by
    a constant-size evicting cache (§7.1-7.2).
  """
  return caches.init_model_cache(model.config, batch_size, max_length, eviction)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("all_logits", "chunk_tokens"),
                   donate_argnums=(4,))
def _prefill_jit(graphdef, state, tokens_BT, valid_BT, cache, *, all_logits, chunk_tokens=None):
  TRACE_COUNTS["prefill"] += 1
  return stack.prefill_impl(nnx.merge(graphdef, state), tokens_BT, valid_BT, cache, all_logits,
                            chunk_tokens)


# XLA runs a GPU program's kernels as CUDA graphs, but only runs of several capturable kernels in a
# row by default. A decode step is ~700 small kernels and bound by their launches, so every run of
# them, however short, goes into a graph: lalte-1.4b at batch 32 after a 4K prompt, bf16 weights,
# one H100 (2026-11-26): 6.41 -> 5.17 ms a step, the same program measured in the same run with
# and without the option (docs/benchmarks.md, History). Other backends ignore it. (CUDA graphs
# with concurrent regions help decoding too, but XLA reads that option from XLA_FLAGS only: as a
# compile option here it changed nothing, so the serving entry points set it in the environment,
# `lalte_jax.xla_flags.SERVING_GPU`.)
DECODE_COMPILER_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}


def _decode(graphdef, state, token_B, cache):
  TRACE_COUNTS["decode"] += 1
  return stack.decode_impl(nnx.merge(graphdef, state), token_B, cache)


def _jit_decode(compiler_options: dict):
  """The jitted decode step (the cache donated), compiled with `compiler_options`."""
  return jax.jit(_decode, static_argnums=(0,), donate_argnums=(3,),
                 compiler_options=compiler_options)


_decode_jit = _jit_decode(DECODE_COMPILER_OPTIONS)


def _check_tokens(tokens, ndim: int, vocab_size: int, what: str) -> np.ndarray:
  array = np.asarray(tokens)
  if array.ndim != ndim or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"{what}: expected int token ids of rank {ndim}, got {array.dtype}"
                     f" {array.shape}")
  prompts.check_token_ids(array, vocab_size, what)
  return array


def prefill(model, tokens, cache: ModelCache, pad_mask=None, *, all_logits: bool = False,
            chunk_tokens: int | None = None) -> tuple[jax.Array, ModelCache]:
  """Runs left-padded prompts `tokens` [B, T] through an empty cache (the cache is donated).

  pad_mask: [B, T] bool, True = real token, pads first in every row; None = no padding.
  chunk_tokens: run the layers over this many tokens at a time, so that the
    prefill's memory grows much less with the prompt (`lalte_jax.inference.chunking`; the same
    result); None: the whole prompt at once.
  Returns logits [B, V] float32 of each row's last token ([B, T, V] with `all_logits`) and the
  cache. Raises ValueError for empty prompts, ids outside the vocabulary, a used cache, a prompt
  longer than the cache's `max_length`, or a chunk_tokens that is not a positive int.
  """
  chunk_tokens = chunking.check_chunk_tokens(chunk_tokens)
  config = model.config
  tokens = _check_tokens(tokens, 2, config.vocab_size, "tokens")
  batch, length = tokens.shape
  if length == 0:
    raise ValueError("tokens: the prompt is empty (length 0)")
  valid = np.ones((batch, length), bool) if pad_mask is None else np.asarray(pad_mask)
  if valid.shape != (batch, length) or valid.dtype != bool:
    raise ValueError(f"pad_mask: expected bool {(batch, length)}, got {valid.dtype}"
                     f" {valid.shape}")
  prompts.check_left_padded(valid)
  if cache.pad_count_B.shape[0] != batch:
    raise ValueError(f"cache: built for batch {cache.pad_count_B.shape[0]}, tokens have {batch}")
  if int(cache.position) != 0:
    raise ValueError("cache: prefill needs an empty cache from init_cache (this one holds"
                     f" {int(cache.position)} tokens); continue with decode_step")
  if cache.max_length is not None and length > cache.max_length:
    raise ValueError(f"tokens: the prompt has {length} tokens (pads included) but the"
                     f" full-attention/NSA cache holds max_length={cache.max_length}")
  graphdef, state = nnx.split(model)
  return _prefill_jit(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid), cache,
                      all_logits=all_logits, chunk_tokens=chunk_tokens)


def decode_step(model, token, cache: ModelCache, *, validate: bool = True
                ) -> tuple[jax.Array, ModelCache]:
  """Feeds one token per row (`token` [B]) after a prefill; returns logits [B, V] and the cache.

  The input cache is donated (use the returned one). `validate=False` skips the host-side checks
  (token range, a prefilled cache, room left), which synchronise with the device.
  """
  if validate:
    config = model.config
    token = _check_tokens(token, 1, config.vocab_size, "token")
    if token.shape[0] != cache.pad_count_B.shape[0]:
      raise ValueError(f"token: {token.shape[0]} rows, the cache has"
                       f" {cache.pad_count_B.shape[0]}")
    position = int(cache.position)
    if position == 0:
      raise ValueError("cache: empty; call prefill with the prompt first")
    if cache.max_length is not None and position >= cache.max_length:
      raise ValueError(f"cache: full (max_length={cache.max_length} padded tokens); build it with"
                       " a larger max_length")
  graphdef, state = nnx.split(model)
  return _decode_jit(graphdef, state, jnp.asarray(token, jnp.int32), cache)


def prefill_fn(model, chunk_tokens: int | None = None):
  """`prefill` without its checks or model splitting, for benchmarks: returns
  `fn(tokens_BT, valid_BT, cache) -> (logits_BV, cache)` (int32 tokens, bool valid, an empty cache,
  donated); `fn.lower(tokens_BT, valid_BT, cache)` lowers it without running it."""
  graphdef, state = nnx.split(model)
  options = dict(all_logits=False, chunk_tokens=chunking.check_chunk_tokens(chunk_tokens))
  fn = functools.partial(_prefill_jit, graphdef, state, **options)
  fn.lower = functools.partial(_prefill_jit.lower, graphdef, state, **options)
  return fn


def decode_step_fn(model, compiler_options: dict | None = None):
  """`decode_step` without per-call checks or model splitting, for benchmarks and custom loops:
  returns `step(token_B, cache) -> (logits_BV, cache)` (the cache is donated);
  `step.lower(token_B, cache)` lowers it (e.g. for the compiled HLO) without running it.
  compiler_options: XLA options that replace or add to DECODE_COMPILER_OPTIONS for this step
  (e.g. {"xla_gpu_graph_min_graph_size": 5} to measure XLA's default), compiled separately.
  The step runs a copy of the model prepared for decoding once, here
  (`stack.prepared_for_decoding`: the GDN layers' input projections fused, as `generate` does
  before its loop), not in every step."""
  graphdef, state = nnx.split(stack.prepared_for_decoding(model))
  options = {**DECODE_COMPILER_OPTIONS, **(compiler_options or {})}
  jitted = _decode_step_closure(graphdef, tuple(sorted(options.items())))
  step = functools.partial(jitted, state)
  step.lower = functools.partial(jitted.lower, state)
  return step


# The step closes over the graph definition instead of taking it as a static argument: jit hashes
# a static argument on every call, and hashing lalte-1.4b's graph definition took 0.30 ms of host
# time per call (a step that does nothing: 0.41 ms per call with it static, 0.10 ms closed over;
# 2-core CPU, jax 0.10.2, 2026-11-28), against a batch-1 GPU step of a few ms. Cached per graph
# definition and options, so that steps of one model at several contexts share their compiles.
@functools.lru_cache(maxsize=8)
def _decode_step_closure(graphdef, options: tuple):
  return jax.jit(lambda state, token_B, cache: _decode(graphdef, state, token_B, cache),
                 donate_argnums=(2,), compiler_options=dict(options))


@flax.struct.dataclass
class GenerationOutput:
  tokens: jax.Array  # [B, max_new_tokens] int32; after a stop token: pad_id
  lengths: jax.Array  # [B] int32 generated tokens per row, the stop token included


# A one-row projection (x [1, D] @ W) is what XLA's dot strength reduction rewrites into a
# multiply and a reduction that write and read a weight-sized product, ~3x the weight bytes; two
# rows make it a GEMM that reads the weights once. So `generate` decodes a single prompt as two
# identical rows and keeps the first: lalte-1.4b after a 4K prompt, bf16 weights, one H200
# (2026-11-28): 5.62 ms a step at batch 1, 4.51 ms at batch 2 (docs/benchmarks.md §4).
MIN_DECODE_ROWS = 2

# The name scope of generate's decode loop (tests find the loop's computations by it). The loop
# runs one decode step per iteration and checks its stop condition after each; eight steps per
# iteration (a fixed-count inner loop) measured no faster: one H200, 2026-11-29, lalte-1.4b B32
# after a 4K prompt, 4.30 ms a step either way (docs/benchmarks.md, History).
DECODE_LOOP_SCOPE = "decode_loop"


@functools.partial(jax.jit, static_argnums=(0, 1),
                   static_argnames=("new_bucket", "max_length", "eviction", "chunk_tokens"),
                   compiler_options=DECODE_COMPILER_OPTIONS)
def _generate_jit(graphdef, config, state, tokens_BP, valid_BP, max_new_tokens, params, stop_S,
                  key, pad_id, *, new_bucket, max_length, eviction, chunk_tokens=None):
  TRACE_COUNTS["generate"] += 1
  model = nnx.merge(graphdef, state)
  rows = tokens_BP.shape[0]  # the caller's rows; copies of the last one fill the batch up
  if rows < MIN_DECODE_ROWS:
    fill = MIN_DECODE_ROWS - rows
    tokens_BP = jnp.concatenate([tokens_BP] + [tokens_BP[-1:]] * fill)
    valid_BP = jnp.concatenate([valid_BP] + [valid_BP[-1:]] * fill)
  batch = tokens_BP.shape[0]
  cache = caches.build_cache(config, batch, max_length, eviction)
  logits_BV, cache = stack.prefill_impl(model, tokens_BP, valid_BP, cache, all_logits=False,
                                        chunk_tokens=chunk_tokens)

  def cond(carry):
    step, _, _, done_B, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done_B[:rows])  # filler rows never hold it up

  groups = stack.decode_groups(model)  # split here, so the loop reads them without copies

  def one_step(carry):
    step, logits_BV, cache, done_B, out_BN = carry
    token_B = sampling.sample_tokens(logits_BV, jax.random.fold_in(key, step), params)
    token_B = jnp.where(done_B, pad_id, token_B)
    out_BN = jax.lax.dynamic_update_slice_in_dim(out_BN, token_B[:, None], step, axis=1)
    done_B = done_B | jnp.any(token_B[:, None] == stop_S[None, :], axis=1)
    # The last iteration's decode is not needed; skipping it would cost a cond on every step.
    logits_BV, cache = stack.decode_impl(model, token_B, cache, groups)
    return step + 1, logits_BV, cache, done_B, out_BN

  out_BN = jnp.full((batch, new_bucket), pad_id, jnp.int32)
  carry = (jnp.zeros((), jnp.int32), logits_BV, cache, jnp.zeros((batch,), bool), out_BN)
  with jax.named_scope(DECODE_LOOP_SCOPE):  # names the loop in the compiled program's metadata
    step, _, _, _, out_BN = jax.lax.while_loop(cond, one_step, carry)
  out_BN = out_BN[:rows]
  # A row's length: up to and including its first stop token, else every generated token.
  is_stop_BN = jnp.any(out_BN[:, :, None] == stop_S[None, None, :], axis=-1)
  is_stop_BN = is_stop_BN & (jnp.arange(new_bucket) < step)[None]
  first_stop_B = jnp.where(jnp.any(is_stop_BN, axis=1), jnp.argmax(is_stop_BN, axis=1) + 1, step)
  return out_BN, first_stop_B.astype(jnp.int32)


def _generate_arguments(model, prompt_tokens, max_new_tokens: int, *, pad_mask=None,
                        prompt_lengths=None, temperature: float = 0.0, top_k: int | None = None,
                        top_p: float | None = None, stop_tokens: Sequence[int] = (),
                        rng: jax.Array | None = None, eviction: EvictionConfig | None = None,
                        pad_id: int = 0, prefill_chunk_tokens: int | None = None
                        ) -> tuple[tuple, dict]:
  """`generate`'s arguments checked and turned into those of its compiled program:
  (positional, keyword) for `_generate_jit`."""
  config = model.config
  if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens: must be a positive int, got {max_new_tokens!r}")
  chunk_tokens = chunking.check_chunk_tokens(prefill_chunk_tokens)
  params = sampling.make_sampling_params(temperature, top_k, top_p)
  if temperature > 0 and rng is None:
    raise ValueError("rng: sampling (temperature > 0) needs an explicit jax.random.key")
  key = jax.random.key(0) if rng is None else rng
  tokens_BP, valid_BP = prompts.left_pad_prompts(
      prompt_tokens, pad_mask=pad_mask, prompt_lengths=prompt_lengths,
      vocab_size=config.vocab_size, pad_id=pad_id)
  stop = np.asarray(list(stop_tokens), np.int64).reshape(-1)
  prompts.check_token_ids(stop, config.vocab_size, "stop_tokens")
  # Stop lists padded to a multiple of 8 with -1 (never sampled) so their count rarely recompiles.
  stop_S = np.full((max(8, -(-stop.size // 8) * 8),), -1, np.int32)
  stop_S[:stop.size] = stop
  new_bucket = prompts.bucket_length(int(max_new_tokens))
  max_length = caches.check_cache_request(config, tokens_BP.shape[0],
                                          tokens_BP.shape[1] + new_bucket, eviction)
  graphdef, state = nnx.split(model)
  return ((graphdef, config, state, jnp.asarray(tokens_BP), jnp.asarray(valid_BP),
           jnp.asarray(max_new_tokens, jnp.int32), params, jnp.asarray(stop_S), key,
           jnp.asarray(pad_id, jnp.int32)),
          {"new_bucket": new_bucket, "max_length": max_length, "eviction": eviction,
           "chunk_tokens": chunk_tokens})


def generate(model, prompt_tokens, max_new_tokens: int, *, pad_mask=None, prompt_lengths=None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             stop_tokens: Sequence[int] = (), rng: jax.Array | None = None,
             eviction: EvictionConfig | None = None, pad_id: int = 0,
             prefill_chunk_tokens: int | None = None) -> GenerationOutput:
  """Generates up to `max_new_tokens` tokens per prompt (greedy when temperature == 0).

  prompt_tokens: a list of token-id sequences, or an int array [B, T] with `pad_mask` ([B, T]
    bool, True = real, any padding side) or `prompt_lengths` ([B], the first L_b tokens are real).
  stop_tokens: ids that end a row (the stop token is kept in the output); rows stop independently,
    the loop when every row has stopped.
  rng: a `jax.random.key`, required when temperature > 0.
  eviction: an `EvictionConfig` for the full-attention layers (TOVA / uniform, §7.1-7.2).
  prefill_chunk_tokens: the prompt's layers run over this many tokens at a time
    (`prefill`'s chunk_tokens: less memory for long prompts, the same tokens).
  Raises ValueError for empty prompts, ids outside the vocabulary, max_new_tokens < 1, or bad
  sampling or chunk arguments.
  """
  args, kwargs = _generate_arguments(
      model, prompt_tokens, max_new_tokens, pad_mask=pad_mask, prompt_lengths=prompt_lengths,
      temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens, rng=rng,
      eviction=eviction, pad_id=pad_id, prefill_chunk_tokens=prefill_chunk_tokens)
  out_BN, lengths_B = _generate_jit(*args, **kwargs)
  return GenerationOutput(tokens=out_BN[:, :max_new_tokens], lengths=lengths_B)


def lower_generate(model, prompt_tokens, max_new_tokens: int, **options) -> jax.stages.Lowered:
  """The program `generate` runs for these arguments (the same as `generate`'s), lowered:
  `.compile().as_text()` gives its HLO (tools/bench_serving.py's profile). One program serves
  every max_new_tokens of a bucket (prompts.bucket_length)."""
  args, kwargs = _generate_arguments(model, prompt_tokens, max_new_tokens, **options)
  return _generate_jit.lower(*args, **kwargs)


if __name__ == "__main__":
  import sys
  from lalte_jax.inference.cli import main
  sys.exit(main())
