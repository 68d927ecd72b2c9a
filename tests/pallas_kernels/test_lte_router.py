"""lte_router: the router's CNN (its XLA version) against a float64 definition written tap by
tap over a zero-padded input (the logits and the gradients wrt k, v and every weight), with and
without dropout, several tap counts and dilations, a batch shard's row offset; NaN in other rows
reaching no output; the padding mask; refused arguments and versions; the remat policy
"attention" recomputing no router convolution."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from lalte_jax.mixers.lte_router import LTERouter
from lalte_jax.model import REMAT_CHECKPOINT_POLICIES
from lalte_jax.presets import get_model_config
from pallas_kernels.lte_router import counter_hash, router_logits, settled, settled_logit
from pallas_kernels.lte_router import pallas as router_pallas
from tests.kernel_testing import assert_close, float64

HEADS, BATCH, HEAD_DIM = 2, 2, 64


def _inputs(length, taps, *, seed=0, rate=0.1):
  rng = np.random.default_rng(seed)
  widths = [2 * HEAD_DIM >> i for i in range(len(taps) + 1)]
  normal = lambda *shape: rng.standard_normal(shape)
  k, v = normal(BATCH, length, HEADS, HEAD_DIM), normal(BATCH, length, HEADS, HEAD_DIM)
  weights = tuple(normal(HEADS, t, c_in, c_out) / np.sqrt(t * c_in)
                  for t, c_in, c_out in zip(taps, widths[:-1], widths[1:]))
  biases = tuple(0.1 * normal(HEADS, c_out) for c_out in widths[1:])
  proj_weight, proj_bias = normal(HEADS, widths[-1]), np.full((HEADS,), 0.5)
  seeds = (jnp.stack([counter_hash.seed_words(key) for key in
                      jax.random.split(jax.random.key(seed + 1), len(taps))]) if rate else None)
  cotangent = normal(BATCH, length, HEADS)
  return (k, v, weights, biases, proj_weight, proj_bias), seeds, cotangent


def _definition(k, v, weights, biases, proj_weight, proj_bias, seeds, *, dilations, rate,
                row_offset):
  """The router by its definition: per layer drop, then out[t] = b + sum_i x[t + i d - half]
  W_i over the zero-padded input, SiLU; then the projection."""
  x = jnp.transpose(jnp.concatenate([k, v], axis=-1), (2, 0, 1, 3))
  for layer, (weight, bias, dilation) in enumerate(zip(weights, biases, dilations)):
    if seeds is not None and rate:
      keep = counter_hash.keep_mask(seeds[layer], x.shape, rate, layout="KBTC",
                                    row_offset=row_offset)
      x = jnp.where(keep, x / (1.0 - rate), 0.0)
    taps, length = weight.shape[1], x.shape[2]
    half = (taps // 2) * dilation
    padded = jnp.pad(x, ((0, 0), (0, 0), (half, half), (0, 0)))
    x = jax.nn.silu(bias[:, None, None, :] + sum(
        jnp.einsum("kbtc,kco->kbto", padded[:, :, i * dilation:i * dilation + length],
                   weight[:, i]) for i in range(taps)))
  logit = jnp.einsum("kbtc,kc->kbt", x, proj_weight) + proj_bias[:, None, None]
  return jnp.transpose(logit, (1, 2, 0))


def _value_and_grads(fn, args, cotangent):
  # One compiled program: run eagerly, every op of the definition's taps and of the router's
  # backward would lower and compile on its own, most of this module's time on a CPU.
  def value_and_grads(args, cotangent):
    out, vjp = jax.vjp(fn, *args)
    return [out] + jax.tree.leaves(vjp(cotangent.astype(out.dtype)))
  return jax.jit(value_and_grads)(args, cotangent)


def _check(dtype, length, taps, dilations, rate, row_offset=0, factor=1.0, implementation="xla"):
  args, seeds, cotangent = _inputs(length, taps, rate=rate)
  with float64():
    want = _value_and_grads(
        lambda *a: _definition(*a, seeds, dilations=dilations, rate=rate, row_offset=row_offset),
        [jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), a) for a in args],
        jnp.asarray(cotangent, jnp.float64))
  kv = [jnp.asarray(a, dtype) for a in args[:2]]
  params = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), a) for a in args[2:]]
  got = _value_and_grads(
      lambda *a: router_logits(*a, seeds, dilations=dilations, rate=rate, row_offset=row_offset,
                               implementation=implementation),
      kv + params, jnp.asarray(cotangent, jnp.float32))
  names = ["logit", "dk", "dv"] + [f"d{n}{i}" for n in ("weight", "bias") for i in range(len(taps))]
  names += ["dproj_weight", "dproj_bias"]
  for name, g, w in zip(names, got, want):
    assert_close(g, w, dtype, factor=factor, name=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length, taps, dilations, rate, row_offset", [
    (100, (3, 3, 3), (2, 2, 2), 0.1, 0),
    (37, (3, 3, 3), (2, 2, 2), 0.0, 0),
    (130, (3, 5, 1), (1, 2, 3), 0.25, 3),
])
def test_matches_the_float64_definition(implementation, dtype, length, taps, dilations, rate,
                                        row_offset):
  """Both versions, lengths below and across the Pallas kernels' 128-row tiles."""
  _check(dtype, length, taps, dilations, rate, row_offset,
         factor=2.0 if dtype == jnp.bfloat16 else 1.0, implementation=implementation)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_on_gpu_matches_the_float64_definition(dtype):
  """The compiled kernels on a GPU (interpret mode elsewhere): the paper's router (three layers,
  kernel 3, dilation 2) with dropout, across several of the kernels' 128-row tiles and a ragged
  last one, a shard's row offset."""
  _check(dtype, 1037, (3, 3, 3), (2, 2, 2), 0.1, row_offset=2,
         factor=2.0 if dtype == jnp.bfloat16 else 1.0, implementation="pallas")


