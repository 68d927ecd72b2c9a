"""The LTE layer (§4): router, training mask, straight-through gradient, retention counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import LTEConfig, get_model_config
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers import lte as lte_module
from lalte_jax.mixers.lte import LTEAttention, retention_count, straight_through_scores
from lalte_jax.mixers.lte_router import LTERouter
from pallas_kernels.masked_attention import attention_mask


def set_definition_mask(selected_TK, window, sinks):
  """allowed[h, i, j] per §4.2: j <= i and (j < sinks or selected[j, h] or i - j <= window)."""
  length, heads = selected_TK.shape
  allowed = np.zeros((heads, length, length), bool)
  for h in range(heads):
    for i in range(length):
      for j in range(i + 1):
        allowed[h, i, j] = j < sinks or selected_TK[j, h] or i - j <= window
  return allowed


def test_training_mask_equals_the_set_definition_at_paper_size():
  """w = 768: 769 keys in the window including the current one; 4 sinks; random selections."""
  length, heads = 1100, 2
  selected = np.random.default_rng(0).random((length, heads)) < 0.1
  mask = attention_mask(length, length, window_size=769, num_sinks=4,
                        kept_BSK=jnp.asarray(selected)[None])
  expected = set_definition_mask(selected, window=768, sinks=4)
  np.testing.assert_array_equal(np.asarray(mask[0]), expected)
  # Unselected keys far back: the window has exactly 769 keys for a late query.
  none = attention_mask(length, length, window_size=769, num_sinks=0,
                        kept_BSK=jnp.zeros((1, length, heads), bool))
  assert int(np.asarray(none)[0, 0, 1000].sum()) == 769


def test_swa_window_is_1024_keys_including_the_current_one():
  config = get_model_config("gdn_swa-0.4b").attention
  length = 1500
  mask = np.asarray(attention_mask(length, length, window_size=config.window_size))[0, 0]
  i, j = np.indices((length, length))
  np.testing.assert_array_equal(mask, (i - j >= 0) & (i - j <= 1023))
  assert mask[1400].sum() == 1024


def tiny_layer(seed=0, **lte_changes):
  config = get_model_config("lalte-tiny")
  if lte_changes:
    config = config.replace(lte=config.lte.__class__(**{**config.lte.__dict__, **lte_changes}))
  return config, LTEAttention(config, rngs=nnx.Rngs(seed))


def test_layer_output_equals_dense_attention_over_the_set_definition():
  config, layer = tiny_layer()
  lte = config.lte
  # Push half of the router's decisions below 0.5 so both kept and evicted keys occur.
  layer.router.proj_bias[...] = jnp.full_like(layer.router.proj_bias[...], -0.05)
  x = jax.random.normal(jax.random.key(1), (1, 90, config.hidden_size))
  out, score = layer(x)
  selected = np.asarray(score[0] > 0)
  assert 0.2 < selected.mean() < 0.8
  q, k, v = layer.proj.qkv(x)
  pos = default_positions(1, 90)
  q = np.asarray(apply_rope(q, pos, lte.rope_theta))[0]
  k = np.asarray(apply_rope(k, pos, lte.rope_theta))[0]
  v = np.asarray(v)[0]
  allowed = set_definition_mask(selected, window=lte.window, sinks=lte.num_sinks)
  group = lte.num_heads // lte.num_kv_heads
  o = np.zeros((90, lte.num_heads, lte.head_dim))
  for h in range(lte.num_heads):
    s = (q[:, h] @ k[:, h // group].T) / np.sqrt(lte.head_dim)
    s = np.where(allowed[h // group], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
  expected = layer.proj.output(jnp.asarray(o[None], jnp.float32))
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-4, atol=1e-6)


def test_straight_through_gradient_is_v_dot_dv():
  rng = np.random.default_rng(0)
  v = jnp.asarray(rng.normal(size=(2, 7, 3, 5)), jnp.float32)
  score = jnp.asarray(rng.normal(size=(2, 7, 3)), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=v.shape), jnp.float32)
  out, vjp = jax.vjp(straight_through_scores, v, score)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(v))
  dv, dscore = vjp(cotangent)
  np.testing.assert_array_equal(np.asarray(dv), np.asarray(cotangent))
  np.testing.assert_allclose(np.asarray(dscore), np.sum(np.asarray(v * cotangent), -1),
                             rtol=1e-6)


def test_layer_score_gradient_is_v_dot_total_dv(monkeypatch):
  """Inside the layer, dL/dscore = sum_d v dL/dv with the total gradient of v (all queries)."""
  config, layer = tiny_layer()
  x = jax.random.normal(jax.random.key(2), (2, 70, config.hidden_size))
  weights = jax.random.normal(jax.random.key(3), (2, 70, config.hidden_size))
  captured = {}
  real = lte_module.straight_through_scores

  def loss(probe_v, probe_score):
    def probed(v, score):
      captured["v"] = v
      return real(v + probe_v, score + probe_score)
    monkeypatch.setattr(lte_module, "straight_through_scores", probed)
    out, _ = layer(x)
    return jnp.sum(out * weights)

  shape = (2, 70, config.lte.num_kv_heads)
  dv, dscore = jax.grad(loss, argnums=(0, 1))(jnp.zeros(shape + (config.lte.head_dim,)),
                                              jnp.zeros(shape))
  v = np.asarray(layer.proj.qkv(x)[2])
  np.testing.assert_allclose(np.asarray(dscore), np.sum(v * np.asarray(dv), -1), rtol=1e-5,
                             atol=1e-7)
  assert float(jnp.max(jnp.abs(dscore))) > 0


def test_task_gradient_off_leaves_the_scores_to_the_sparsity_loss():
  """RoutingControls(task_gradient=False): the same outputs and selection, no gradient of the
  output (the task loss's path) into the router, and the scores' own gradient (the sparsity
  loss's path) unchanged."""
  config, layer = tiny_layer()
  x = jax.random.normal(jax.random.key(6), (1, 60, config.hidden_size))
  weights = jax.random.normal(jax.random.key(7), (1, 60, config.hidden_size))
  sparse_only = lte_module.RoutingControls(task_gradient=False)
  for routing in (None, sparse_only):
    out, score = layer(x, routing=routing)
    np.testing.assert_array_equal(out, layer(x)[0])
    np.testing.assert_array_equal(score, layer(x)[1])

  def router_grads(routing, of_output):
    def loss(m):
      out, score = m(x, routing=routing)
      return jnp.sum(out * weights) if of_output else jnp.sum(jnp.maximum(score, 0.0))
    return jax.tree.leaves(nnx.grad(loss)(layer).router)

  assert max(float(jnp.max(jnp.abs(g))) for g in router_grads(None, True)) > 0
  assert all(float(jnp.max(jnp.abs(g))) == 0 for g in router_grads(sparse_only, True))
  for a, b in zip(router_grads(None, False), router_grads(sparse_only, False)):
    np.testing.assert_array_equal(a, b)
  assert max(float(jnp.max(jnp.abs(g))) for g in router_grads(sparse_only, False)) > 0


def test_router_gradients_reach_router_and_kv_projections(monkeypatch):
  config, layer = tiny_layer()
  x = jax.random.normal(jax.random.key(4), (1, 60, config.hidden_size))
  weights = jax.random.normal(jax.random.key(5), (1, 60, config.hidden_size))

  def grads():
    return nnx.grad(lambda m: jnp.sum(m(x)[0] * weights))(layer)

  with_router = grads()
  assert float(jnp.max(jnp.abs(with_router.router.proj_bias[...]))) > 0
  for w in jax.tree.leaves(with_router.router.conv_weights):
    assert float(jnp.max(jnp.abs(w))) > 0
  # Cut the straight-through path: the k/v projection gradients must change, the q one must not.
  monkeypatch.setattr(lte_module, "straight_through_scores",
                      lambda v, s: v + 0.0 * jax.lax.stop_gradient(s)[..., None])
  without = grads()
  for name in ("k_proj", "v_proj"):
    a = getattr(with_router.proj, name).kernel[...]
    b = getattr(without.proj, name).kernel[...]
    assert float(jnp.max(jnp.abs(a - b))) > 1e-6 * float(jnp.max(jnp.abs(a))), name
  np.testing.assert_allclose(np.asarray(with_router.proj.q_proj.kernel[...]),
                             np.asarray(without.proj.q_proj.kernel[...]), rtol=1e-6)
  assert float(jnp.max(jnp.abs(without.router.proj_bias[...]))) == 0


def router_inputs(seed, length, lte):
  kv = jax.random.normal(jax.random.key(seed), (2, 1, length, lte.num_kv_heads, lte.head_dim))
  return kv[0], kv[1]


def test_router_reads_exactly_six_tokens_each_side():
  lte = get_model_config("lalte-tiny").lte
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  k, v = router_inputs(0, 40, lte)
  base = router(k, v)
  for offset, should_change in ((6, True), (7, False), (-6, True), (-7, False)):
    changed = router(k.at[:, 20 + offset].add(1.0), v)
    moved = float(jnp.abs(changed[:, 20] - base[:, 20]).max())
    assert (moved > 0) == should_change, (offset, moved)


def test_router_equals_grouped_dilated_convolutions():
  """The router is the reference's CNN: per layer a grouped (groups = Hkv) Conv1d with 'same'
  zero padding and its dilation, then SiLU; a per-head 1x1 projection; sigmoid - 0.5."""
  lte = LTEConfig(num_heads=4, num_kv_heads=2, head_dim=8, router_kernel_sizes=(3, 5, 3),
                  router_dilations=(2, 1, 3))
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  k, v = router_inputs(4, 33, lte)
  heads = lte.num_kv_heads
  h_BTC = jnp.concatenate([k, v], -1).reshape(1, 33, -1)  # channels grouped by head
  for weight, bias, dilation in zip(router.conv_weights, router.conv_biases, lte.router_dilations):
    _, size, c_in, c_out = weight.shape
    kernel_TIO = jnp.transpose(weight[...], (1, 2, 0, 3)).reshape(size, c_in, heads * c_out)
    half = (size // 2) * dilation
    h_BTC = jax.lax.conv_general_dilated(
        h_BTC, kernel_TIO, window_strides=(1,), padding=[(half, half)], rhs_dilation=(dilation,),
        dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=heads,
        precision=jax.lax.Precision.HIGHEST)
    h_BTC = jax.nn.silu(h_BTC + bias[...].reshape(-1))
  logit_BTK = jnp.einsum("btkc,kc->btk", h_BTC.reshape(1, 33, heads, -1), router.proj_weight[...],
                         precision=jax.lax.Precision.HIGHEST) + router.proj_bias[...]
  np.testing.assert_allclose(np.asarray(router(k, v)), np.asarray(jax.nn.sigmoid(logit_BTK) - 0.5),
                             atol=2e-6)


def test_router_score_range_and_parameter_count_per_head():
  lte = LTEConfig(num_heads=16, num_kv_heads=16, head_dim=64)
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  count = sum(int(x.size) for x in jax.tree.leaves(nnx.state(router, nnx.Param)))
  assert count == 16 * 32_385
  k, v = router_inputs(1, 20, lte)
  score = router(k, v)
  assert score.shape == (1, 20, 16) and score.dtype == jnp.float32
  assert float(score.min()) > -0.5 and float(score.max()) < 0.5


def test_router_padding_mask_equals_zero_padding():
  """Left padding with the mask gives the scores of the unpadded sequence (§4.1)."""
  lte = get_model_config("lalte-tiny").lte
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  k, v = router_inputs(2, 30, lte)
  pad = 5
  junk = jax.random.normal(jax.random.key(9), (1, pad) + k.shape[2:])
  mask = jnp.arange(30 + pad)[None] >= pad
  padded = router(jnp.concatenate([junk, k], 1), jnp.concatenate([junk, v], 1), mask_BT=mask)
  np.testing.assert_allclose(np.asarray(padded[:, pad:]), np.asarray(router(k, v)), atol=1e-6)


def test_router_dropout_is_active_only_with_a_key():
  lte = get_model_config("lalte-tiny").lte
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  k, v = router_inputs(3, 30, lte)
  eval_a, eval_b = router(k, v), router(k, v)
  np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
  train = router(k, v, dropout_key=jax.random.key(0))
  assert float(jnp.abs(train - eval_a).max()) > 1e-4
  no_dropout = LTERouter(lte.__class__(**{**lte.__dict__, "router_dropout": 0.0}),
                         rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(np.asarray(no_dropout(k, v, dropout_key=jax.random.key(0))),
                                np.asarray(eval_a))


def test_lte_mlp_router_has_no_context():
  lte = get_model_config("lte_mlp-tiny").lte
  assert lte.router_margin == 0
  router = LTERouter(lte, rngs=nnx.Rngs(0))
  k, v = router_inputs(4, 20, lte)
  changed = router(k.at[:, 11].add(1.0), v) - router(k, v)
  moved = np.asarray(jnp.abs(changed).max(axis=(0, 2)))
  assert moved[11] > 0 and np.all(np.delete(moved, 11) == 0)


def test_retention_count_crops_the_last_margin_positions():
  score = jnp.asarray(np.array([[[0.1], [-0.1], [0.2], [0.3], [0.4]]]), jnp.float32)
  np.testing.assert_array_equal(np.asarray(retention_count(score, margin=2)), [[2.0]])
  np.testing.assert_array_equal(np.asarray(retention_count(score, margin=0)), [[4.0]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sinks_are_visible_even_when_unselected(dtype):
  """With every score forced negative, a late query still attends the 4 sinks."""
  config, layer = tiny_layer()
  layer.router.proj_bias[...] = jnp.full_like(layer.router.proj_bias[...], -50.0)
  x = jax.random.normal(jax.random.key(6), (1, 80, config.hidden_size), dtype)
  _, score = layer(x)
  assert float(score.max()) < 0
  q, k, v = layer.proj.qkv(x)
  mask = attention_mask(80, 80, window_size=config.lte.window_keys, num_sinks=4,
                        kept_BSK=score > 0)
  assert bool(mask[0, 0, 79, :4].all()) and not bool(mask[0, 0, 79, 4:79 - 25 + 1].any())
