"""The train step: NaN skipping, gradient accumulation, and a tiny laLTE that learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.data import IGNORE_LABEL
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.step import (TooManySkippedSteps, check_skipped_steps, init_train_state,
                        make_gradient_fn, make_train_step, model_graphdef)

SEQ_LEN, BATCH = 64, 4


def _batch(seed: int, vocab: int, period: int = 29) -> dict:
  """Rows repeating a random pattern longer than the tiny LTE window: predictable only by looking
  back beyond it. Next-token labels, the last position ignored."""
  rng = np.random.default_rng(seed)
  pattern = rng.integers(1, vocab, size=(BATCH, period))
  tokens = np.tile(pattern, (1, -(-SEQ_LEN // period)))[:, :SEQ_LEN].astype(np.int32)
  labels = np.concatenate([tokens[:, 1:], np.full((BATCH, 1), IGNORE_LABEL)], 1).astype(np.int32)
  return {"tokens": jnp.asarray(tokens), "labels": jnp.asarray(labels)}


def _leaves_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees (same dtypes, shapes and bytes)."""
  def same(x, y):
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
  return all(same(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def tiny_lalte_bf16_config() -> TrainConfig:
  """lalte-tiny in bf16 compute (float32 master weights), 40 steps at lr 3e-3."""
  return TrainConfig(variant="lalte", size="tiny", model_dtype="bfloat16", seq_len=SEQ_LEN,
                     global_batch_size=BATCH, steps=40, warmup_steps=2, lr=3e-3,
                     max_consecutive_skips=3)


@pytest.fixture(scope="module")
def bf16_setup():
  """tiny_lalte_bf16_config's model and one jitted step for several tests."""
  config = tiny_lalte_bf16_config()
  model_config = config.model_config()
  step = jax.jit(make_train_step(model_graphdef(model_config), model_config, config))
  state = init_train_state(model_config, config, jax.random.key(0))
  return config, model_config, step, state


@pytest.fixture(scope="module")
def transformer_setup():
  """A model without LTE layers (cheap to compile): NaN skipping does not depend on the mixer."""
  config = TrainConfig(variant="transformer", size="tiny", model_dtype="float32",
                       seq_len=SEQ_LEN, global_batch_size=BATCH, steps=10, warmup_steps=1,
                       max_consecutive_skips=3)
  model_config = config.model_config()
  step = jax.jit(make_train_step(model_graphdef(model_config), model_config, config))
  state = init_train_state(model_config, config, jax.random.key(0))
  return config, model_config, step, state


def test_tiny_lalte_loss_decreases(bf16_setup):
  config, model_config, step, state = bf16_setup
  batch = _batch(0, model_config.vocab_size)
  losses = []
  for _ in range(30):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert all(np.isfinite(losses)), losses
  assert np.mean(losses[-3:]) < 0.6 * losses[0], losses
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.params))
  shape = (model_config.num_lte_layers, model_config.lte.num_kv_heads)
  for name in ("lte_lambda", "lte_retained", "lte_retained_ema"):
    assert metrics[name].shape == shape
  assert int(state.step) == 30 and int(metrics["skipped_total"]) == 0
  assert float(metrics["lr"]) == pytest.approx(
      3e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (29 - 2) / 38))), rel=1e-5)


def test_nan_batch_is_skipped_bitwise(transformer_setup):
  config, model_config, step, state = transformer_setup
  good = _batch(1, model_config.vocab_size)
  # An id past the vocabulary: inside jit the embedding gather fills NaN, so loss and gradients
  # are NaN, like a corrupted record or an overflow would make them.
  poisoned = dict(good, tokens=good["tokens"].at[0, 5].set(model_config.vocab_size))
  state, _ = step(state, good)
  before = jax.device_get(state)
  state, metrics = step(state, poisoned)
  assert not np.isfinite(float(metrics["grad_norm"]))
  assert int(metrics["skipped"]) == 1 and int(metrics["skipped_consecutive"]) == 1
  assert _leaves_equal(state.params, before.params)
  assert _leaves_equal(state.opt_state, before.opt_state)
  assert int(state.step) == int(before.step) + 1  # the schedule moves on, as in torchtitan
  check_skipped_steps(metrics["skipped_consecutive"], 2, config.max_consecutive_skips)  # 1 < 3

  for _ in range(2):
    state, metrics = step(state, poisoned)
  assert _leaves_equal(state.params, before.params)
  with pytest.raises(TooManySkippedSteps, match="last 3 optimizer steps had a non-finite"):
    check_skipped_steps(metrics["skipped_consecutive"], 4, config.max_consecutive_skips)

  state, metrics = step(state, good)  # a good step resets the streak, keeps the total
  assert int(metrics["skipped"]) == 0 and int(metrics["skipped_consecutive"]) == 0
  assert int(metrics["skipped_total"]) == 3
  assert not _leaves_equal(state.params, before.params)


def test_gradient_accumulation_equals_one_big_batch():
  """Two micro-batches of 2 rows give the gradients of one batch of 4 (float32, no dropout:
  dropout masks are drawn per micro-batch and would differ). Labels are masked unevenly so the
  token-weighted CE normalisation matters; lambda > 0 so the sparsity term is exercised.
  pure_lte-tiny (LTE layers only) keeps the two compilations cheap."""
  config = TrainConfig(variant="pure_lte", size="tiny", model_dtype="float32", seq_len=SEQ_LEN,
                       global_batch_size=BATCH, steps=10, warmup_steps=1)
  base = config.model_config()
  model_config = base.replace(lte=dataclasses.replace(base.lte, router_dropout=0.0))
  graphdef = model_graphdef(model_config)
  state = init_train_state(model_config, config, jax.random.key(1))
  state = state.replace(controller=state.controller.replace(
      lambda_LH=jnp.full_like(state.controller.lambda_LH, 0.3)))
  batch = _batch(2, model_config.vocab_size)
  batch["labels"] = batch["labels"].at[1, :40].set(IGNORE_LABEL)

  results = {}
  for accum in (1, 2):
    fn = make_gradient_fn(graphdef, model_config, config.replace(grad_accum_steps=accum))
    results[accum] = jax.jit(fn)(state, batch)
  (grads_1, stats_1), (grads_2, stats_2) = results[1], results[2]
  for name in ("ce_sum", "sparsity_loss", "count_LH", "num_scored"):
    np.testing.assert_allclose(np.asarray(stats_2[name]), np.asarray(stats_1[name]), rtol=1e-6,
                               atol=1e-6, err_msg=name)
  assert float(stats_1["sparsity_loss"]) > 0
  for (path, g1), g2 in zip(jax.tree_util.tree_leaves_with_path(grads_1),
                            jax.tree.leaves(grads_2)):
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=0, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_model_without_lte_layers_has_no_sparsity_term(transformer_setup):
  _, model_config, step, state = transformer_setup
  state, metrics = step(state, _batch(3, model_config.vocab_size))
  assert float(metrics["sparsity_loss"]) == 0.0 and np.isfinite(float(metrics["loss"]))
  assert metrics["lte_lambda"].shape == (0, 0) and int(state.step) == 1
