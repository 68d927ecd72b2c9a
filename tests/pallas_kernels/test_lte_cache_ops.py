"""LTE cache ops: references against per-(row, head) loops over the §5.2 / §5.3 rules, the Pallas
evict/insert step (interpret mode on CPU) against its reference, and the LTE layer decoding with
the Pallas kernels routed in against the XLA path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.lte_cache_ops import compact_top_scores, evict_and_insert
from tests.kernel_testing import GROUP, assert_other_groups_untouched, stacked_in_poison

WINDOW, CAP = 5, 6


def _cache(seed, *, batch=3, heads=2, head_dim=16, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  slots = WINDOW + CAP
  k = rng.standard_normal((batch, slots, heads, head_dim))
  v = rng.standard_normal((batch, slots, heads, head_dim))
  # Quantised scores make ties between the leaving token and the OOW minimum likely.
  score = np.round(rng.standard_normal((batch, slots, heads)), 1)
  score[rng.random(score.shape) < 0.1] = np.inf  # sinks
  score[rng.random(score.shape) < 0.1] = -np.inf  # blanks
  past_len = rng.integers(0, CAP + 1, (batch, heads)).astype(np.int32)
  past_len[0] = CAP  # full sets: the replace-the-minimum branch
  new_k = rng.standard_normal((batch, heads, head_dim))
  new_score = rng.standard_normal((batch, heads))
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(k), cast(v), jnp.asarray(score, jnp.float32), jnp.asarray(past_len),
          cast(new_k), cast(2 * new_k), jnp.asarray(new_score, jnp.float32))


def _evict_brute_force(k, v, score, past_len, ptr, new_k, new_v, new_score):
  k, v, score, past_len = (np.array(x) for x in (k, v, score, past_len))
  for b in range(k.shape[0]):
    for h in range(k.shape[2]):
      leaving = score[b, ptr, h]
      if leaving > 0:
        if past_len[b, h] < CAP:
          target = WINDOW + past_len[b, h]
          past_len[b, h] += 1
        else:
          oow = score[b, WINDOW:WINDOW + CAP, h]
          target = WINDOW + int(np.argmin(oow)) if oow.min() < leaving else None
        if target is not None:
          k[b, target, h], v[b, target, h], score[b, target, h] = (
              k[b, ptr, h], v[b, ptr, h], leaving)
      k[b, ptr, h], v[b, ptr, h], score[b, ptr, h] = new_k[b, h], new_v[b, h], new_score[b, h]
  return k, v, score, past_len


@pytest.mark.parametrize("ptr", [0, 3])
def test_evict_reference_matches_brute_force(ptr):
  args = _cache(ptr)
  got = evict_and_insert(*args[:4], jnp.int32(ptr), *args[4:], window_keys=WINDOW,
                         implementation="xla")
  for actual, expected in zip(got, _evict_brute_force(*args[:4], ptr, *args[4:])):
    np.testing.assert_array_equal(np.asarray(actual), expected)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_evict_matches_reference_bit_for_bit(dtype):
  step = {name: jax.jit(lambda *a, name=name: evict_and_insert(
      *a, window_keys=WINDOW, implementation=name)) for name in ("xla", "pallas")}
  for seed in range(4):  # ptr is traced: one compile, several cache states
    args = _cache(10 + seed, dtype=dtype)
    ptr = jnp.int32(seed % WINDOW)
    expected = step["xla"](*args[:4], ptr, *args[4:])
    actual = step["pallas"](*args[:4], ptr, *args[4:])
    for name, a, e in zip(("k", "v", "score", "past_len"), actual, expected):
      assert a.dtype == e.dtype and a.shape == e.shape, name
      np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(e, np.float64),
                                    err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_evict_moves_only_the_rows_of_its_layer_group(implementation):
  """`group=`: on caches stacked over layer groups (the others NaN / -1), the group's part ends as
  the plain step leaves a plain cache, and nothing else changes."""
  args = _cache(30)
  ptr = jnp.int32(2)
  expected = _evict_brute_force(*args[:4], 2, *args[4:])
  got = evict_and_insert(*(stacked_in_poison(x) for x in args[:4]), ptr, *args[4:],
                         window_keys=WINDOW, group=jnp.int32(GROUP),
                         implementation=implementation)
  for actual, want in zip(got, expected):
    np.testing.assert_array_equal(np.asarray(actual)[GROUP], want)
    assert_other_groups_untouched(actual)


def test_compaction_reference_matches_brute_force():
  rng = np.random.default_rng(20)
  batch, length, heads, head_dim, candidates = 2, 30, 2, 4, 21
  score = np.round(rng.standard_normal((batch, length, heads)), 1)  # ties
  score[:, :2] = np.inf  # sinks
  score[1, :5] = -np.inf  # left padding
  k = rng.standard_normal((batch, length, heads, head_dim))
  v = rng.standard_normal((batch, length, heads, head_dim))
  for cap in (4, 25):  # binding cap, and a cap above the number of candidates
    oow_k, oow_v, oow_score, past_len, kept = compact_top_scores(
        jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(score, jnp.float32),
        num_candidates=candidates, cap=cap)
    for b in range(batch):
      for h in range(heads):
        # Stable sort by descending score: ties go to the earlier token (lax.top_k's order).
        ranked = sorted(range(candidates), key=lambda j: -score[b, j, h])[:min(cap, candidates)]
        chosen = sorted(j for j in ranked if score[b, j, h] > 0)
        n = len(chosen)
        assert past_len[b, h] == n
        np.testing.assert_array_equal(np.flatnonzero(kept[b, :, h]), chosen)
        np.testing.assert_allclose(oow_k[b, :n, h], k[b, chosen, h], rtol=1e-6)
        np.testing.assert_allclose(oow_v[b, :n, h], v[b, chosen, h], rtol=1e-6)
        np.testing.assert_array_equal(oow_score[b, :n, h], score[b, chosen, h].astype(np.float32))
        assert np.all(oow_score[b, n:, h] == -np.inf) and np.all(oow_k[b, n:, h] == 0)


@pytest.mark.parametrize("cap,candidates,count_chunk,copy_chunk", [
    (9, 61, 16, 16),  # streaming counting passes over 4 chunks
    (40, 33, 4096, 16),  # candidates resident in registers; cap above the candidates
    (64, 70, 4096, 64)])
def test_pallas_compaction_matches_reference_bit_for_bit(cap, candidates, count_chunk,
                                                         copy_chunk):
  """Ties (quantised scores, many zeros and -0.0), sinks, padding; several chunks."""
  from pallas_kernels.lte_cache_ops import pallas_compaction  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(cap)
  batch, length, heads, head_dim = 2, 70, 3, 16
  score = np.round(rng.standard_normal((batch, length, heads)), 1)
  score[rng.random(score.shape) < 0.1] = -0.0
  score[:, :2] = np.inf  # sinks
  score[1, :7] = -np.inf  # left padding
  score[0, :, 2] = -1.0  # a head with nothing to keep
  args = (jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)), jnp.bfloat16),
          jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)), jnp.bfloat16),
          jnp.asarray(score, jnp.float32))
  expected = compact_top_scores(*args, num_candidates=candidates, cap=cap, implementation="xla")
  actual = pallas_compaction.compact_top_scores(*args, num_candidates=candidates, cap=cap,
                                                count_chunk=count_chunk, copy_chunk=copy_chunk)
  for name, a, e in zip(("oow_k", "oow_v", "oow_score", "past_len", "kept"), actual, expected):
    assert a.dtype == e.dtype and a.shape == e.shape, name
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32),
                                  err_msg=name)
  assert int(expected[3].min()) == 0 and int(expected[3].max()) > 0


def test_compaction_public_entry_routes_to_pallas():
  score = jnp.asarray(np.random.default_rng(1).standard_normal((1, 40, 2)), jnp.float32)
  k = jnp.ones((1, 40, 2, 16), jnp.float32) * jnp.arange(40.0)[None, :, None, None]
  results = [compact_top_scores(k, k, score, num_candidates=30, cap=8, implementation=name)
             for name in ("xla", "pallas")]
  for a, e in zip(*results):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1000, 4096])
def test_gpu_pallas_compaction_matches_xla_at_model_shapes(length):
  # lalte-1.4b: Hkv 8, D 64, window 769 keys, cap 512; quantised scores for ties.
  rng = np.random.default_rng(length)
  score = np.round(rng.standard_normal((2, length, 8)), 2)
  score[:, :4] = np.inf
  k = jnp.asarray(rng.standard_normal((2, length, 8, 64)), jnp.bfloat16)
  args = (k, -k, jnp.asarray(score, jnp.float32))
  kwargs = dict(num_candidates=length - 769, cap=512)
  expected = compact_top_scores(*args, implementation="xla", **kwargs)
  actual = compact_top_scores(*args, implementation="pallas", **kwargs)
  for name, a, e in zip(("oow_k", "oow_v", "oow_score", "past_len", "kept"), actual, expected):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32),
                                  err_msg=name)


@pytest.mark.slow
def test_lte_decode_with_pallas_kernels_matches_xla():
  # Imported here: the kernels' own tests do not depend on the model package.
  from lalte_jax.config import get_model_config
  from lalte_jax.inference.caches import StepContext
  from lalte_jax.inference.group_slot import plain_of_view, view_of_plain
  from lalte_jax.inference.lte_cache import init_lte_cache
  from lalte_jax.mixers.lte import LTEAttention

  config = get_model_config("lalte-tiny").replace(dtype="float32")
  layers = {name: LTEAttention(config.replace(lte=dataclasses.replace(
      config.lte, implementation=name)), rngs=nnx.Rngs(3)) for name in ("xla", "pallas")}
  lte = config.lte
  # The prompt overflows the window (OOW set at prefill); decoding fills the cap and rescores.
  prompt_len, decode_len = 32, 3 * lte.window_keys
  x = jax.random.normal(jax.random.key(4), (2, prompt_len + decode_len, config.hidden_size))
  pad_mask = jnp.arange(prompt_len)[None] >= jnp.asarray([0, 9])[:, None]  # row 1 left-padded

  def run(layer):
    graphdef, state = nnx.split(layer)

    @jax.jit
    def go(state, x):
      layer = nnx.merge(graphdef, state)
      prompt_context = StepContext.for_prompt(pad_mask)
      _, cache = layers["xla"].prefill(x[:, :prompt_len], lambda h: h,  # x as normalised input
                                       init_lte_cache(lte, x.shape[0], x.dtype), prompt_context)
      def step(carry, x_BD):  # on the cache as a stack of one layer group
        cache, position = carry
        token_context = prompt_context.replace(valid_BT=jnp.ones((x.shape[0], 1), bool),
                                               position=position)
        out_B1D, view = layer.decode(x_BD[:, None], view_of_plain(cache), token_context)
        return (plain_of_view(view), position + 1), out_B1D[:, 0]
      (cache, _), out = jax.lax.scan(step, (cache, jnp.asarray(prompt_len, jnp.int32)),
                                     jnp.swapaxes(x[:, prompt_len:], 0, 1))
      return cache, out
    return go(state, x)

  xla_cache, xla_out = run(layers["xla"])
  pallas_cache, pallas_out = run(layers["pallas"])
  assert int(xla_cache.past_len.min()) > 0
  np.testing.assert_allclose(np.asarray(pallas_out), np.asarray(xla_out), rtol=1e-5,
                             atol=1e-5 * float(jnp.abs(xla_out).max()))
  for name in ("k", "v", "score", "past_len"):
    np.testing.assert_array_equal(np.asarray(getattr(pallas_cache, name)),
                                  np.asarray(getattr(xla_cache, name)), err_msg=name)
