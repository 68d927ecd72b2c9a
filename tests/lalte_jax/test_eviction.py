"""Training-free eviction for full-attention layers (§7.1-7.2): the kept token sets of TOVA and of
uniform stride + recent window against brute-force references, and their use in generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax import generate as gen
from lalte_jax.config import AttentionConfig, get_model_config
from lalte_jax.inference import eviction
from lalte_jax.inference.group_slot import plain_of_view, view_of_plain
from lalte_jax.model import HybridLM

ATTN = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8)
GROUP = ATTN.num_heads // ATTN.num_kv_heads


def random_stream(seed, batch, length):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, length, ATTN.num_heads, ATTN.head_dim)).astype(np.float32)
  k = rng.normal(size=(batch, length, ATTN.num_kv_heads, ATTN.head_dim)).astype(np.float32)
  v = rng.normal(size=(batch, length, ATTN.num_kv_heads, ATTN.head_dim)).astype(np.float32)
  return q, k, v


def attend(q_HD, k_SKD, v_SKD, keys):
  """Brute-force attention of one query over the key indices `keys`: (out [H, D], mean weights)."""
  keys = np.asarray(sorted(keys))
  out = np.zeros((ATTN.num_heads, ATTN.head_dim))
  weights = np.zeros(len(keys))
  for h in range(ATTN.num_heads):
    s = k_SKD[keys, h // GROUP] @ q_HD[h] / np.sqrt(ATTN.head_dim)
    p = np.exp(s - s.max())
    p /= p.sum()
    out[h] = p @ v_SKD[keys, h // GROUP]
    weights += p / ATTN.num_heads
  return out, dict(zip(keys.tolist(), weights))


def kept_positions(cache, row):
  pos = np.asarray(cache.pos_BS[row])
  return sorted(pos[pos >= 0].tolist())


def run_policy(config, prompt_len, pads, steps, seed):
  """Prefill a left-padded prompt (row b has pads[b] pads), then decode `steps` tokens.

  Yields (row, real stream q/k/v of the row, real position t, kept set after t, output at t or
  None for the prompt)."""
  batch = len(pads)
  q, k, v = random_stream(seed, batch, prompt_len + steps)
  cache = eviction.init_eviction_cache(config, ATTN, batch, jnp.float32)
  valid = np.arange(prompt_len)[None, :] >= np.asarray(pads)[:, None]
  pad_count = jnp.asarray(pads, jnp.int32)
  cache = eviction.eviction_prefill(cache, jnp.asarray(q[:, :prompt_len]),
                                    jnp.asarray(k[:, :prompt_len]), jnp.asarray(v[:, :prompt_len]),
                                    jnp.asarray(valid), pad_count)
  rows = [(q[b, pads[b]:], k[b, pads[b]:], v[b, pads[b]:]) for b in range(batch)]
  for b in range(batch):
    yield b, rows[b], prompt_len - pads[b] - 1, kept_positions(cache, b), None
  # A decode step runs on a layer group's part of a stacked cache: here a stack of one.
  @jax.jit
  def decode(cache, *args):
    out, view = eviction.eviction_decode(view_of_plain(cache), *args)
    return out, plain_of_view(view)

  for i in range(prompt_len, prompt_len + steps):
    pos = jnp.asarray([i - p for p in pads], jnp.int32)
    out, cache = decode(cache, jnp.asarray(q[:, i:i + 1]), jnp.asarray(k[:, i:i + 1]),
                        jnp.asarray(v[:, i:i + 1]), pos)
    for b in range(batch):
      yield b, rows[b], i - pads[b], kept_positions(cache, b), np.asarray(out[b, 0])


@pytest.mark.parametrize("prompt_len,pads", [(9, (0, 3)), (3, (0, 1))])
def test_tova_keeps_the_brute_force_set(prompt_len, pads):
  """TOVA with 5 slots: one-shot top-5 by the last prompt query, then per step attend over kept +
  new and drop the lowest head-averaged weight when 6 tokens are held."""
  size = 5
  expected = {b: None for b in range(len(pads))}
  for row, (q, k, v), t, kept, out in run_policy(
      eviction.EvictionConfig("tova", cache_size=size), prompt_len, pads, 14, seed=0):
    if out is None:  # end of prompt
      _, weights = attend(q[t], k, v, range(t + 1))
      ranked = sorted(weights, key=lambda j: -weights[j])
      expected[row] = sorted(ranked[:size])
    else:
      candidates = expected[row] + [t]
      want_out, weights = attend(q[t], k, v, candidates)
      np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
      if len(candidates) > size:
        candidates.remove(min(candidates, key=lambda j: weights[j]))
      expected[row] = sorted(candidates)
    assert kept == expected[row], f"row {row}, position {t}"


def uniform_set(t, recent, strided):
  """Recent window (t-recent, t] plus multiples of the smallest power-of-two stride s with
  ceil(m / s) <= strided among the m = t - recent + 1 older positions."""
  m = max(t - recent + 1, 0)
  stride = 1
  while -(-m // stride) > strided:
    stride *= 2
  return sorted(set(range(max(t - recent + 1, 0), t + 1)) | set(range(0, m, stride)))


@pytest.mark.parametrize("prompt_len,pads", [(11, (0, 4)), (30, (2, 0))])
def test_uniform_stride_keeps_the_documented_set(prompt_len, pads):
  """3 recent + 4 strided slots, checked at the end of the prompt and after each of 45 steps (the
  stride grows 1 -> 2 -> 4 -> 8 -> 16); outputs are attention over exactly that set."""
  config = eviction.EvictionConfig("uniform", cache_size=7, recent=3)
  for row, (q, k, v), t, kept, out in run_policy(config, prompt_len, pads, 45, seed=1):
    want = uniform_set(t, 3, 4)
    assert kept == want, f"row {row}, position {t}"
    assert len(kept) <= 7
    if out is not None:
      np.testing.assert_allclose(out, attend(q[t], k, v, want)[0], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def gdn_attn():
  config = get_model_config("gdn_attn-tiny").replace(init_std=0.2)
  return HybridLM(config, rngs=nnx.Rngs(0))


def test_eviction_that_never_triggers_is_exact_and_caches_stay_constant(gdn_attn):
  """Prompts of 10 and 21 tokens plus 40 new ones fit 128 slots (64 recent for uniform): both
  policies then give full attention's tokens. Small caches keep their shape while decoding."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (10, 21)]
  exact = gen.generate(gdn_attn, prompts, 40)
  for policy in ("tova", "uniform"):
    out = gen.generate(gdn_attn, prompts, 40,
                       eviction=eviction.EvictionConfig(policy, cache_size=128))
    np.testing.assert_array_equal(out.tokens, exact.tokens, err_msg=policy)
    small = gen.init_cache(gdn_attn, 2, eviction=eviction.EvictionConfig(policy, cache_size=16))
    shapes = jax.tree.map(lambda x: x.shape, small)
    _, decoded = jax.eval_shape(
        lambda c: gen.stack.decode_impl(gdn_attn, jnp.zeros((2,), jnp.int32), c), small)
    assert jax.tree.map(lambda x: x.shape, decoded) == shapes


def test_eviction_configuration_errors():
  with pytest.raises(ValueError, match="eviction.policy"):
    eviction.EvictionConfig("lru")
  with pytest.raises(ValueError, match="eviction.recent"):
    eviction.EvictionConfig("tova", recent=10)
  with pytest.raises(ValueError, match="no full-attention layer"):
    gen.init_cache(HybridLM(get_model_config("gdn_swa-tiny"), rngs=nnx.Rngs(0)), 1,
                   eviction=eviction.EvictionConfig("tova"))
