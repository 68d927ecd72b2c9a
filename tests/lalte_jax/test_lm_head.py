"""The LM head's matmul (lalte_jax/layers/lm_head.py): float32 logits, a compute-dtype backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lalte_jax.layers.lm_head import float32_logits


def _operands(dtype):
  h_key, w_key, g_key = jax.random.split(jax.random.key(0), 3)
  h_BTD = jax.random.normal(h_key, (2, 5, 32), jnp.float32).astype(dtype)
  head_DV = (0.2 * jax.random.normal(w_key, (32, 48), jnp.float32)).astype(dtype)
  dlogits_BTV = jax.random.normal(g_key, (2, 5, 48), jnp.float32)
  return h_BTD, head_DV, dlogits_BTV


def _autodiff_reference(h_BTD, head_DV, dlogits_BTV):
  """The plain einsum and its autodiff, all in float64-exact float32 operands."""
  def logits(h, w):
    return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
  out, vjp = jax.vjp(logits, h_BTD.astype(jnp.float32), head_DV.astype(jnp.float32))
  return out, vjp(dlogits_BTV)


def test_float32_operands_match_autodiff_exactly():
  h_BTD, head_DV, dlogits_BTV = _operands(jnp.float32)
  out, vjp = jax.vjp(float32_logits, h_BTD, head_DV)
  ref_out, (ref_dh, ref_dw) = _autodiff_reference(h_BTD, head_DV, dlogits_BTV)
  dh, dw = vjp(dlogits_BTV)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-5)


def test_bf16_logits_are_float32_and_gradients_bf16_within_tolerance():
  h_BTD, head_DV, dlogits_BTV = _operands(jnp.bfloat16)
  out, vjp = jax.vjp(float32_logits, h_BTD, head_DV)
  ref_out, (ref_dh, ref_dw) = _autodiff_reference(h_BTD, head_DV, dlogits_BTV)
  dh, dw = vjp(dlogits_BTV)
  assert out.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)  # bf16 products are exact
  for got, want in ((dh, ref_dh), (dw, ref_dw)):
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 2 ** -6 * scale


def test_backward_matmuls_run_in_the_compute_dtype():
  """No float32 matmul against the [B, T, V] gradient: both backward dots take bf16 operands."""
  h_BTD, head_DV, _ = _operands(jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: jnp.sum(float32_logits(h, w) ** 2),
                                  argnums=(0, 1)))(h_BTD, head_DV)
  dots = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general"]
  # The backward's two dots (the forward's sits inside the custom_vjp call).
  assert len(dots) == 2
  for eqn in dots:
    assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16, jnp.bfloat16], eqn


def test_mixed_operand_dtypes_are_refused():
  h_BTD, head_DV, _ = _operands(jnp.bfloat16)
  with pytest.raises(ValueError, match="cast both"):
    float32_logits(h_BTD, head_DV.astype(jnp.float32))
