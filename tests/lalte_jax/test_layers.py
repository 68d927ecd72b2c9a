"""Building blocks: RoPE and its inverse, short conv, RMSNorm, SwiGLU width, initialisation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.layers.norms import RMSNorm, gated_rms_norm, rms_norm
from lalte_jax.layers.rope import apply_rope, default_positions, derope
from pallas_kernels.short_conv.reference import causal_depthwise_conv
from lalte_jax.mixers.gdn import GatedDeltaNet
from lalte_jax.model import HybridLM
from lalte_jax.presets import intermediate_size


def test_rope_matches_the_rotate_half_formula():
  x = np.random.default_rng(0).normal(size=(1, 3, 2, 8)).astype(np.float32)
  positions = jnp.asarray([[0, 5, 4095]])
  out = np.asarray(apply_rope(jnp.asarray(x), positions, 10_000.0))
  inv_freq = 10_000.0 ** (-np.arange(0, 8, 2) / 8)
  for t, p in enumerate([0, 5, 4095]):
    angle = p * inv_freq
    x1, x2 = x[0, t, :, :4], x[0, t, :, 4:]
    expected = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle),
                               x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
    np.testing.assert_allclose(out[0, t], expected, rtol=1e-4, atol=1e-5)


def test_derope_inverts_rope_and_scores_depend_on_offsets_only():
  key_q, key_k = jax.random.split(jax.random.key(0))
  q = jax.random.normal(key_q, (1, 1, 1, 16))
  k = jax.random.normal(key_k, (1, 1, 1, 16))
  positions = default_positions(1, 1)
  np.testing.assert_allclose(np.asarray(derope(apply_rope(k, positions + 777, 1e4),
                                               positions + 777, 1e4)), np.asarray(k), atol=1e-5)
  score = lambda pq, pk: float(jnp.sum(apply_rope(q, positions + pq, 1e4) *
                                       apply_rope(k, positions + pk, 1e4)))
  assert score(10, 3) == pytest.approx(score(1010, 1003), rel=1e-4, abs=1e-5)


def test_short_conv_tap_order_is_pytorch_cross_correlation():
  x = np.random.default_rng(1).normal(size=(2, 9, 3)).astype(np.float32)
  w = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
  out = np.asarray(causal_depthwise_conv(jnp.asarray(x), jnp.asarray(w)))
  for t in range(9):
    expected = sum(w[:, 3 - d] * x[:, t - d] for d in range(4) if t - d >= 0)
    np.testing.assert_allclose(out[:, t], expected, rtol=1e-5, atol=1e-6)


def test_rms_norm():
  norm = RMSNorm(4, eps=1e-6)
  x = jnp.asarray([[3.0, -1.0, 2.0, 0.5]], jnp.bfloat16)
  y = norm(x)
  assert y.dtype == jnp.bfloat16
  x32 = np.asarray(x, np.float32)
  np.testing.assert_allclose(np.asarray(y, np.float32),
                             x32 / np.sqrt((x32 ** 2).mean() + 1e-6), rtol=1e-2)


def _plain_norm(x, weight, eps, gate=None):
  """The norms' float32 definition, differentiated by autodiff."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * weight
  return (y if gate is None else y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_backward_equals_autodiff_of_the_definition(dtype, rtol, gated):
  """The hand-written backward of rms_norm / gated_rms_norm (which keeps only the inputs and the
  inverse RMS) against autodiff of the float32 definition; the forward is the definition's to
  the bit."""
  keys = jax.random.split(jax.random.key(0), 4)
  x = (3.0 * jax.random.normal(keys[0], (2, 7, 3, 16))).astype(dtype)
  gate = jax.random.normal(keys[1], (2, 7, 3, 16)).astype(dtype)
  weight = 1.0 + 0.2 * jax.random.normal(keys[2], (16,))
  dy = jax.random.normal(keys[3], x.shape).astype(dtype)
  if gated:
    ours, want = (lambda x, g, w: gated_rms_norm(x, g, w, 1e-6)), (
        lambda x, g, w: _plain_norm(x, w, 1e-6, g))
    args = (x, gate, weight)
  else:
    ours, want = (lambda x, w: rms_norm(x, w, 1e-6)), (lambda x, w: _plain_norm(x, w, 1e-6))
    args = (x, weight)
  y, vjp = jax.vjp(ours, *args)
  y_want, vjp_want = jax.vjp(want, *args)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_want, np.float32))
  for got, expected, arg in zip(vjp(dy), vjp_want(dy), args):
    assert got.dtype == arg.dtype
    scale = float(jnp.max(jnp.abs(expected.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=0, atol=rtol * scale)


def test_mlp_width_formula():
  assert intermediate_size(1024) == 2816 and intermediate_size(2048) == 5632


def max_abs(variable):
  return float(jnp.max(jnp.abs(variable[...])))


def test_hybrid_family_rescales_residual_outputs_and_others_do_not():
  """G17: o_proj/down_proj ~ U(+-1/sqrt(fan_in)) / sqrt(48) in hybrid-family models only."""
  lalte = HybridLM(get_model_config("lalte-tiny").replace(num_layers=24,
                                                          layer_pattern=("gdn", "lte") * 12),
                   rngs=nnx.Rngs(0))
  blocks = lalte.groups.blocks
  fan_in = 64
  bound = 1 / math.sqrt(fan_in) / math.sqrt(48)
  for block in blocks:
    o_proj = (block.mixer.o_proj if hasattr(block.mixer, "o_proj") else block.mixer.proj.o_proj)
    assert max_abs(o_proj.kernel) <= bound
    assert max_abs(o_proj.kernel) > 0.9 * bound  # uniform: the extremes are reached
    assert max_abs(block.mlp.down_proj.kernel) <= 1 / math.sqrt(192) / math.sqrt(48)
  gdn_swa = HybridLM(get_model_config("gdn_swa-tiny"), rngs=nnx.Rngs(0))
  o_proj = gdn_swa.groups.blocks[1].mixer.proj.o_proj.kernel[...]
  assert float(jnp.std(o_proj)) == pytest.approx(0.006, rel=0.1)  # Normal(0, 0.006)


def test_projection_embedding_and_router_init():
  model = HybridLM(get_model_config("lalte-tiny"), rngs=nnx.Rngs(0))
  assert float(jnp.std(model.embed.embedding[...])) == pytest.approx(0.006, rel=0.05)
  lte_block = model.groups.blocks[1]
  assert float(jnp.std(lte_block.mixer.proj.q_proj.kernel[...])) == pytest.approx(0.006, rel=0.1)
  np.testing.assert_array_equal(np.asarray(lte_block.mixer.router.proj_bias[...]), 0.5)
  first_conv = lte_block.mixer.router.conv_weights[0][...]  # fan_in = 2*16 channels * 3 taps
  assert float(jnp.std(first_conv)) == pytest.approx(math.sqrt(2 / 96), rel=0.1)
  np.testing.assert_array_equal(np.asarray(lte_block.mlp_norm.weight[...]), 1.0)


def test_gdn_decay_parameters_init():
  layer = GatedDeltaNet(get_model_config("gdn-0.4b"), rngs=nnx.Rngs(0))
  a = np.exp(np.asarray(layer.A_log[...]))
  assert np.all((a > 0) & (a <= 16))
  dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))  # softplus(dt_bias) recovers dt
  assert np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))


