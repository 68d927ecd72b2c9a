"""Prefill in token chunks (`prefill(..., chunk_tokens=)`, lalte_jax.inference.chunking): the same
logits, caches and greedy tokens as the prompt in one piece, for every mixer kind; memory that
grows less with the prompt; clear errors for a bad chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.inference import chunking
from lalte_jax.model import HybridLM

VARIANTS = ["gdn", "gdn_swa", "gdn_attn", "lalte", "lansa"]


def tiny_model(variant: str) -> HybridLM:
  config = get_model_config(f"{variant}-tiny").replace(init_std=0.2)
  return HybridLM(config, rngs=nnx.Rngs(0))


def prefilled(model, tokens, valid, chunk_tokens):
  cache = gen.init_cache(model, tokens.shape[0], max_length=128)
  logits, cache = gen.prefill(model, tokens, cache, pad_mask=valid, chunk_tokens=chunk_tokens)
  return np.asarray(logits), [np.asarray(leaf) for leaf in jax.tree.leaves(cache)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_equals_the_whole_prompt(variant):
  """77 tokens (row 1 left-padded by 5) in chunks of 16 (4 full chunks and a remainder, across
  the 64-token GDN chunk and the tiny windows) and of 5: the logits of the last token and every
  cache leaf (GDN states and conv rings, KV rings, LTE and NSA caches) as in one piece."""
  model = tiny_model(variant)
  length = 77
  tokens = np.random.default_rng(0).integers(1, model.config.vocab_size, (2, length))
  valid = np.ones((2, length), bool)
  valid[1, :5] = False
  want_logits, want_cache = prefilled(model, tokens, valid, None)
  for chunk_tokens in (16, 5):
    logits, cache = prefilled(model, tokens, valid, chunk_tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=2e-5)
    for got, want in zip(cache, want_cache, strict=True):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)  # infinities must match too


@pytest.mark.parametrize("variant, eviction", [
    ("lalte", None), ("gdn_attn", gen.EvictionConfig("tova", cache_size=32))])
def test_chunked_prefill_generates_the_same_tokens(variant, eviction):
  """Greedy tokens with the prompt in chunks of 16; a TOVA cache (which scores every prompt query,
  so its layers take the prompt whole) beside chunked GDN layers and MLPs."""
  model = tiny_model(variant)
  prompts = [list(range(1, 70)), list(range(3, 40))]
  want = gen.generate(model, prompts, 12, eviction=eviction)
  got = gen.generate(model, prompts, 12, eviction=eviction, prefill_chunk_tokens=16)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def _temp_bytes(model, length: int, chunk_tokens) -> int:
  fn = gen.prefill_fn(model, chunk_tokens)
  cache = jax.eval_shape(lambda: gen.init_cache(model, 1, max_length=length))
  compiled = fn.lower(jax.ShapeDtypeStruct((1, length), jnp.int32),
                      jax.ShapeDtypeStruct((1, length), bool), cache).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("variant", ["gdn", "lalte", "lansa", "gdn_attn"])
def test_chunks_slow_the_growth_of_prefill_memory(variant):
  """XLA's memory analysis of the compiled prefill (CPU, where attention runs its XLA version,
  quadratic in the prompt): from a 1K to a 4K prompt the temporaries of gdn-tiny grow by 4.9 KB a
  token in one piece and by 0.26 KB in chunks of 128, lalte-tiny's by 175 and 5.3 KB, lansa-tiny's
  by 263 and 16 KB, gdn_attn-tiny's by 90 KB in chunks when they were joined at the end instead
  of written in place, 8.8 KB since (2026-11-29)."""
  model = HybridLM(get_model_config(f"{variant}-tiny"), rngs=nnx.Rngs(0))
  growth = {chunk: _temp_bytes(model, 4096, chunk) - _temp_bytes(model, 1024, chunk)
            for chunk in (None, 128)}
  assert growth[128] < 0.2 * growth[None], growth


def test_chunked_gdn_prefill_holds_only_the_residual_stream_whole():
  """In chunks, a GDN model's prefill keeps one array the prompt's length: the residual stream
  (float32 [T, 64] at gdn-tiny, 256 bytes a token). Each block normalises its chunk of it and adds
  its mixer's and MLP's outputs in place, so neither a normalised copy of the prompt nor a
  mixer's whole output exists (before, 768 bytes a token: three such arrays)."""
  config = get_model_config("gdn-tiny")
  model = HybridLM(config, rngs=nnx.Rngs(0))
  growth_per_token = (_temp_bytes(model, 4096, 128) - _temp_bytes(model, 1024, 128)) / 3072
  residual_per_token = config.hidden_size * jnp.dtype(config.compute_dtype).itemsize
  assert growth_per_token <= 1.5 * residual_per_token, (growth_per_token, residual_per_token)


def test_add_chunks_adds_a_function_of_each_token():
  x = jnp.arange(2 * 11 * 3, dtype=jnp.float32).reshape(2, 11, 3)
  for chunk in (None, 1, 4, 11, 20):
    np.testing.assert_array_equal(chunking.add_chunks(lambda y: 2 * y + 1, x, chunk), 3 * x + 1)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_chunk_tokens_are_refused(bad):
  model = tiny_model("gdn")
  cache = gen.init_cache(model, 1)
  with pytest.raises(ValueError, match="chunk_tokens"):
    gen.prefill(model, [[1, 2, 3]], cache, chunk_tokens=bad)
  with pytest.raises(ValueError, match="chunk_tokens"):
    gen.generate(model, [[1, 2, 3]], 2, prefill_chunk_tokens=bad)
