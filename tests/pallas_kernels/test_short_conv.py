"""short_conv: SiLU(causal depthwise conv) in XLA and in Pallas (interpret mode off the GPU)
against a float64 definition written tap by tap over a zero-padded input: the output and the
gradients wrt x and the weight, at lengths that are not whole tiles (shorter than the taps
included), channel counts that need narrower strips, several tiles per backward program, bf16
within its tolerance; NaN in another row reaching no output; a state handed to XLA; refused
arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.short_conv import ShortConvBlocks, short_conv_silu
from tests.kernel_testing import assert_close, float64

# Small tiles so that the test shapes span several programs and backward loop steps.
SMALL = ShortConvBlocks(block_t=16, block_c=32, block_t_dw=8, block_c_dw=16, dw_steps=3)


def _definition(x, w, state=None):
  """float64 numpy: out[t] = silu(sum_i w[:, i] * xp[t + i]) with xp = [state or zeros, x]."""
  batch, length, channels = x.shape
  taps = w.shape[1]
  before = np.zeros((batch, taps - 1, channels)) if state is None else state
  xp = np.concatenate([before, x], axis=1)
  pre = sum(xp[:, i:i + length] * w[:, i] for i in range(taps))
  return pre / (1.0 + np.exp(-pre))


def _inputs(batch, length, channels, taps, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((batch, length, channels)),
          rng.standard_normal((channels, taps)) / np.sqrt(taps),
          rng.standard_normal((batch, length, channels)))


def _loss(implementation, dtype, blocks=SMALL):
  def loss(x, w, dy):
    y = short_conv_silu(x.astype(dtype), w, implementation=implementation, blocks=blocks)
    return jnp.sum(y.astype(jnp.promote_types(dtype, jnp.float32)) * dy)
  return loss


def _float64_gradients(x, w, dy):
  with float64():
    # Jitted here and below: op by op, each small op would lower and compile on its own.
    value_and_grad = jax.jit(jax.value_and_grad(_loss("xla", jnp.float64), argnums=(0, 1)))
    return jax.tree.map(np.asarray, value_and_grad(jnp.asarray(x), jnp.asarray(w),
                                                   jnp.asarray(dy)))


def test_xla_matches_the_definition():
  x, w, _ = _inputs(2, 11, 8, 4)
  with float64():
    y = short_conv_silu(jnp.asarray(x), jnp.asarray(w), implementation="xla")
  np.testing.assert_allclose(np.asarray(y), _definition(x, w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch,length,channels,taps", [
    (2, 37, 64, 4),  # odd length, two channel strips, several backward tiles per program
    (1, 3, 32, 4),  # fewer tokens than taps
    (2, 100, 48, 2),  # 48 channels: 16-wide strips
    (1, 64, 16, 1),  # one tap: no context
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_matches_float64(batch, length, channels, taps, dtype):
  x, w, dy = _inputs(batch, length, channels, taps, seed=length)
  expected_y = _definition(x, w)
  _, (expected_dx, expected_dw) = _float64_gradients(x, w, dy)
  y = jax.jit(lambda x, w: short_conv_silu(x, w, implementation="pallas", blocks=SMALL))(
      jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32))
  assert y.dtype == dtype and y.shape == x.shape
  assert_close(y, expected_y, dtype, name="output")
  loss = _loss("pallas", dtype)
  dx, dw = jax.jit(jax.grad(lambda x, w: loss(x, w, jnp.asarray(dy, jnp.float32)),
                            argnums=(0, 1)))(jnp.asarray(x, jnp.float32),
                                             jnp.asarray(w, jnp.float32))
  assert dw.dtype == jnp.float32 and dw.shape == w.shape
  assert_close(dx, expected_dx, dtype, name="dx")
  assert_close(dw, expected_dw, dtype, name="dw")


def test_default_blocks_match_float64():
  x, w, dy = _inputs(2, 300, 256, 4, seed=3)
  _, (expected_dx, expected_dw) = _float64_gradients(x, w, dy)
  loss = _loss("pallas", jnp.float32, ShortConvBlocks())
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(
      *(jnp.asarray(a, jnp.float32) for a in (x, w, dy)))
  assert_close(dx, expected_dx, jnp.float32, name="dx")
  assert_close(dw, expected_dw, jnp.float32, name="dw")


def test_nan_in_another_row_reaches_no_output():
  x, w, dy = _inputs(2, 40, 32, 4, seed=5)
  x[1, 7, 3] = np.nan
  w32 = jnp.asarray(w, jnp.float32)
  conv = lambda x: short_conv_silu(x, w32, implementation="pallas", blocks=SMALL)
  assert_close(conv(jnp.asarray(x, jnp.float32))[0], _definition(x[:1], w)[0], jnp.float32)
  # Row 0's input gradient from its own output (the weight gradient sums every row, so it is NaN
  # with the reference too).
  dx = jax.jit(jax.grad(lambda x: jnp.sum(conv(x)[0] * jnp.asarray(dy[0], jnp.float32))))(
      jnp.asarray(x, jnp.float32))
  expected_dx = _float64_gradients(x[:1], w, dy[:1])[1][0]
  assert_close(dx[0], expected_dx[0], jnp.float32, name="dx")


def test_a_state_runs_on_xla_and_continues_the_sequence():
  x, w, _ = _inputs(2, 12, 16, 4, seed=7)
  state = x[:, :3]
  with float64():
    y = short_conv_silu(jnp.asarray(x[:, 3:]), jnp.asarray(w), jnp.asarray(state))
  np.testing.assert_allclose(np.asarray(y), _definition(x, w)[:, 3:], rtol=1e-12, atol=1e-12)
  with pytest.raises(NotImplementedError, match="no state"):
    short_conv_silu(jnp.asarray(x[:, 3:], jnp.float32), jnp.asarray(w, jnp.float32),
                    jnp.asarray(state, jnp.float32), implementation="pallas")


def test_refused_arguments():
  x = jnp.zeros((2, 8, 16))
  with pytest.raises(ValueError, match="same C"):
    short_conv_silu(x, jnp.zeros((8, 4)))
  with pytest.raises(ValueError, match="state"):
    short_conv_silu(x, jnp.zeros((16, 4)), jnp.zeros((2, 2, 16)))
  with pytest.raises(NotImplementedError, match="taps"):
    short_conv_silu(x, jnp.zeros((16, 3)), implementation="pallas")
  with pytest.raises(NotImplementedError, match="channels"):
    short_conv_silu(jnp.zeros((2, 8, 12)), jnp.zeros((12, 4)), implementation="pallas")
  with pytest.raises(ValueError, match="power of two"):
    ShortConvBlocks(block_t=24)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_on_gpu_matches_float64(dtype):
  """The GDN q/k/v shape of the 0.4b presets (1024 channels), two rows, T 4096 - 3."""
  x, w, dy = _inputs(2, 4093, 1024, 4, seed=11)
  _, (expected_dx, expected_dw) = _float64_gradients(x, w, dy)
  y = short_conv_silu(jnp.asarray(x, dtype), jnp.asarray(w, jnp.float32), implementation="pallas")
  assert_close(y, _definition(x, w), dtype, name="output")
  dx, dw = jax.jit(jax.grad(_loss("pallas", dtype, ShortConvBlocks()), argnums=(0, 1)))(
      *(jnp.asarray(a, jnp.float32) for a in (x, w, dy)))
  assert_close(dx, expected_dx, dtype, name="dx")
  assert_close(dw, expected_dw, dtype, name="dw")
