"""decode_matmul: the Pallas kernel (interpret mode off the GPU) and the XLA version against the
float64 definition, for every prologue, row counts below the dot's 16 and sizes that are not
multiples of the configured tiles; rows stay independent; bad arguments are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_matmul import DecodeMatmulConfig, decode_matmul, pallas, reference
from tests.kernel_testing import assert_close, float64

# K = 96 and N = 80 are not multiples of the default tiles (256, 64): the kernel takes 32 and 16.
KEY_DIM, WIDTH = 96, 80
PROLOGUES = {
    "plain": dict(),
    "rms_norm": dict(norm=True),
    "add_rms_norm": dict(norm=True, residual=True),
    "swiglu": dict(swiglu=True),
}


def _inputs(rows, prologue, *, seed=0):
  """float64 numpy inputs: (x, w, residual or None, norm weight or None, swiglu)."""
  spec = PROLOGUES[prologue]
  rng = np.random.default_rng(seed)
  swiglu = spec.get("swiglu", False)
  x = rng.standard_normal((rows, 2 * KEY_DIM if swiglu else KEY_DIM))
  w = rng.standard_normal((KEY_DIM, WIDTH)) / np.sqrt(KEY_DIM)
  residual = rng.standard_normal((rows, KEY_DIM)) if spec.get("residual") else None
  norm = 1.0 + 0.5 * rng.standard_normal(KEY_DIM) if spec.get("norm") else None
  return x, w, residual, norm, swiglu


def _value_and_grads(fn, arrays, swiglu):
  """(y, h, gradients of sum(y * c) + sum(h * c') with respect to every array given)."""
  present = [i for i, a in enumerate(arrays) if a is not None]

  def loss(*given):
    full = list(arrays)
    for i, a in zip(present, given):
      full[i] = a
    y, h = fn(*full, swiglu=swiglu)
    value = jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    if h is not None:
      value = value + jnp.sum(h.astype(jnp.float32) * jnp.sin(jnp.arange(h.size).reshape(h.shape)))
    return value, (y, h)

  grads, (y, h) = jax.jit(jax.grad(loss, argnums=range(len(present)), has_aux=True))(
      *[arrays[i] for i in present])
  return y, h, grads


def _entry(implementation, config=DecodeMatmulConfig()):
  return lambda x, w, residual, norm, *, swiglu: decode_matmul(
      x, w, residual_MK=residual, norm_weight_K=norm, swiglu=swiglu,
      implementation=implementation, config=config)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("prologue", list(PROLOGUES))
def test_matches_the_float64_definition(prologue, rows, dtype, implementation):
  """Outputs (y and the residual stream h) and every gradient, against the float64 definition of
  the same dtype-rounded inputs; bf16 at twice the table's tolerance (the prologue rounds its
  output to bf16 before the projection, as the model's unfused ops do)."""
  x, w, residual, norm, swiglu = _inputs(rows, prologue)
  rounded = [None if a is None else jnp.asarray(a, dtype) for a in (x, w, residual, norm)]
  y, h, grads = _value_and_grads(_entry(implementation), rounded, swiglu)
  with float64():
    exact = [None if a is None else jnp.asarray(np.asarray(a, np.float64)) for a in rounded]
    y64, h64, grads64 = _value_and_grads(
        lambda *a, swiglu: reference.decode_matmul(*a, eps=1e-6, swiglu=swiglu), exact, swiglu)
    y64, h64, grads64 = jax.tree.map(np.asarray, (y64, h64, grads64))
  factor = 2.0 if dtype == jnp.bfloat16 else 1.0
  assert y.shape == (rows, WIDTH) and y.dtype == dtype
  assert_close(y, y64, dtype, factor=factor, name="y")
  assert (h is None) == (residual is None)
  if h is not None:
    assert_close(h, h64, dtype, name="h")
  for index, (grad, grad64) in enumerate(zip(grads, grads64)):
    assert_close(grad, grad64, dtype, factor=factor, name=f"gradient {index}")


@pytest.mark.parametrize("prologue", ["add_rms_norm", "swiglu"])
def test_rows_stay_independent(prologue):
  """NaN in row 1 of every input: rows 0 and 2 equal a run without it (the masked padding rows
  and the norm's per-row statistics read no other row)."""
  x, w, residual, norm, swiglu = _inputs(3, prologue, seed=1)
  run = lambda x, residual: _entry("pallas")(
      jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32),
      None if residual is None else jnp.asarray(residual, jnp.float32),
      None if norm is None else jnp.asarray(norm, jnp.float32), swiglu=swiglu)
  poisoned = [None if a is None else a.copy() for a in (x, residual)]
  for a in poisoned:
    if a is not None:
      a[1] = np.nan
  clean, dirty = run(x, residual), run(*poisoned)
  for got, want in zip(dirty, clean):
    if want is not None:
      np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(want)[[0, 2]])


