"""AdamW, schedule and clipping against the formulas of §8.1 (torch semantics)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.train import optimizer as opt_lib
from lalte_jax.train.config import TrainConfig


def _config(**changes):
  return TrainConfig(**{"steps": 10, "warmup_steps": 4, "lr": 3e-4, **changes})


def _factor(s, warmup, total, ratio=0.1):
  return float(opt_lib.lr_factor(s, warmup_steps=warmup, total_steps=total, min_ratio=ratio))


def test_schedule_warmup_stable_step_and_cosine():
  assert [_factor(s, 4, 10) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
  assert _factor(4, 4, 10) == 1.0  # the one "stable" step s == warmup
  for s in range(5, 11):
    p = (s - 4) / 6
    assert _factor(s, 4, 10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)),
                                              rel=1e-6)
  assert _factor(10, 4, 10) == pytest.approx(0.1, rel=1e-6)  # lr_min reached at s = steps


@pytest.mark.parametrize("steps,warmup", [(20_480, 1024), (30_720, 512)])
def test_paper_schedules(steps, warmup):
  config = _config(steps=steps, warmup_steps=warmup)
  lrs = np.asarray(jax.vmap(lambda s: opt_lib.learning_rate(config, s))(jnp.arange(steps)))
  assert lrs[0] == pytest.approx(3e-4 / warmup, rel=1e-6)
  assert lrs[warmup - 1] == pytest.approx(3e-4) and lrs[warmup] == pytest.approx(3e-4)
  assert np.all(np.diff(lrs[:warmup]) > 0) and np.all(np.diff(lrs[warmup:]) <= 1e-12)
  assert lrs[-1] == pytest.approx(3e-5, rel=1e-4)  # one step short of 0.1x at s = steps - 1


def _torch_adamw_reference(params, grads_seq, lrs, b1, b2, eps, wd, max_norm):
  """torch.optim.AdamW + clip_grad_norm_ written out in float64 numpy."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t, (grads, lr) in enumerate(zip(grads_seq, lrs), start=1):
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6))
    for k in p:
      g = grads[k].astype(np.float64) * coef
      p[k] = p[k] * (1 - lr * wd)
      m[k] = b1 * m[k] + (1 - b1) * g
      v[k] = b2 * v[k] + (1 - b2) * g * g
      m_hat, v_hat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
      p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
  return p


def test_adamw_with_clipping_matches_torch_formulas():
  config = _config(weight_decay=0.1, adam_eps=1e-15, clip_norm=1.0)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
            "norm": rng.normal(size=(3,)).astype(np.float32)}  # 1-D params are decayed too
  # Step 1's gradient has norm > 1 (clipped), step 2's < 1 (untouched).
  grads_seq = [{k: (s * rng.normal(size=x.shape)).astype(np.float32) for k, x in params.items()}
               for s in (3.0, 0.05, 1.0)]
  lrs = [float(opt_lib.learning_rate(config, s)) for s in range(3)]
  tx = opt_lib.make_adamw(config)
  state_p = jax.tree.map(jnp.asarray, params)
  opt_state = tx.init(state_p)
  for grads, lr in zip(grads_seq, lrs):
    clipped, _ = opt_lib.clip_by_global_norm(jax.tree.map(jnp.asarray, grads), config.clip_norm)
    updates, opt_state = tx.update(clipped, opt_state, state_p)
    state_p = opt_lib.apply_updates(state_p, updates, jnp.float32(lr))
  expected = _torch_adamw_reference(params, grads_seq, lrs, 0.9, 0.95, 1e-15, 0.1, 1.0)
  for k in params:
    assert state_p[k].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(state_p[k]), expected[k], rtol=1e-6, atol=1e-7)


def test_clip_coefficient_is_torchs():
  grads = {"a": jnp.full((4,), 2.0), "b": jnp.zeros((2,))}  # norm 4
  clipped, norm = opt_lib.clip_by_global_norm(grads, 1.0)
  assert float(norm) == pytest.approx(4.0)
  np.testing.assert_allclose(np.asarray(clipped["a"]), 2.0 / (4.0 + 1e-6), rtol=1e-7)
  small = {"a": jnp.full((4,), 0.1)}
  np.testing.assert_array_equal(np.asarray(opt_lib.clip_by_global_norm(small, 1.0)[0]["a"]),
                                np.asarray(small["a"]))


def test_weight_decay_reaches_every_parameter():
  config = _config()
  tx = opt_lib.make_adamw(config)
  params = {"embed": jnp.ones((3, 2)), "norm": jnp.ones((2,)), "A_log": jnp.ones((2,))}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  new = opt_lib.apply_updates(params, updates, jnp.float32(1e-2))
  for leaf in jax.tree.leaves(new):
    np.testing.assert_allclose(np.asarray(leaf), 1.0 - 1e-2 * 0.1, rtol=1e-7)
