"""The training loss of a tiny laLTE stays on the curve recorded before the step's latest
performance work (tests/lalte_jax/train/data/lalte_tiny_float32_losses.json).

A faster step must compute the same model. In float32 a change of the kernels, the fusions or the
backward's arithmetic moves each loss by float32 rounding only, so the float32 curve must match
the recorded one closely; a change of the model (its masks, its gradients) moves it by far more.
In bf16 compute the curve must stay within bf16 tolerance of that float32 curve: a bf16 rounding
change may move it, a bf16-specific error may not. (Against a recorded bf16 curve instead, every
legitimate rounding change would drift the curve step by step; a more accurate backward of the
norms once moved it 1.1% from a bf16 record while halving its distance to float32, 0.97% to
0.47%.) The curve was recorded on a CPU, where the Pallas kernels run as their references; on
GPUs the kernels' own rounding adds to it, so the check runs on CPUs only.
"""

import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from lalte_jax.train.step import init_train_state, make_train_step, model_graphdef
from tests.lalte_jax.train.test_step import _batch, tiny_lalte_bf16_config

RECORDED = pathlib.Path(__file__).parent / "data" / "lalte_tiny_float32_losses.json"
FLOAT32_TOLERANCE = 1e-4  # relative, per step (a recompiled float32 step moved it 1e-7)
BF16_TOLERANCE = 2.5 * 2.0 ** -8  # relative, per step: 2.5 bf16 epsilons


def _losses(model_dtype: str, steps: int) -> np.ndarray:
  config = dataclasses.replace(tiny_lalte_bf16_config(), model_dtype=model_dtype)
  model_config = config.model_config()
  step = jax.jit(make_train_step(model_graphdef(model_config), model_config, config))
  state = init_train_state(model_config, config, jax.random.key(0))
  losses = []
  for index in range(steps):
    state, metrics = step(state, _batch(index % 4, model_config.vocab_size))
    losses.append(float(metrics["loss"]))
  return np.asarray(losses)


@pytest.fixture(scope="module")
def recorded():
  return np.asarray(json.loads(RECORDED.read_text())["losses"])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the curve was recorded on a CPU")
@pytest.mark.parametrize("model_dtype, tolerance", [("float32", FLOAT32_TOLERANCE),
                                                    ("bfloat16", BF16_TOLERANCE)])
def test_tiny_lalte_loss_curve_stays_on_the_recorded_float32_curve(recorded, model_dtype,
                                                                   tolerance):
  losses = _losses(model_dtype, len(recorded))
  relative = np.abs(losses - recorded) / recorded
  assert relative.max() < tolerance, (relative.max(), losses.tolist())