def test_tiles_and_rows_out_of_the_kernel_s_reach():
  x = jnp.ones((17, KEY_DIM), jnp.float32)
  w = jnp.ones((KEY_DIM, WIDTH), jnp.float32)
  with pytest.raises(NotImplementedError, match="17 rows"):
    decode_matmul(x, w, implementation="pallas")
  with pytest.raises(NotImplementedError, match="N 40"):
    decode_matmul(x[:2], w[:, :40], implementation="pallas")
  with pytest.raises(NotImplementedError, match="weight dtype"):
    decode_matmul(x[:2], w.astype(jnp.bfloat16), implementation="pallas")
  y, h = decode_matmul(x, w)  # off the GPU the default is XLA, which takes any size
  assert y.shape == (17, WIDTH) and h is None
  with pytest.raises(ValueError, match="block_k"):
    DecodeMatmulConfig(block_k=48)


def test_bad_arguments_are_named():
  x = jnp.ones((2, KEY_DIM), jnp.float32)
  w = jnp.ones((KEY_DIM, WIDTH), jnp.float32)
  norm = jnp.ones((KEY_DIM,), jnp.float32)
  with pytest.raises(ValueError, match="x .* must be \\[M, K\\]"):
    decode_matmul(x[:, :10], w)
  with pytest.raises(ValueError, match="give norm_weight"):
    decode_matmul(x, w, residual_MK=x)
  with pytest.raises(ValueError, match="residual .* must match"):
    decode_matmul(x, w, residual_MK=x[:1], norm_weight_K=norm)
  with pytest.raises(ValueError, match="norm_weight must be"):
    decode_matmul(x, w, norm_weight_K=norm[:5])
  with pytest.raises(ValueError, match="swiglu takes neither"):
    decode_matmul(jnp.ones((2, 2 * KEY_DIM)), w, norm_weight_K=norm, swiglu=True)
  with pytest.raises(ValueError, match="x must be \\[M, 2K\\]"):
    decode_matmul(x, w, swiglu=True)
  with pytest.raises(ValueError, match="floating dtype"):
    decode_matmul(x.astype(jnp.int32), w)


def test_kernel_lowers_to_triton_at_the_1_4b_shapes(monkeypatch):
  """At lalte-1.4b's decode of one prompt (two rows, hidden 2048, MLP 5632, bf16): the MLP's
  norm + fused gate/up projection and its SwiGLU + down projection lower to Triton for a GPU,
  checked without one (lowering only)."""
  monkeypatch.setattr(pallas, "interpret_mode", lambda: False)
  bf16 = jnp.bfloat16
  shape = jax.ShapeDtypeStruct
  h = shape((2, 2048), bf16)
  calls = (
      (lambda x, r, n, w: decode_matmul(x, w, residual_MK=r, norm_weight_K=n,
                                        implementation="pallas"),
       (h, h, shape((2048,), bf16), shape((2048, 2 * 5632), bf16))),
      (lambda x, w: decode_matmul(x, w, swiglu=True, implementation="pallas"),
       (shape((2, 2 * 5632), bf16), shape((5632, 2048), bf16))),
  )
  for fn, args in calls:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert 'name = "decode_matmul' in text
