"""The LTE layer's constant-memory decode cache (§5, G11-G15, G25).

All comparisons are at the layer level with the tiny preset (w = 24 so W = 25, cap 16, 4 sinks,
router margin 6, Hq 4, Hkv 2, D 16), float32 unless stated.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.inference.caches import StepContext
from lalte_jax.inference.group_slot import plain_of_view, view_of_plain
from lalte_jax.inference import lte_cache
from lalte_jax.inference.lte_cache import LTECache, init_lte_cache
from lalte_jax.layers.rope import apply_rope, default_positions
from lalte_jax.mixers.lte import LTEAttention


def tiny_config(name="lalte-tiny", dtype="float32", **lte_changes):
  config = get_model_config(name).replace(dtype=dtype)
  if lte_changes:
    config = config.replace(lte=dataclasses.replace(config.lte, **lte_changes))
  return config


# layer(x_BTD) -> (out, score), the training-time layer as one compiled program (called op by op,
# each of its small ops would lower and compile on its own). Defined once, so that a test calling
# it twice on one layer and shape (after moving the router's bias) compiles it once.
layer_forward = nnx.jit(lambda layer, x_BTD: layer(x_BTD))


def set_keep_fraction(layer, x_BTD, fraction):
  """Shifts the router's final bias so that about `fraction` of x's tokens get score > 0.

  The threshold sits halfway between two neighbouring logits, so no score is near 0 and the
  keep/drop decisions are robust to the rounding differences between the code paths.
  """
  _, score = layer_forward(layer, x_BTD)
  score = np.asarray(score, np.float64).reshape(-1, score.shape[-1])
  logit = np.log((score + 0.5) / (0.5 - score))
  ordered = np.sort(logit, axis=0)[::-1]
  rank = max(int(fraction * len(ordered)), 1)
  threshold = (ordered[rank - 1] + ordered[rank]) / 2
  layer.router.proj_bias[...] = layer.router.proj_bias[...] - jnp.asarray(threshold, jnp.float32)


def prompt_context(x_BTD, mask_BT):
  """The prefill context of a prompt (mask None: no padding)."""
  return StepContext.for_prompt(jnp.ones(x_BTD.shape[:2], bool) if mask_BT is None else mask_BT)


def token_context(position, pad_count_B):
  """A decode context: the token's padded position and each row's left pads."""
  return StepContext(valid_BT=jnp.ones((pad_count_B.shape[0], 1), bool), pad_count_B=pad_count_B,
                     position=jnp.asarray(position, jnp.int32))


class Runner:
  """Jitted prefill / decode bound to one layer (split once, merged inside jit). It tracks where
  the sequence is (`position`, `pad_count_B`), which a model keeps in its `ModelCache`."""

  def __init__(self, layer):
    graphdef, self.state = nnx.split(layer)
    self.lte = layer.config
    self.position, self.pad_count_B = 0, None
    merge = lambda state: nnx.merge(graphdef, state)
    # The layer alone on x: prefill adds its output to a residual stream that it normalises
    # first, here x with no norm (the output is the difference).
    def prefill(state, x, mask, cache):
      h, cache = merge(state).prefill(x, lambda h: h, cache, prompt_context(x, mask))
      return h - x, cache

    self._prefill = jax.jit(prefill)
    # Decoding runs on a layer group's part of a stacked cache: here a stack of one.
    def decode(state, x_B1D, cache, position, pad_count_B):
      out_B1D, view = merge(state).decode(x_B1D, view_of_plain(cache),
                                          token_context(position, pad_count_B))
      return out_B1D, plain_of_view(view)

    self._decode = jax.jit(decode)

    def decode_many(state, x_BND, cache, position, pad_count_B):
      def step(carry, x_BD):
        cache, position = carry
        out_B1D, cache = decode(state, x_BD[:, None], cache, position, pad_count_B)
        return (cache, position + 1), out_B1D[:, 0]
      (cache, _), out_NBD = jax.lax.scan(step, (cache, position), jnp.swapaxes(x_BND, 0, 1))
      return jnp.swapaxes(out_NBD, 0, 1), cache
    self._decode_many = jax.jit(decode_many)

  def start(self, batch):
    """A new sequence: position 0, no pads (an empty cache)."""
    self.position, self.pad_count_B = 0, jnp.zeros((batch,), jnp.int32)

  def prefill(self, x, mask, cache):
    self.position = x.shape[1]
    self.pad_count_B = prompt_context(x, mask).pad_count_B
    return self._prefill(self.state, x, mask, cache)

  def decode(self, x, cache):
    out = self._decode(self.state, x, cache, self.position, self.pad_count_B)
    self.position += 1
    return out

  def decode_many(self, x, cache):
    out = self._decode_many(self.state, x, cache, self.position, self.pad_count_B)
    self.position += x.shape[1]
    return out

  def ring_state(self):
    """(ptr, blank_B) of the ring now."""
    return lte_cache.ring_state(self.lte, jnp.asarray(self.position), self.pad_count_B)

  def run(self, x_BTD, prefix, mask_BT=None):
    """Prefill x[:, :prefix] (skipped when 0), decode the rest in one scan; all outputs [B,T,D]."""
    cache = init_lte_cache(self.lte, x_BTD.shape[0], x_BTD.dtype)
    self.start(x_BTD.shape[0])
    outs = []
    if prefix:
      out, cache = self.prefill(x_BTD[:, :prefix], mask_BT, cache)
      outs.append(out)
    out, cache = self.decode_many(x_BTD[:, prefix:], cache)
    return jnp.concatenate(outs + [out], axis=1), cache


def assert_close(actual, expected, rtol=1e-4):
  expected = np.asarray(expected)
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol,
                             atol=rtol * float(np.abs(expected).max()))


# 1. Teacher forcing below the cap: prefill + decode reproduce the training-time layer.

@pytest.mark.parametrize("name,prefix", [
    ("lalte-tiny", 40),  # OOW selection at prefill, then tokens scored while decoding
    ("lalte-tiny", 7),  # G14: sinks still in the ring when scored at decode time (<= 9 tokens)
    ("lalte-tiny", 2),  # sinks 2 and 3 are decoded, not prefilled
    ("lalte-tiny", 0),  # decoding from an empty cache
    ("lte_mlp-tiny", 40),  # margin 0: scored at insertion (§7.3)
    ("lte_mlp-tiny", 3),
])
def test_teacher_forcing_matches_training_layer_below_the_cap(name, prefix):
  config = tiny_config(name, cap=48)
  layer = LTEAttention(config, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 120, config.hidden_size))
  set_keep_fraction(layer, x, 0.2)
  expected, score = layer_forward(layer, x)
  lte = config.lte
  # Every token kept out of the window fits the cap: sinks plus positive scores before T - W.
  out_of_window = np.array(score[:, :120 - lte.window_keys] > 0)
  out_of_window[:, :lte.num_sinks] = True
  assert 0 < out_of_window.sum(axis=1).max() <= lte.cap
  assert out_of_window[:, lte.num_sinks:].sum() > 10  # and the kept path is exercised

  out, cache = Runner(layer).run(x, prefix)
  assert_close(out, expected)
  assert int(cache.past_len.max()) == int(out_of_window.sum(axis=1).max())


# 2. Beyond the cap: the cache keeps exactly the token set of a brute-force simulation.

class ValueReadingRouter(nnx.Module):
  """A context-free test router: a token's score is the first channel of its value."""

  def __call__(self, k_BTKD, v_BTKD, *, mask_BT=None, dropout_key=None):
    del k_BTKD, mask_BT, dropout_key
    return v_BTKD[..., 0].astype(jnp.float32)

  def settled_scores(self, k_BSKD, v_BSKD, real_BS):
    """The span's centre, as `LTERouter.settled_scores` (a decoding step's settled token)."""
    return self(k_BSKD, v_BSKD, mask_BT=real_BS)[:, k_BSKD.shape[1] // 2]


def simulate_kept_sets(score_BTK, real_BT, prefix, window_keys, cap, num_sinks):
  """§5.2-5.3 by brute force on explicit scores: the OOW position sets after the prefill and after
  each decode step, as a list over steps of [B][Hkv] Python sets."""
  score = np.where(real_BT[..., None], score_BTK, -np.inf)
  real_index = np.cumsum(real_BT, axis=1) - 1
  score = np.where((real_BT & (real_index < num_sinks))[..., None], np.inf, score)
  batch, length, heads = score.shape
  in_ring = min(prefix, window_keys)
  kept = []
  for b in range(batch):
    kept.append([])
    for h in range(heads):
      candidates = sorted(range(prefix - in_ring), key=lambda j: -score[b, j, h])
      kept[b].append({j for j in candidates[:cap] if score[b, j, h] > 0})
  history = [[[set(s) for s in row] for row in kept]]
  for t in range(prefix, length):
    leaving = t - window_keys
    for b in range(batch):
      for h in range(heads):
        if leaving < 0 or not score[b, leaving, h] > 0:
          continue
        current = kept[b][h]
        if len(current) < cap:
          current.add(leaving)
        else:
          weakest = min(current, key=lambda j: score[b, j, h])
          if score[b, weakest, h] < score[b, leaving, h]:
            current.remove(weakest)
            current.add(leaving)
    history.append([[set(s) for s in row] for row in kept])
  return score, history


def attention_over_sets(layer, x_BTD, visible_BKT, t):
  """Layer output of query t attending exactly the keys visible_BKT[b, h, j] (numpy)."""
  lte = layer.config
  q, k, v = layer.proj.qkv(x_BTD)
  positions = default_positions(*x_BTD.shape[:2])
  q = np.asarray(apply_rope(q, positions, lte.rope_theta), np.float64)
  k = np.asarray(apply_rope(k, positions, lte.rope_theta), np.float64)
  v = np.asarray(v, np.float64)
  group = lte.num_heads // lte.num_kv_heads
  o = np.zeros((x_BTD.shape[0], lte.num_heads, lte.head_dim))
  for b in range(x_BTD.shape[0]):
    for hq in range(lte.num_heads):
      h = hq // group
      if not visible_BKT[b, h].any():  # a padded query sees nothing and outputs 0
        continue
      logits = k[b, :, h] @ q[b, t, hq] / np.sqrt(lte.head_dim)
      logits = np.where(visible_BKT[b, h], logits, -np.inf)
      p = np.exp(logits - logits.max())
      o[b, hq] = (p / p.sum()) @ v[b, :, h]
  return np.asarray(layer.proj.output(jnp.asarray(o[:, None], jnp.float32)))[:, 0]


@pytest.mark.parametrize("prefix", [60, 10, 0])
def test_kept_set_beyond_the_cap_matches_brute_force_simulation(prefix):
  config = tiny_config()
  lte = config.lte
  layer = LTEAttention(config, rngs=nnx.Rngs(0))
  layer.router = ValueReadingRouter()
  # v = x[..., :Hkv*D]: value channel 0 of head h carries the score, channel 1 the position.
  layer.proj.v_proj.kernel[...] = jnp.eye(config.hidden_size, lte.num_kv_heads * lte.head_dim)
  batch, length = 2, 140
  rng = np.random.default_rng(prefix)
  x = rng.normal(size=(batch, length, config.hidden_size))
  scores = rng.uniform(-0.3, 0.5, size=(batch, length, lte.num_kv_heads))
  for h in range(lte.num_kv_heads):
    x[..., h * lte.head_dim] = scores[..., h]
    x[..., h * lte.head_dim + 1] = np.arange(length)
  x = jnp.asarray(x, jnp.float32)
  real = np.ones((batch, length), bool)
  pads = min(9, prefix)  # row 1 is left-padded
  real[1, :pads] = False
  score, history = simulate_kept_sets(np.asarray(x[..., ::lte.head_dim][..., :lte.num_kv_heads]),
                                      real, prefix, lte.window_keys, lte.cap, lte.num_sinks)
  assert max(len(s) for s in history[-1][0]) == lte.cap  # the cap binds

  runner = Runner(layer)
  W = lte.window_keys

  def check_cache(cache, kept_sets, t_next):
    position = np.rint(np.asarray(cache.v[..., 1])).astype(int)  # [B, S, K]
    past_len = np.asarray(cache.past_len)
    ring_valid = np.asarray(cache.score[:, :W]) > -np.inf  # blanks are exactly the -inf slots
    for b in range(batch):
      window = {j for j in range(max(t_next - W, 0), t_next) if real[b, j]}
      for h in range(lte.num_kv_heads):
        got = position[b, W:W + past_len[b, h], h]
        assert len(set(got)) == len(got) and set(got) == kept_sets[b][h], (t_next, b, h)
        assert set(position[b, :W, h][ring_valid[b, :, h]]) == window, (t_next, b, h)
        assert int(np.sum(ring_valid[b, :, h])) == W - int(runner.ring_state()[1][b])

  def visible(kept_sets, t):
    mask = np.zeros((batch, lte.num_kv_heads, length), bool)
    for b in range(batch):
      for h in range(lte.num_kv_heads):
        mask[b, h, max(t - W + 1, 0):t + 1] = True
        mask[b, h, list(j for j in kept_sets[b][h] if j <= t - W)] = True
      mask[b] &= real[b]
    return mask

  cache = init_lte_cache(lte, batch, jnp.float32)
  runner.start(batch)
  mask = jnp.asarray(real[:, :prefix])
  if prefix:
    out, cache = runner.prefill(x[:, :prefix], mask, cache)
    check_cache(cache, history[0], prefix)
    for t in range(0, prefix, 7):
      assert_close(out[:, t], attention_over_sets(layer, x, visible(history[0], t), t))
  for step, t in enumerate(range(prefix, length), start=1):
    out, cache = runner.decode(x[:, t:t + 1], cache)
    check_cache(cache, history[step], t + 1)
    if step % 5 == 0:
      assert_close(out[:, 0], attention_over_sets(layer, x, visible(history[step], t), t))


# 3. Scoring is exact: every token leaves the window with its full-context score.

# Prompts of 3 tokens (with 0-2 of them padding) hit both G14 edge cases: sinks among the tokens
# scored at decode time, and scoring while blanks remain.
@pytest.mark.parametrize("prefix,pads", [(40, (0, 5, 20)), (3, (0, 1, 2))])
def test_every_token_leaves_the_window_with_its_full_context_score(prefix, pads):
  config = tiny_config()
  lte = config.lte
  W = lte.window_keys
  layer = LTEAttention(config, rngs=nnx.Rngs(3))
  batch, length = len(pads), prefix + 3 * W + 10
  x = jax.random.normal(jax.random.key(4), (batch, length, config.hidden_size))
  set_keep_fraction(layer, x, 0.4)
  real = np.ones((batch, length), bool)
  for b, pad in enumerate(pads):
    real[b, :pad] = False
  # Ground truth: the router over the whole sequence (eval mode, padding masked).
  full_score = np.asarray(nnx.jit(lambda layer, x, mask: layer.router(
      *layer.proj.qkv(x)[1:], mask_BT=mask))(layer, x, jnp.asarray(real)))
  real_index = np.cumsum(real, axis=1) - 1
  full_score = np.where((real & (real_index < lte.num_sinks))[..., None], np.inf, full_score)
  full_score = np.where(real[..., None], full_score, -np.inf)

  runner = Runner(layer)
  cache = init_lte_cache(lte, batch, jnp.float32)
  _, cache = runner.prefill(x[:, :prefix], jnp.asarray(real[:, :prefix]), cache)
  for t in range(prefix, length):
    leaving = np.asarray(cache.score[:, int(runner.ring_state()[0])])  # [B, K]
    expected = full_score[:, t - W] if t >= W else np.full_like(leaving, -np.inf)
    np.testing.assert_allclose(leaving, expected, rtol=1e-5, atol=1e-6, err_msg=f"t={t}")
    _, cache = runner.decode(x[:, t:t + 1], cache)
  # Sinks never lost their +inf (G14): they are all in the OOW set now.
  oow_score = np.asarray(cache.score[:, W:])
  assert np.all(np.sum(oow_score == np.inf, axis=1) == lte.num_sinks)


# 4. Memory is bounded: the cache never changes shape, however long the decode.

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_shapes_are_constant_over_twenty_windows_of_decoding(dtype):
  config = tiny_config(dtype=dtype)
  lte = config.lte
  layer = LTEAttention(config, rngs=nnx.Rngs(5))
  steps = 20 * lte.window_keys
  x = jax.random.normal(jax.random.key(6), (2, 30 + steps, config.hidden_size), config.dtype)
  set_keep_fraction(layer, x[:, :200].astype(jnp.float32), 0.5)
  runner = Runner(layer)
  empty = init_lte_cache(lte, 2, x.dtype)
  runner.start(2)
  _, prefilled = runner.prefill(x[:, :30], None, empty)
  out, cache = runner.decode_many(x[:, 30:], prefilled)

  def layout(c):
    return jax.tree.map(lambda a: (a.shape, a.dtype), c)
  assert layout(cache) == layout(prefilled) == layout(empty)
  assert cache.k.dtype == x.dtype and cache.score.dtype == jnp.float32
  assert cache.k.shape == (2, lte.window_keys + lte.cap, lte.num_kv_heads, lte.head_dim)
  assert out.shape == (2, steps, config.hidden_size) and bool(jnp.all(jnp.isfinite(out)))
  assert runner.position == 30 + steps
  assert np.all(np.asarray(cache.past_len) == lte.cap)  # the cap binds and holds
  assert isinstance(cache, LTECache)


# 5. Left padding: each row of a padded batch decodes as it would alone.

def test_left_padded_rows_match_each_row_alone():
  config = tiny_config()
  lte = config.lte
  layer = LTEAttention(config, rngs=nnx.Rngs(7))
  prompt_len, decode_len = 40, 60
  real_lens = (40, 31, 3)
  rows = jax.random.normal(jax.random.key(8), (len(real_lens), prompt_len + decode_len,
                                                config.hidden_size))
  set_keep_fraction(layer, rows, 0.3)
  runner = Runner(layer)

  # Row r: its last real_lens[r] prompt tokens behind left padding (junk that must not leak).
  padded = []
  for r, n in enumerate(real_lens):
    junk = jax.random.normal(jax.random.key(100 + r), (prompt_len - n, config.hidden_size))
    padded.append(jnp.concatenate([junk, rows[r, prompt_len - n:]], axis=0))
  padded = jnp.stack(padded)
  mask = jnp.arange(prompt_len)[None] >= (prompt_len - jnp.asarray(real_lens))[:, None]
  batch_out, batch_cache = runner.run(padded, prompt_len, mask)
  assert np.all(np.asarray(batch_out[:, :prompt_len])[~np.asarray(mask)] == 0)

  for r, n in enumerate(real_lens):
    alone = rows[r:r + 1, prompt_len - n:]
    alone_out, alone_cache = runner.run(alone, n)
    assert_close(batch_out[r, prompt_len - n:], alone_out[0])
    np.testing.assert_array_equal(np.asarray(batch_cache.past_len[r]),
                                  np.asarray(alone_cache.past_len[0]))