def test_gdn_layer_gates_follow_the_reference_formulas():
  config = get_model_config("gdn-tiny")
  layer = GatedDeltaNet(config, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 5, config.hidden_size))
  g, beta = layer.gates(x)
  a = np.asarray(x @ layer.a_proj.kernel[...])
  expected_g = -np.exp(np.asarray(layer.A_log[...])) * np.log1p(
      np.exp(a + np.asarray(layer.dt_bias[...])))
  np.testing.assert_allclose(np.asarray(g), expected_g, rtol=1e-5)
  assert np.all(np.asarray(g) < 0) and np.all((np.asarray(beta) > 0) & (np.asarray(beta) < 1))


def test_gdn_layer_uses_its_configured_chunk_size(monkeypatch):
  """GDNConfig.chunk_size reaches the chunked kernel, and the output does not depend on it."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from lalte_jax.mixers import gdn as gdn_module  # pylint: disable=import-outside-toplevel
  base = get_model_config("gdn-tiny")
  x_BTD = jax.random.normal(jax.random.key(0), (1, 45, base.hidden_size))
  seen, outputs = [], []
  real_op = gdn_module.chunk_gated_delta_rule

  def spy(*args, config=None, **kwargs):
    seen.append(config.chunk_size)
    return real_op(*args, config=config, **kwargs)

  monkeypatch.setattr(gdn_module, "chunk_gated_delta_rule", spy)
  for chunk_size in (16, 64):
    config = dataclasses.replace(base, gdn=dataclasses.replace(base.gdn, chunk_size=chunk_size))
    # Jitted (the spy sees the chunk size while tracing): op by op, each op compiles alone.
    outputs.append(nnx.jit(lambda layer, x: layer(x))(GatedDeltaNet(config, rngs=nnx.Rngs(0)),
                                                      x_BTD))
  assert seen == [16, 64]
  np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