def test_versions_agree_in_float32():
  """The Pallas kernels against the XLA version (same masks, same rounding points)."""
  args, seeds, cotangent = _inputs(300, (3, 3, 3), rate=0.1)
  args = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), a) for a in args]
  got = {name: _value_and_grads(
      lambda *a, name=name: router_logits(*a, seeds, dilations=(2, 2, 2), rate=0.1, row_offset=5,
                                          implementation=name),
      args, jnp.asarray(cotangent, jnp.float32)) for name in ("xla", "pallas")}
  for pallas_value, xla_value in zip(got["pallas"], got["xla"]):
    scale = float(jnp.max(jnp.abs(xla_value)))
    np.testing.assert_allclose(np.asarray(pallas_value), np.asarray(xla_value), rtol=0,
                               atol=1e-5 * scale)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_no_read_across_rows(implementation):
  """NaN in batch row 1 of k and v: row 0's logits and gradients equal a run without them."""
  args, seeds, cotangent = _inputs(70, (3, 3, 3))
  k, v = (jnp.asarray(a, jnp.float32) for a in args[:2])
  params = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), a) for a in args[2:]]
  run = lambda k, v: router_logits(k, v, *params, seeds, dilations=(2, 2, 2), rate=0.1,
                                   implementation=implementation)
  cotangent = jnp.asarray(cotangent, jnp.float32).at[1].set(0.0)

  @jax.jit  # the same program for both inputs, compiled once
  def value_and_grads(k, v):
    out, vjp = jax.vjp(run, k, v)
    return out, vjp(cotangent)

  clean, clean_grads = value_and_grads(k, v)
  poisoned, grads = value_and_grads(k.at[1].set(jnp.nan), v.at[1].set(jnp.nan))
  np.testing.assert_array_equal(np.asarray(poisoned[0]), np.asarray(clean[0]))
  for got, want in zip(grads, clean_grads):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_the_padding_mask_equals_the_unpadded_prompt():
  """Left padding (as prompts are padded): with the mask, the real tokens' logits are those of the
  row without its pads."""
  args, _, _ = _inputs(40, (3, 3, 3), rate=0.0)
  k, v = (jnp.asarray(a, jnp.float32) for a in args[:2])
  params = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), a) for a in args[2:]]
  mask = jnp.arange(40)[None, :] >= jnp.array([[0], [7]])
  run = lambda k, v, mask=None: router_logits(k, v, *params, None, dilations=(2, 2, 2), rate=0.0,
                                              mask_BT=mask, implementation="xla")
  masked = run(k * mask[:, :, None, None], v * mask[:, :, None, None], mask)
  alone = run(k[1:, 7:], v[1:, 7:])
  np.testing.assert_allclose(np.asarray(masked[1, 7:]), np.asarray(alone[0]), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(masked[0]), np.asarray(run(k[:1], v[:1])[0]), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0], a[1][:, :, :1]) + a[2:], "must be equal"),
    (lambda a: a[:2] + ((a[2][0][:, :2],) + a[2][1:],) + a[3:], "odd count"),
    (lambda a: a[:3] + ((a[3][0][:, :4],) + a[3][1:],) + a[4:], "bias"),
    (lambda a: a[:4] + (a[4][:, :3],) + a[5:], "projection"),
])
def test_refuses_bad_arguments(change, message):
  args, _, _ = _inputs(20, (3, 3, 3), rate=0.0)
  args = change(tuple(jax.tree.map(jnp.asarray, a) for a in args))
  with pytest.raises(ValueError, match=message):
    router_logits(*args, None, dilations=(2, 2, 2), rate=0.0, implementation="xla")


