"""HybridLM on every tiny preset: causality, jitted forward/backward, scan vs loop, input checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import REMAT_POLICIES, get_model_config
from lalte_jax.loss import next_token_cross_entropy
from lalte_jax.model import REMAT_CHECKPOINT_POLICIES, HybridLM
from lalte_jax.presets import VARIANTS
from pallas_kernels.nsa import nsa_attention

TINY = [f"{v}-tiny" for v in VARIANTS]


def random_tokens(seed, batch, length, vocab):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


@pytest.mark.parametrize("name", TINY)
def test_every_variant_is_causal(name):
  """Changing tokens after position t leaves logits at positions <= t unchanged.

  T=160 is longer than every tiny window (LTE 25 keys, SWA 48, NSA 32 with 16-token blocks), so
  out-of-window paths (LTE-kept keys whose router reads 6 tokens ahead, NSA's selected blocks)
  are all in play.
  """
  config = get_model_config(name)
  model = HybridLM(config, rngs=nnx.Rngs(0))
  forward = nnx.jit(lambda m, t: m(t))
  length = 160
  tokens = random_tokens(1, 2, length, config.vocab_size)
  logits = forward(model, tokens)
  for cut in (40, 97):  # both beyond the windows; 97 is not block- or chunk-aligned
    changed = tokens.at[:, cut + 1:].set(random_tokens(2, 2, length - cut - 1, config.vocab_size))
    logits_changed = forward(model, changed)
    past = np.abs(np.asarray(logits_changed[:, :cut + 1] - logits[:, :cut + 1])).max()
    future = np.abs(np.asarray(logits_changed[:, cut + 1:] - logits[:, cut + 1:])).max()
    assert past <= 1e-5, f"{name}: logits at positions <= {cut} moved by {past}"
    assert future > 1e-3  # the change did reach the later positions


# bfloat16, the production dtype, on every preset; float32 as well where selections depend on
# rounding (LTE keep/drop scores, NSA's top-k blocks): lalte, lansa and nsa. The other variants
# run no dtype-dependent path (pure_lte and lte_mlp use lalte's LTE layer), and their float32
# forward passes run in test_every_variant_is_causal.
TRAIN_STEP_CASES = ([(name, "bfloat16") for name in TINY]
                    + [(f"{variant}-tiny", "float32") for variant in ("lalte", "lansa", "nsa")])


@pytest.mark.parametrize("name,dtype", TRAIN_STEP_CASES, ids=map("-".join, TRAIN_STEP_CASES))
def test_tiny_presets_train_step_is_finite(name, dtype):
  config = get_model_config(name).replace(dtype=dtype)
  model = HybridLM(config, rngs=nnx.Rngs(0))
  tokens = random_tokens(0, 2, 96, config.vocab_size)

  @nnx.jit
  def loss_and_grads(model, tokens, key):
    def loss_fn(model):
      logits, aux = model(tokens, dropout_key=key, return_aux=True)
      assert logits.dtype == jnp.float32 and logits.shape == (2, 96, config.vocab_size)
      return next_token_cross_entropy(logits, tokens), aux
    return nnx.value_and_grad(loss_fn, has_aux=True)(model)

  (loss, aux), grads = loss_and_grads(model, tokens, jax.random.key(1))
  assert np.isfinite(float(loss))
  assert 4.0 < float(loss) < 7.0  # near log(256) = 5.55 at init
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in leaves)
  # Every parameter receives gradient: nothing in the model is disconnected.
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
  if config.lte is not None:
    assert aux.lte_scores.shape == (config.num_lte_layers, 2, 96, config.lte.num_kv_heads)
    assert aux.lte_retained.shape == (config.num_lte_layers, 2, config.lte.num_kv_heads)
    assert float(jnp.max(aux.lte_retained)) <= 96 - config.lte.router_margin
  else:
    assert aux.lte_scores is None and aux.lte_retained is None


@pytest.mark.parametrize("name", ["lalte-tiny", "gdn_swa-tiny", "lansa-tiny"])
def test_scanned_and_unscanned_stacks_agree(name):
  config = get_model_config(name)
  scanned = HybridLM(config, rngs=nnx.Rngs(3))
  looped = HybridLM(config.replace(scan_layers=False), rngs=nnx.Rngs(3))
  tokens = random_tokens(5, 2, 64, config.vocab_size)
  key = jax.random.key(7)  # dropout on: the per-layer keys must agree as well
  forward = nnx.jit(lambda m, t, k: m(t, dropout_key=k, return_aux=True))
  a, aux_a = forward(scanned, tokens, key)
  b, aux_b = forward(looped, tokens, key)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  if config.lte is not None:
    np.testing.assert_allclose(np.asarray(aux_a.lte_scores), np.asarray(aux_b.lte_scores),
                               atol=1e-6)


# lalte-tiny (XLA mixers) runs every policy. lansa-tiny and lalte-tiny on their Pallas kernels
# (interpret mode, the costliest gradients to compile here) run the policies that keep the
# kernels' outputs against "none"; lansa-tiny also runs "block", which recomputes the kernels in
# the backward pass. "dots" recomputes them as "block" does (a pallas_call is no dot) and keeps
# the dots that lalte-tiny's XLA run already checks.
REMAT_CASES = {("lalte-tiny", False): REMAT_POLICIES,
               ("lansa-tiny", True): ("none", "block", "attention"),
               ("lalte-tiny", True): ("none", "attention", "dots_attention")}


@pytest.mark.parametrize("preset, kernels", list(REMAT_CASES))
def test_remat_policies_give_the_same_gradients(preset, kernels):
  """Every remat policy computes the same gradients, on the XLA mixers and on the Pallas kernels
  (interpret mode), whose outputs the "attention" policies keep."""
  config = get_model_config(preset)
  if kernels:
    config = config.replace(**{
        kind: dataclasses.replace(getattr(config, kind), implementation="pallas")
        for kind in ("lte", "nsa") if getattr(config, kind) is not None})
  tokens = random_tokens(0, 1, 64, config.vocab_size)
  grads = {}
  policies = REMAT_CASES[preset, kernels]
  for remat in policies:
    model = HybridLM(config.replace(remat=remat), rngs=nnx.Rngs(0))
    grad = nnx.jit(nnx.grad(lambda m, t: next_token_cross_entropy(m(t), t)))
    grads[remat] = jax.tree.leaves(nnx.state(grad(model, tokens), nnx.Param))
  for remat in policies[1:]:
    for g, ref in zip(grads[remat], grads["none"]):
      np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-7)


def test_attention_remat_keeps_the_kernels_outputs(capsys):
  """Under the "attention" policy the backward pass reads the NSA forward kernels' outputs (the
  output and logsumexp of the window, compressed and selected branches, and the selection)
  instead of running the kernels again; under "block" it keeps none of them."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 48, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 48, 2, 16)), jnp.float32)
  gates = jnp.full((1, 48, 4, 3), 0.5)

  def nsa(q, k, v):
    return nsa_attention(jnp.tanh(q), k, v, gates, block_size=16, block_count=2, window_size=20,
                         implementation="pallas").sum()

  kept = {}
  for remat in ("block", "attention"):
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(nsa, policy=REMAT_CHECKPOINT_POLICIES[remat]), q, k, k)
    kept[remat] = [line.split()[0] for line in capsys.readouterr().out.splitlines()
                   if "output of jitted function 'nsa_attention'" in line]
  assert kept["block"] == []
  # window and selected: o [1, 48, 4, 16], lse [1, 48, 4]; compressed (padded to its tiles):
  # o [1, 64, 4, 16], lse [1, 4, 64]; the selection: indices [1, 48, 2, 2], counts [1, 48, 2]
  # (kept instead of the importance, so that the backward pass runs no top_k).
  assert sorted(kept["attention"]) == sorted(
      ["f32[1,48,4,16]", "f32[1,48,4]"] * 2 + ["f32[1,64,4,16]", "f32[1,4,64]", "i32[1,48,2,2]",
                                               "i32[1,48,2]"])


def test_untied_head_is_used():
  config = get_model_config("transformer-tiny").replace(tie_embeddings=False)
  model = HybridLM(config, rngs=nnx.Rngs(0))
  assert model.lm_head[...].shape == (config.hidden_size, config.vocab_size)
  tokens = random_tokens(0, 1, 8, config.vocab_size)
  before = model(tokens)
  model.lm_head[...] = jnp.zeros_like(model.lm_head[...])
  np.testing.assert_allclose(np.asarray(model(tokens)), 0.0)
  assert float(jnp.max(jnp.abs(before))) > 0


@pytest.mark.parametrize("bad, message", [
    (jnp.array([[0, 3, 256]], jnp.int32), "id 256 is outside the vocabulary"),
    (jnp.array([[-1, 3]], jnp.int32), "id -1 is outside the vocabulary"),
    (jnp.array([0, 3], jnp.int32), "expected shape"),
    (jnp.array([[0.0, 3.0]]), "integer dtype"),
    (jnp.zeros((1, 0), jnp.int32), "empty"),
])
def test_bad_tokens_raise_clear_errors(bad, message):
  model = HybridLM(get_model_config("lalte-tiny"), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=message):
    model(bad)
