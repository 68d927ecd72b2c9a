"""The LTE sparsity loss and lambda controller against §4.4-4.6, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.train.lte_controller import (ControllerConfig, init_controller, sparsity_loss,
                                  update_controller)

B_CAP, SEQ_LEN, U = 512, 4096, 32
CONFIG = ControllerConfig(cap=B_CAP)


def _run(counts_KLH):
  """lambda and EMA after each step k = 1..K for scripted counts [K, L, H] (one jitted scan)."""
  state = init_controller(counts_KLH.shape[1], counts_KLH.shape[2], SEQ_LEN)

  def body(state, xs):
    step, count_LH = xs
    state = update_controller(state, count_LH, step, CONFIG)
    return state, (state.lambda_LH, state.ema_LH)

  steps = jnp.arange(1, counts_KLH.shape[0] + 1, dtype=jnp.int32)
  _, (lam, ema) = jax.jit(lambda c: jax.lax.scan(body, state, (steps, c)))(
      jnp.asarray(counts_KLH, jnp.float32))
  return np.asarray(lam), np.asarray(ema)


def test_init_and_ema_weight():
  state = init_controller(12, 8, SEQ_LEN)
  assert state.lambda_LH.shape == (12, 8) and not np.any(np.asarray(state.lambda_LH))
  assert np.all(np.asarray(state.ema_LH) == 4096.0)  # EMA starts at seq_len, lambda at 0 (G4)
  assert CONFIG.ema_weight == pytest.approx(2 / 17)
  new = update_controller(state, jnp.zeros((12, 8)), 1, CONFIG)
  np.testing.assert_allclose(np.asarray(new.ema_LH), 4096 * 15 / 17, rtol=1e-6)  # (1-a) old + a c


def test_scripted_trajectory():
  """Five heads with scripted counts; expected lambdas worked out from §4.6 by hand."""
  num_steps = 32 * 54
  counts = np.zeros((num_steps, 1, 5))
  counts[:, 0, 0] = 4096  # always too many: x1.5 per update from 1e-9, clamped at 1
  counts[:, 0, 1] = 0  # never large: stays 0
  counts[:, 0, 2] = 500  # settles inside (0.95b, b): first update enables, then x1
  counts[:64, 0, 3] = 4096  # large for two periods then none: 1e-9, 1.5e-9, 0.75e-9 -> 0
  counts[32:, 0, 4] = 505  # small at step 32 (lambda 0), in band at 64: re-enabled at 1e-9
  lam, ema = _run(counts)
  at = lambda k: lam[k - 1, 0]  # lambda after step k (used by the loss of step k + 1)

  assert not np.any(lam[:31])  # no update before step 32; lambda is 0, not 1e-9 (G4)
  np.testing.assert_allclose(at(32), [1e-9, 0, 1e-9, 1e-9, 0], rtol=1e-6)
  assert ema[31, 0, 2] > 512  # 500 + 3596 (15/17)^32 = 565.5: large at the first update
  for k in range(33, 64):  # lambda only moves on update steps
    np.testing.assert_array_equal(at(k), at(32))
  np.testing.assert_allclose(at(64), [1.5e-9, 0, 1e-9, 1.5e-9, 1e-9], rtol=1e-6)
  assert 486.4 < ema[63, 0, 4] < 512 and 486.4 < ema[63, 0, 2] < 512
  np.testing.assert_allclose(at(96), [2.25e-9, 0, 1e-9, 0, 1e-9], rtol=1e-6)
  # Head 0: after n updates past the first, 1e-9 * 1.5^n; the 52nd reaches the clamp at 1.0.
  for n in range(1, 52):
    assert at(32 * (n + 1))[0] == pytest.approx(1e-9 * 1.5 ** n, rel=1e-5)
  assert at(32 * 52)[0] < 1.0  # 51 "too large" updates: 0.957
  assert at(32 * 53)[0] == 1.0  # 52 consecutive "too large" updates hit lambda_max
  assert at(32 * 54)[0] == 1.0


def test_decrease_from_clamp_and_zeroing():
  """From lambda_max, "too small" halves; below lambda_min it becomes 0 and stays 0."""
  counts = np.zeros((32 * 60, 1, 1))
  counts[:32 * 53] = 4096
  lam, _ = _run(counts)
  assert lam[32 * 53 - 1, 0, 0] == 1.0
  # Counts drop to 0 after step 32*53; by the next update the EMA (74.6) is far below 0.95b.
  later = lam[32 * 54 - 1::32, 0, 0]
  assert later[0] == 0.5 and later[1] == 0.25
  assert np.all(np.diff(later) <= 0)


def test_sparsity_loss_crop_mean_and_lambda():
  rng = np.random.default_rng(0)
  score = rng.uniform(-0.5, 0.5, size=(3, 2, 20, 4)).astype(np.float32)  # [L, B, T, H]
  score[:, :, -6:] = 0.49  # the cropped margin must not count
  lam = rng.uniform(0, 1, size=(3, 4)).astype(np.float32)
  expected = np.mean(lam[:, None, None, :] * np.maximum(score[:, :, :-6], 0))
  got = sparsity_loss(jnp.asarray(score), jnp.asarray(lam), margin=6)
  assert float(got) == pytest.approx(float(expected), rel=1e-6)
  # The loss pushes only positive scores down, in proportion to lambda.
  grad = np.asarray(jax.grad(sparsity_loss)(jnp.asarray(score), jnp.asarray(lam), 6))
  assert np.all(grad[:, :, -6:] == 0) and np.all(grad[score < 0] == 0)
  kept = score[:, :, :-6] > 0
  np.testing.assert_allclose(grad[:, :, :-6][kept],
                             np.broadcast_to(lam[:, None, None, :], kept.shape)[kept]
                             / (3 * 2 * 14 * 4), rtol=1e-6)
  assert float(sparsity_loss(jnp.asarray(score), jnp.zeros((3, 4)), 6)) == 0.0
  assert float(sparsity_loss(jnp.asarray(score), jnp.asarray(lam), 0)) > float(got)  # no crop