def test_the_pallas_version_refuses_a_padding_mask_and_none_runs_xla_on_a_cpu():
  """A prompt's padding mask is the XLA version's alone (the default tries Pallas first on a GPU
  and passes a masked call on); on a CPU None runs XLA."""
  args, _, _ = _inputs(20, (3, 3, 3), rate=0.0)
  args = tuple(jax.tree.map(jnp.asarray, a) for a in args)
  run = lambda implementation, mask=None: router_logits(
      *args, None, dilations=(2, 2, 2), rate=0.0, mask_BT=mask, implementation=implementation)
  with pytest.raises(NotImplementedError, match="no padding mask"):
    run("pallas", jnp.ones((BATCH, 20), bool))
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(np.asarray(run(None)), np.asarray(run("xla")))


@pytest.mark.parametrize("implementation", ["pallas", "cudnn"])
def test_a_model_wide_version_does_not_pick_the_routers(implementation):
  """LTEConfig.implementation picks the attention ops' versions, not the router's (which runs its
  default: the router op has no cuDNN version, and its Pallas one takes no padding mask): the
  scores equal those of a model set to "xla", with a padding mask or not."""
  lte = get_model_config("lalte-tiny").lte
  k_BTKD = jax.random.normal(jax.random.key(0), (2, 16, lte.num_kv_heads, lte.head_dim))
  mask_BT = jnp.arange(16)[None, :] >= jnp.array([[0], [3]])
  scores = {}
  for name in ("xla", implementation):
    router = LTERouter(dataclasses.replace(lte, implementation=name), rngs=nnx.Rngs(0))
    scores[name] = (router(k_BTKD, k_BTKD, dropout_key=jax.random.key(1)),
                    router(k_BTKD, k_BTKD, mask_BT=mask_BT))
  for got, want in zip(scores[implementation], scores["xla"]):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _dot_count(jaxpr) -> int:
  """dot_general equations of a jaxpr and of the jaxprs inside its equations."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          count += _dot_count(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          count += _dot_count(sub)
  return count


def test_remat_policy_attention_recomputes_no_router_convolution():
  """Under the group's checkpoint with policy "attention", the router's gradient program holds
  one convolution matmul per conv layer, and the projection's, fewer than with everything
  recomputed ("block"): the pre-activations and the logits are kept."""
  lte = get_model_config("lalte-tiny").lte
  graphdef, params = nnx.split(LTERouter(lte, rngs=nnx.Rngs(0)))
  k_BTKD = jax.random.normal(jax.random.key(0), (1, 16, lte.num_kv_heads, lte.head_dim))

  def score_sum(params, k, v):
    return jnp.sum(nnx.merge(graphdef, params)(k, v, dropout_key=jax.random.key(1)))

  def dots(remat):
    grad = jax.grad(jax.checkpoint(score_sum, policy=REMAT_CHECKPOINT_POLICIES[remat]),
                    argnums=(0, 1, 2))
    return _dot_count(jax.make_jaxpr(grad)(params, k_BTKD, k_BTKD).jaxpr)

  assert dots("attention") == dots("block") - len(lte.router_kernel_sizes) - 1


def _xla_equations(jaxpr):
  """The equations of a jaxpr and of the jaxprs inside them, but not inside Pallas kernels."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "pallas_call":
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
          yield from _xla_equations(getattr(sub, "jaxpr", sub))


def test_pallas_router_hashes_its_masks_inside_its_kernels():
  """The Pallas router draws every dropout mask inside its kernels, the first layer's with the
  transpose that builds its input: outside them neither the forward nor the gradient program
  hashes (no xor), while the XLA version does."""
  args, seeds, _ = _inputs(40, (3, 3, 3), rate=0.1)
  args = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), args)

  def xors(implementation, grad):
    logits = lambda *a: jnp.sum(router_logits(*a, seeds, dilations=(2, 2, 2), rate=0.1,
                                              implementation=implementation))
    fn = jax.grad(logits, argnums=range(len(args))) if grad else logits
    return sum(eqn.primitive.name == "xor" for eqn in _xla_equations(
        jax.make_jaxpr(fn)(*args).jaxpr))

  assert xors("xla", grad=False) > 0
  assert xors("pallas", grad=False) == xors("pallas", grad=True) == 0


