"""The router warm-up (`lte_routing_freeze_steps`): every token kept, no router gradient or
update, the controller held and then started from its initial state; and a Trainer given its
training source."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.data import MQARSource, curricula
from lalte_jax.mixers.lte import RoutingControls
from lalte_jax.model import HybridLM
from lalte_jax.train import router_warmup
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.lte_controller import ControllerConfig
from lalte_jax.train.trainer import Trainer


def _leaves(tree) -> dict:
  return {jax.tree_util.keystr(path): (path, np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_keep_every_token_overrides_only_the_router_output_bias():
  params = {"groups": {"blocks": {1: {"mixer": {"router": {"proj_bias": jnp.full((1, 2), 0.5),
                                                           "proj_weight": jnp.ones((1, 2, 4))},
                                              "o_proj": jnp.ones(3)}}}}}
  on = _leaves(router_warmup.keep_every_token(params, jnp.asarray(True)))
  off = _leaves(router_warmup.keep_every_token(params, jnp.asarray(False)))
  for name, (path, value) in _leaves(params).items():
    expected = router_warmup.ROUTER_OFF_LOGIT if name.endswith("['proj_bias']") else value
    np.testing.assert_array_equal(on[name][1], np.broadcast_to(expected, value.shape))
    np.testing.assert_array_equal(off[name][1], value)
    assert router_warmup.is_router_parameter(path) == ("['router']" in name)
  new = jax.tree.map(lambda x: x + 1, params)
  held = _leaves(router_warmup.hold_routers(new, params, jnp.asarray(True)))
  for name, (path, value) in _leaves(params).items():
    np.testing.assert_array_equal(held[name][1], value if "['router']" in name else value + 1)


@pytest.mark.slow
def test_every_token_kept_is_causal_attention_and_retains_every_position():
  seq_len = 40
  config = get_model_config("lalte-tiny").replace(dtype="float32", init_std=0.2)
  # A window as long as the sequence: nothing is ever evicted.
  full_window = config.replace(lte=dataclasses.replace(config.lte, window=seq_len - 1))
  evicting, reference = (HybridLM(c, rngs=nnx.Rngs(0)) for c in (config, full_window))
  graphdef, params = nnx.split(evicting, nnx.Param)
  forced = router_warmup.keep_every_token(nnx.to_pure_dict(params), True)
  nnx.replace_by_pure_dict(params, forced)
  tokens = jax.random.randint(jax.random.key(1), (2, seq_len), 1, config.vocab_size)
  logits, aux = nnx.merge(graphdef, params)(tokens, return_aux=True)
  np.testing.assert_allclose(logits, reference(tokens), rtol=2e-5, atol=2e-5)
  assert (np.asarray(aux.lte_scores) == 0.5).all()
  np.testing.assert_array_equal(aux.lte_retained, seq_len - config.lte.router_margin)
  # Without the override the router evicts some of these positions, so the check has teeth.
  _, plain = evicting(tokens, return_aux=True)
  assert (np.asarray(plain.lte_scores) <= 0).any()


@pytest.mark.slow
def test_revealing_every_token_sees_every_token_and_passes_the_router_gradient():
  """The learning warm-up's forward: causal attention over every token, the scores untouched,
  and a straight-through gradient that reaches the router (the bias override passes none)."""
  seq_len = 40
  config = get_model_config("lalte-tiny").replace(dtype="float32", init_std=0.2)
  full_window = config.replace(lte=dataclasses.replace(config.lte, window=seq_len - 1))
  model, reference = (HybridLM(c, rngs=nnx.Rngs(0)) for c in (config, full_window))
  tokens = jax.random.randint(jax.random.key(1), (2, seq_len), 1, config.vocab_size)
  key = jax.random.key(3)
  reveal_all = RoutingControls(reveal_probability=jnp.float32(1.0))
  logits, aux = model(tokens, dropout_key=key, routing=reveal_all, return_aux=True)
  # With every token visible the router's dropout changes no output.
  np.testing.assert_allclose(logits, reference(tokens), rtol=2e-5, atol=2e-5)
  plain_logits, plain = model(tokens, dropout_key=key, return_aux=True)
  # The first LTE layer's scores are untouched (later layers read changed inputs).
  np.testing.assert_allclose(aux.lte_scores[0], plain.lte_scores[0], rtol=1e-5, atol=1e-6)
  assert (np.asarray(plain.lte_scores) <= 0).any()  # some tokens would be evicted
  assert not np.allclose(plain_logits, logits, atol=1e-4)
  graphdef, params = nnx.split(model, nnx.Param)
  weights = jax.random.normal(jax.random.key(2), logits.shape)

  def router_gradients(state, routing):
    loss = lambda state: jnp.sum(nnx.merge(graphdef, state)(
        tokens, dropout_key=key, routing=routing) * weights)
    grads = jax.grad(loss)(state)
    return [np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
            if router_warmup.is_router_parameter(path)]

  pure = nnx.to_pure_dict(params)  # the train state's form, which the override expects
  learning = router_gradients(pure, reveal_all)
  frozen = router_gradients(router_warmup.keep_every_token(pure, True), None)
  # Cutting the scores' gradient leaves the routers none, revealed or not.
  cut = router_gradients(pure, RoutingControls(reveal_probability=jnp.float32(1.0),
                                               score_gradient=jnp.asarray(False)))
  assert learning and all(np.isfinite(g).all() for g in learning)
  assert any(np.abs(g).max() > 0 for g in learning)
  assert all((g == 0).all() for g in frozen) and all((g == 0).all() for g in cut)
  # The cut changes no output (plain_logits: the same call without it).
  np.testing.assert_array_equal(
      model(tokens, dropout_key=key, routing=RoutingControls(score_gradient=False)), plain_logits)
  with pytest.raises(ValueError, match="reveal_probability needs a dropout_key"):
    model(tokens, routing=RoutingControls(reveal_probability=1.0))


def test_a_revealed_token_is_visible_with_the_given_probability(monkeypatch):
  """Each evicted token is revealed independently per row, token and KV head, with the given
  probability; kept tokens stay kept; 0 reveals nothing, 1 everything."""
  from lalte_jax.mixers import lte  # pylint: disable=import-outside-toplevel
  seq_len, batch = 64, 4
  config = get_model_config("lalte-tiny").replace(dtype="float32", init_std=0.2)
  layer = lte.LTEAttention(config, rngs=nnx.Rngs(0))
  kept_masks = []

  def attention_spy(q_BTHD, k, v, *, kept_BSK, **kwargs):
    del k, v, kwargs
    kept_masks.append(np.asarray(kept_BSK))
    return jnp.zeros_like(q_BTHD)

  monkeypatch.setattr(lte, "masked_attention", attention_spy)
  x = jax.random.normal(jax.random.key(1), (batch, seq_len, config.hidden_size))
  key = jax.random.key(5)
  _, score_BTK = layer(x, dropout_key=key)
  for probability in (0.25, jnp.float32(0.25), 1.0):
    layer(x, dropout_key=key, routing=RoutingControls(reveal_probability=probability))
  none, quarter, traced_quarter, every = kept_masks
  selected = np.asarray(score_BTK) > 0
  np.testing.assert_array_equal(none, selected)
  assert every.all()
  np.testing.assert_array_equal(quarter, traced_quarter)  # the same draw, traced or not
  assert quarter[selected].all()
  evicted = ~selected
  assert evicted.sum() > 100, evicted.sum()
  assert 0.15 < quarter[evicted].mean() < 0.35, quarter[evicted].mean()
  # Drawn per row and per KV head: the revealed sets differ between them.
  assert (quarter[0] != quarter[1]).any() and (quarter[..., 0] != quarter[..., 1]).any()


def test_reveal_probability_falls_to_zero_over_an_annealed_warmup():
  steps = jnp.arange(6)
  annealed = router_warmup.reveal_probability(steps, 4, anneal=True)
  np.testing.assert_allclose(annealed, [1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
  np.testing.assert_array_equal(router_warmup.reveal_probability(steps, 4, anneal=False),
                                [1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(router_warmup.reveal_probability(steps, 0, anneal=True), 0)
  with pytest.raises(ValueError, match="lte_routing_freeze_anneal"):
    TrainConfig(variant="lalte", size="tiny", steps=4, lte_routing_freeze_steps=2,
                lte_routing_freeze_anneal=True)


def test_routing_controls_follow_the_warmup_variant():
  base = TrainConfig(variant="lalte", size="tiny", steps=8, warmup_steps=1,
                     lte_routing_freeze_steps=4)
  steps = jnp.arange(6)
  assert router_warmup.routing_controls(steps, base) is None  # a frozen warm-up: as §4
  learn = dataclasses.replace(base, lte_routing_freeze_learns=True)
  controls = router_warmup.routing_controls(steps, learn)
  np.testing.assert_array_equal(controls.reveal_probability, [1, 1, 1, 1, 0, 0])
  assert controls.score_gradient is True
  assert controls.task_gradient is True
  frozen_after = dataclasses.replace(learn, lte_router_frozen_after_warmup=True)
  controls = router_warmup.routing_controls(steps, frozen_after)
  np.testing.assert_array_equal(controls.score_gradient, [True] * 4 + [False] * 2)
  assert controls.task_gradient is True
  sparse_after = dataclasses.replace(learn, lte_router_sparsity_only_after_warmup=True)
  controls = router_warmup.routing_controls(steps, sparse_after)
  np.testing.assert_array_equal(controls.task_gradient, [True] * 4 + [False] * 2)
  assert controls.score_gradient is True
  with pytest.raises(ValueError, match="excludes lte_router_frozen_after_warmup"):
    dataclasses.replace(sparse_after, lte_router_frozen_after_warmup=True)
  with pytest.raises(ValueError, match="lte_router_sparsity_only_after_warmup"):
    dataclasses.replace(base, lte_router_sparsity_only_after_warmup=True)


@pytest.mark.slow
def test_routers_learn_in_the_warmup_with_the_controller_held_and_are_frozen_after_it(tmp_path):
  # One trainer for both phases (each trainer compiles its own step): in the warm-up the learning
  # variant adds no sparsity loss and holds the controller while the routers learn; after it
  # lte_router_frozen_after_warmup stops them. Without that flag the warm-up takes the same
  # path (the flag acts only after it, through the same routing controls).
  seq_len, freeze = 32, 2
  config = TrainConfig(variant="lalte", size="tiny", model_dtype="float32", data="mqar",
                       seq_len=seq_len, mqar_num_kv_pairs=2, global_batch_size=2, steps=4,
                       warmup_steps=1, lr=1e-2, lte_update_every=2,
                       lte_routing_freeze_steps=freeze, lte_routing_freeze_learns=True,
                       lte_router_frozen_after_warmup=True, output_dir=str(tmp_path),
                       tensorboard=False, progress_bar=False)
  trainer = Trainer(config)
  snapshots = [_leaves(trainer.state.params)]
  for step in range(1, config.steps + 1):
    metrics = trainer.train_step(next(trainer.data_iterator))
    snapshots.append(_leaves(trainer.state.params))
    if step <= freeze:
      assert np.isfinite(float(metrics["ce_loss"]))
      np.testing.assert_array_equal(metrics["sparsity_loss"], 0.0)
      np.testing.assert_array_equal(trainer.state.controller.lambda_LH, 0.0)
      np.testing.assert_array_equal(trainer.state.controller.ema_LH, float(seq_len))
  router = [n for n, (path, _) in snapshots[0].items() if router_warmup.is_router_parameter(path)]
  others = [n for n in snapshots[0] if n not in router]
  changed = lambda before, after, names: any((before[n][1] != after[n][1]).any() for n in names)
  assert router and changed(snapshots[0], snapshots[freeze], router)  # learned in the warm-up
  for before, after in zip(snapshots[freeze:], snapshots[freeze + 1:]):
    assert not changed(before, after, router)  # frozen after it
    assert changed(before, after, others)
  with pytest.raises(ValueError, match="lte_router_frozen_after_warmup"):
    dataclasses.replace(config, lte_routing_freeze_learns=False)
  with pytest.raises(ValueError, match="lte_routing_freeze_learns"):
    dataclasses.replace(config, lte_routing_freeze_steps=0, lte_router_frozen_after_warmup=False)


@pytest.mark.slow
def test_warmup_freezes_the_router_and_restarts_the_controller(tmp_path):
  # An odd warm-up with u = 2: counted from the start, lambda would move at step 4; counted
  # from the end of the warm-up, it moves at step 5.
  seq_len, freeze, period = 32, 3, 2
  config = TrainConfig(variant="lalte", size="tiny", model_dtype="float32", data="mqar",
                       seq_len=seq_len, mqar_num_kv_pairs=2, global_batch_size=2, steps=6,
                       warmup_steps=1, lr=1e-2, lte_update_every=period,
                       lte_routing_freeze_steps=freeze, output_dir=str(tmp_path),
                       tensorboard=False, progress_bar=False)
  # The trainer reads a staged curriculum it is given in order: its first batch is elements 0, 1.
  source = curricula.StagedCurriculum(
      tuple(MQARSource(num_examples=64, seq_len=seq_len, vocab_size=256, num_kv_pairs=2,
                       seed=seed) for seed in (7, 8)), (4,), 64)
  trainer = Trainer(config, train_source=source)
  margin = trainer.model_config.lte.router_margin
  initial = _leaves(trainer.state.params)
  ctrl = ControllerConfig(cap=trainer.model_config.lte.cap, update_every=period)
  a = ctrl.ema_weight
  first = next(trainer.data_iterator)
  np.testing.assert_array_equal(first["tokens"], np.stack([source[0]["tokens"],
                                                           source[1]["tokens"]]))
  for step in range(1, freeze + 3):
    metrics = trainer.train_step(first if step == 1 else next(trainer.data_iterator))
    params, controller = _leaves(trainer.state.params), trainer.state.controller
    mu = _leaves(trainer.state.opt_state[0].mu)
    router = [name for name, (path, _) in params.items()
              if router_warmup.is_router_parameter(path)]
    count = np.asarray(metrics["lte_retained"])
    if step <= freeze:  # every token kept; no gradient, no update; the controller held
      np.testing.assert_array_equal(count, seq_len - margin)
      assert all((params[n][1] == initial[n][1]).all() for n in router)
      assert all((mu[n][1] == 0).all() for n in router)
      assert not all((params[n][1] == initial[n][1]).all() for n in params if n not in router)
      np.testing.assert_array_equal(controller.lambda_LH, 0.0)
      np.testing.assert_array_equal(controller.ema_LH, float(seq_len))
    elif step == freeze + 1:  # the router learns; the controller's step 1 from its start
      assert any((mu[n][1] != 0).any() for n in router)
      assert any((params[n][1] != initial[n][1]).any() for n in router)
      ema = (1 - a) * seq_len + a * count
      np.testing.assert_allclose(controller.ema_LH, ema, rtol=1e-6)
      np.testing.assert_array_equal(controller.lambda_LH, 0.0)
    else:  # its step u: the first lambda update (lambda_init where the count is large)
      ema = (1 - a) * ema + a * count
      np.testing.assert_allclose(controller.ema_LH, ema, rtol=1e-6)
      expected = np.where(ema > ctrl.tolerance_low * ctrl.cap, ctrl.lambda_init, 0.0)
      assert expected.any()  # at init most tokens are kept, far above the cap
      np.testing.assert_allclose(controller.lambda_LH, expected, rtol=1e-6)
