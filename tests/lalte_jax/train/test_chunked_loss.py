"""The chunked cross-entropy (`loss_chunk_tokens`): the loss and gradients of the whole-logits path,
without its [B, T, V] float32 buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.data import IGNORE_LABEL
from lalte_jax.loss import chunked_cross_entropy_sum, masked_cross_entropy_sum
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.step import init_train_state, make_gradient_fn, model_graphdef


def _batch(seed: int, vocab: int, batch: int, seq_len: int) -> dict:
  """Random tokens with next-token labels; the last position and part of row 0 unscored."""
  tokens = np.random.default_rng(seed).integers(0, vocab, size=(batch, seq_len), dtype=np.int32)
  labels = np.concatenate([tokens[:, 1:], np.full((batch, 1), IGNORE_LABEL, np.int32)], 1)
  labels[0, : seq_len // 3] = IGNORE_LABEL
  return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}


def _setup(config: TrainConfig):
  model_config = config.model_config()
  graphdef = model_graphdef(model_config)
  state = init_train_state(model_config, config, jax.random.key(0))
  return model_config, graphdef, state


@pytest.mark.parametrize("chunk_tokens", [7, 16, 48, 1000])
def test_chunked_sum_equals_whole_sum_on_a_linear_head(chunk_tokens):
  """48 divides B*T = 48, 7 and 16 leave a ragged last chunk, 1000 exceeds B*T."""
  keys = jax.random.split(jax.random.key(3), 3)
  hidden_BTD = jax.random.normal(keys[0], (3, 16, 8))
  head_DV = jax.random.normal(keys[1], (8, 40))
  labels_BT = jax.random.randint(keys[2], (3, 16), 0, 40).at[1, :5].set(IGNORE_LABEL)

  def whole(hidden_BTD, head_DV):
    return masked_cross_entropy_sum(hidden_BTD @ head_DV, labels_BT)

  def chunked(hidden_BTD, head_DV):
    return chunked_cross_entropy_sum(lambda h: h @ head_DV, hidden_BTD, labels_BT, chunk_tokens)

  want, want_grads = jax.value_and_grad(whole, argnums=(0, 1))(hidden_BTD, head_DV)
  got, got_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden_BTD, head_DV)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  for g, w in zip(got_grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie_embeddings", [True, False])
def test_train_gradients_equal_the_unchunked_path(tie_embeddings):
  """float32 transformer-tiny, B*T = 4 * 64 = 256: chunks of 64 divide it, chunks of 100 leave a
  ragged last chunk of 56; tied and untied heads."""
  config = TrainConfig(variant="transformer", size="tiny", model_dtype="float32", seq_len=64,
                       global_batch_size=4, steps=10, warmup_steps=1,
                       model_overrides={"tie_embeddings": tie_embeddings})
  model_config, graphdef, state = _setup(config)
  batch = _batch(0, model_config.vocab_size, 4, 64)
  results = {}
  for chunk_tokens in ((0, 64, 100) if tie_embeddings else (0, 100)):
    fn = make_gradient_fn(graphdef, model_config, config.replace(loss_chunk_tokens=chunk_tokens))
    results[chunk_tokens] = jax.jit(fn)(state, batch)
  want_grads, want_stats = results.pop(0)
  for chunk_tokens, (grads, stats) in results.items():
    np.testing.assert_allclose(float(stats["ce_sum"]), float(want_stats["ce_sum"]), rtol=1e-6,
                               err_msg=f"chunk {chunk_tokens}")
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(want_grads), strict=True):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7,
                                 err_msg=f"chunk {chunk_tokens} {jax.tree_util.keystr(path)}")


def test_chunking_frees_at_least_one_float32_logits_buffer():
  """Compiled temporary memory of the gradient function, V 8192, B 2, T 256: chunks of 128
  positions must save at least one float32 [B, T, V] (16 MiB)."""
  batch_size, seq_len, vocab = 2, 256, 8192
  config = TrainConfig(variant="transformer", size="tiny", model_dtype="float32",
                       seq_len=seq_len, global_batch_size=batch_size, steps=10, warmup_steps=1,
                       model_overrides={"vocab_size": vocab})
  model_config, graphdef, state = _setup(config)
  batch = _batch(1, vocab, batch_size, seq_len)
  temp_bytes = {}
  for chunk_tokens in (0, 128):
    fn = make_gradient_fn(graphdef, model_config, config.replace(loss_chunk_tokens=chunk_tokens))
    analysis = jax.jit(fn).lower(state, batch).compile().memory_analysis()
    if analysis is None or not hasattr(analysis, "temp_size_in_bytes"):
      pytest.skip("this jaxlib's compiled executables report no memory_analysis()")
    temp_bytes[chunk_tokens] = analysis.temp_size_in_bytes
  logits_bytes = batch_size * seq_len * vocab * 4
  print(f"temp bytes: unchunked {temp_bytes[0]}, chunks of 128 {temp_bytes[128]},"
        f" one [B, T, V] float32 {logits_bytes}")
  assert temp_bytes[0] - temp_bytes[128] >= logits_bytes, temp_bytes


@pytest.mark.parametrize("value", [-1, -128])
def test_negative_chunk_size_names_the_field(value):
  with pytest.raises(ValueError, match=r"TrainConfig\.loss_chunk_tokens: must be >= 0"):
    TrainConfig(loss_chunk_tokens=value)
