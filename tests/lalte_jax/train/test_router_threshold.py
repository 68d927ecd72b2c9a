"""The router threshold (`lte_router_threshold_rate`): after a learning warm-up the frozen routers'
output biases follow the retention count, -r ln(c / cap) a step; nothing else of them moves."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.configs.repro import capacity
from lalte_jax.train import router_warmup
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.trainer import Trainer
from tests.lalte_jax.train.test_router_warmup import _leaves


def test_threshold_shift_is_proportional_in_log_space():
  cap, rate = 8, 0.1
  shift = router_warmup.threshold_shift(jnp.asarray([[8.0, 32.0], [2.0, 0.0]]), cap, rate)
  np.testing.assert_allclose(shift, [[0.0, -rate * np.log(4.0)],
                                     [rate * np.log(4.0), rate * np.log(16.0)]], rtol=1e-6)


def test_shift_router_bias_adds_each_layer_and_head_its_own_shift():
  # Two groups of two LTE blocks (block indices 1 and 3): depth order g0 b1, g0 b3, g1 b1, g1 b3.
  groups, heads = 2, 3
  bias = lambda: jnp.zeros((groups, heads))
  params = {"groups": {"blocks": {
      1: {"mixer": {"router": {"proj_bias": bias(), "proj_weight": jnp.ones((groups, heads, 4))}}},
      3: {"mixer": {"router": {"proj_bias": bias()}, "o_proj": jnp.ones(5)}}}}}
  shift_LH = jnp.arange(groups * 2 * heads, dtype=jnp.float32).reshape(groups * 2, heads)
  shifted = router_warmup.shift_router_bias(params, shift_LH, jnp.asarray(True))
  blocks = shifted["groups"]["blocks"]
  np.testing.assert_array_equal(blocks[1]["mixer"]["router"]["proj_bias"], shift_LH[0::2])
  np.testing.assert_array_equal(blocks[3]["mixer"]["router"]["proj_bias"], shift_LH[1::2])
  np.testing.assert_array_equal(blocks[1]["mixer"]["router"]["proj_weight"], 1.0)
  np.testing.assert_array_equal(blocks[3]["mixer"]["o_proj"], 1.0)
  held = router_warmup.shift_router_bias(params, shift_LH, jnp.asarray(False))
  for name, (_, value) in _leaves(held).items():
    np.testing.assert_array_equal(value, _leaves(params)[name][1])


def test_the_threshold_needs_frozen_routers_and_a_non_negative_rate():
  learn = TrainConfig(variant="lalte", size="tiny", steps=8, warmup_steps=1,
                      lte_routing_freeze_steps=4, lte_routing_freeze_learns=True)
  with pytest.raises(ValueError, match="lte_router_threshold_rate.*frozen_after_warmup"):
    dataclasses.replace(learn, lte_router_threshold_rate=0.01)
  frozen = dataclasses.replace(learn, lte_router_frozen_after_warmup=True)
  with pytest.raises(ValueError, match="lte_router_threshold_rate"):
    dataclasses.replace(frozen, lte_router_threshold_rate=-0.01)
  assert dataclasses.replace(frozen, lte_router_threshold_rate=0.01).lte_router_threshold_rate


def test_the_threshold_fork_is_a_frozen_fork_of_the_learning_warmup():
  spec = capacity.RunSpec("lalte_warmup_learn_threshold_fork", 5e-4, seed=9)
  config = capacity.study_config(spec)
  assert config.lte_router_frozen_after_warmup and config.lte_routing_freeze_learns
  assert config.lte_router_threshold_rate == capacity.ROUTER_THRESHOLD_RATE > 0
  assert capacity.fork_parent(spec).model == "lalte_warmup_learn"
  frozen = capacity.study_config(dataclasses.replace(spec, model="lalte_warmup_learn_frozen_fork"))
  assert frozen.lte_router_threshold_rate == 0.0
  # The two forks differ in the threshold alone.
  assert dataclasses.replace(config, lte_router_threshold_rate=0.0,
                             output_dir=frozen.output_dir) == frozen


@pytest.mark.slow
def test_after_the_warmup_only_the_router_bias_moves_and_by_the_count(tmp_path):
  freeze, rate = 2, 0.05
  config = TrainConfig(variant="lalte", size="tiny", model_dtype="float32", data="mqar",
                       seq_len=32, mqar_num_kv_pairs=2, global_batch_size=2, steps=4,
                       warmup_steps=1, lr=1e-2, lte_update_every=2,
                       lte_routing_freeze_steps=freeze, lte_routing_freeze_learns=True,
                       lte_router_frozen_after_warmup=True, lte_router_threshold_rate=rate,
                       output_dir=str(tmp_path), tensorboard=False, progress_bar=False)
  trainer = Trainer(config)
  cap = trainer.model_config.lte.cap
  for _ in range(freeze):
    trainer.train_step(next(trainer.data_iterator))
  for _ in range(config.steps - freeze):
    before = jax.tree.map(np.array, trainer.state.params)  # the step donates the state
    metrics = trainer.train_step(next(trainer.data_iterator))
    shift_LH = router_warmup.threshold_shift(jnp.asarray(metrics["lte_retained"]), cap, rate)
    assert (np.abs(np.asarray(shift_LH)) > 0).all()  # the tiny model keeps more than its cap
    expected = _leaves(router_warmup.shift_router_bias(before, shift_LH, True))
    after, old = _leaves(trainer.state.params), _leaves(before)
    router = [n for n, (path, _) in old.items() if router_warmup.is_router_parameter(path)]
    biases = [n for n, (path, _) in old.items() if router_warmup.is_router_bias(path)]
    assert biases
    for name in router:  # the bias by the count's shift, the rest of the router not at all
      np.testing.assert_allclose(after[name][1], expected[name][1], rtol=0, atol=1e-6)
    assert any((after[n][1] != old[n][1]).any() for n in old if n not in router)