def test_pallas_router_lowers_to_triton(monkeypatch):
  """At lalte-0.4b's router (16 KV heads, D 64, three layers of 3 taps, dilation 2; bf16, two
  sequences of 4096 tokens) the forward and backward kernels lower to Triton for a GPU, checked
  without one (lowering only)."""
  monkeypatch.setattr(router_pallas, "interpret_mode", lambda: False)
  lte = get_model_config("lalte-0.4b").lte
  graphdef, params = nnx.split(LTERouter(lte, rngs=nnx.Rngs(0)))
  kv = jax.ShapeDtypeStruct((2, 4096, lte.num_kv_heads, lte.head_dim), jnp.bfloat16)

  def score_sum(params, k, v):
    return jnp.sum(nnx.merge(graphdef, params)(k, v, dropout_key=jax.random.key(1),
                                               implementation="pallas"))

  text = jax.jit(jax.grad(score_sum, argnums=(0, 1, 2))).trace(params, kv, kv).lower(
      lowering_platforms=("cuda",)).as_text()
  for kernel in ("lte_router_dropped_input", "lte_router_forward", "lte_router_input_grad",
                 "lte_router_weight_grad"):
    assert f'name = "{kernel}' in text, kernel

# The settled token's logit (decoding): one span of 2 m + 1 tokens, m the receptive half-width.

def _span_inputs(batch, taps, dilations, *, seed=3):
  span = 2 * settled.receptive_half_width(taps, dilations) + 1
  args, _, _ = _inputs(span, taps, seed=seed)
  rng = np.random.default_rng(seed)
  k, v = (rng.standard_normal((batch, span, HEADS, HEAD_DIM)) for _ in range(2))
  # Blanks lead some rows (a ring not yet full, or a row's left padding).
  real = np.arange(span)[None, :] >= rng.integers(0, span // 2 + 1, size=(batch, 1))
  return k, v, real, args[2:]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, taps, dilations", [
    (3, (3, 3, 3), (2, 2, 2)), (19, (3, 5, 1), (1, 2, 3)), (2, (1,), (1,))])
def test_settled_logit_is_the_centre_of_the_masked_router(dtype, batch, taps, dilations):
  """The span's centre against the float64 router over the whole span with its padding mask;
  three CNN shapes, a context-free router (span 1) among them."""
  k, v, real, params = _span_inputs(batch, taps, dilations)
  centre = k.shape[1] // 2
  with float64():
    want = jax.jit(lambda k, v, real, *params: router_logits(
        k, v, *params, None, dilations=dilations, rate=0.0, mask_BT=real,
        implementation="xla"))(jnp.asarray(k), jnp.asarray(v), jnp.asarray(real),
                               *(jax.tree.map(jnp.asarray, p) for p in params))[:, centre]
  params = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p) for p in params]
  got = jax.jit(lambda k, v, real, *params: settled_logit(k, v, real, *params,
                                                          dilations=dilations))(
      jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(real), *params)
  assert got.shape == (batch, HEADS) and got.dtype == jnp.float32
  assert_close(got, want, dtype, factor=2.0 if dtype == jnp.bfloat16 else 1.0, name="logit")


def test_settled_logit_reads_no_other_row_and_no_position_the_centre_does_not_need():
  """NaN in row 1, and in row 0 at the span positions the centre does not read (the odd ones,
  for dilation 2 everywhere): the other rows' logits and row 0's are unchanged."""
  taps, dilations = (3, 3, 3), (2, 2, 2)
  k, v, real, params = _span_inputs(4, taps, dilations)
  params = [jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p) for p in params]
  run = lambda k, v: np.asarray(settled_logit(
      jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(real), *params,
      dilations=dilations))
  k_poisoned, v_poisoned = k.copy(), v.copy()
  k_poisoned[1], v_poisoned[1] = np.nan, np.nan
  k_poisoned[0, 1::2], v_poisoned[0, 1::2] = np.nan, np.nan
  poisoned, clean = run(k_poisoned, v_poisoned), run(k, v)
  np.testing.assert_array_equal(poisoned[[0, 2, 3]], clean[[0, 2, 3]])
  assert np.isnan(poisoned[1]).all()


def test_settled_logit_refuses_a_span_that_is_not_the_receptive_field():
  k, v, real, params = _span_inputs(2, (3, 3, 3), (2, 2, 2))
  params = [jax.tree.map(jnp.asarray, p) for p in params]
  with pytest.raises(ValueError, match=r"\[B, 13, K, D\]"):
    settled_logit(jnp.asarray(k[:, 1:]), jnp.asarray(v[:, 1:]), jnp.asarray(real[:, 1:]),
                  *params, dilations=(2, 2, 2))
  with pytest.raises(NotImplementedError, match="pallas"):
    settled_logit(jnp.asarray(k), jnp.asarray(v), jnp.asarray(real), *params,
                  dilations=(2, 2, 2), implementation="pallas")
