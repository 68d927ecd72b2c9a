"""nsa_attention: the reference against a per-query loop over §6, plus the block
selection rules, causality, decoding and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import nsa_attention, reference
from tests.kernel_testing import assert_close, float64

BLOCK_SIZE, WINDOW_SIZE = 8, 12


def _softmax_attend(query_D, keys_ND, values_ND, scale):
  if len(keys_ND) == 0:
    return np.zeros(values_ND.shape[-1])
  scores_N = scale * keys_ND @ query_D
  weights_N = np.exp(scores_N - scores_N.max())
  return (weights_N / weights_N.sum()) @ values_ND


def _brute_force(q, k, v, gates, *, block_size, block_count, window_size):
  """§6 one (batch, query, KV head) at a time in float64; returns (output, selected blocks)."""
  q, k, v, gates = (np.asarray(x, np.float64) for x in (q, k, v, gates))
  batch, query_len, num_q_heads, head_dim = q.shape
  key_len, num_kv_heads = k.shape[1], k.shape[2]
  group, offset, scale = num_q_heads // num_kv_heads, key_len - query_len, head_dim**-0.5
  num_blocks = -(-key_len // block_size)
  # Slicing past the end gives the partial last block its real length.
  blocks = [slice(c * block_size, (c + 1) * block_size) for c in range(num_blocks)]
  k_cmp = np.stack([k[:, block].mean(1) for block in blocks], 1)
  v_cmp = np.stack([v[:, block].mean(1) for block in blocks], 1)
  out = np.zeros(q.shape[:3] + v.shape[-1:])
  selected = np.zeros((batch, query_len, num_kv_heads, num_blocks), bool)
  for b in range(batch):
    for i in range(query_len):
      t = offset + i
      complete, current = (t + 1) // block_size, t // block_size
      for kv_head in range(num_kv_heads):
        heads = range(kv_head * group, (kv_head + 1) * group)
        importance = np.zeros(current + 1)  # valid blocks: 0..current
        o_cmp = {}
        for h in heads:
          probs = np.zeros(num_blocks)
          if complete:
            scores = scale * k_cmp[b, :complete, kv_head] @ q[b, i, h]
            probs[:complete] = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
          o_cmp[h] = probs[:complete] @ v_cmp[b, :complete, kv_head]
          for c in range(current + 1):
            importance[c] += 1.0 if c in (0, current - 1, current) else probs[c]
        chosen = sorted(range(current + 1), key=lambda c: (-importance[c], c))[:block_count]
        selected[b, i, kv_head, chosen] = True
        slc_keys = [j for j in range(t + 1) if j // block_size in chosen]
        swa_keys = [j for j in range(t + 1) if t - j < window_size]
        for h in heads:
          g_cmp, g_slc, g_swa = gates[b, i, h]
          o_slc, o_swa = (
              _softmax_attend(q[b, i, h], k[b, keys, kv_head], v[b, keys, kv_head], scale)
              for keys in (slc_keys, swa_keys))
          out[b, i, h] = g_slc * o_slc + g_cmp * o_cmp[h] + g_swa * o_swa
  return out, selected


def _inputs(seed, *, batch=2, seq_len=45, num_q_heads=4, num_kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seq_len, num_q_heads, head_dim))
  # Larger keys make compressed attention peaked, so that importances differ clearly between blocks.
  k = 2.0 * rng.standard_normal((batch, seq_len, num_kv_heads, head_dim))
  v = rng.standard_normal((batch, seq_len, num_kv_heads, head_dim))
  gates = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, seq_len, num_q_heads, 3))))
  return q, k, v, gates


def _nsa(dtype, q, k, v, gates, *, block_count=3, query_len=None):
  """nsa_attention on inputs cast to `dtype`, the last `query_len` positions as queries."""
  query_len = q.shape[1] if query_len is None else query_len
  def call():
    args = [jnp.asarray(x, dtype) for x in (q[:, -query_len:], k, v, gates[:, -query_len:])]
    out = nsa_attention(*args, block_size=BLOCK_SIZE, block_count=block_count,
                        window_size=WINDOW_SIZE)
    return np.asarray(out).astype(np.float64)
  if jnp.dtype(dtype) == jnp.float64:
    with float64():
      return call()
  return call()


def _selection(q, k, *, block_count, query_len):
  """select_blocks on the reference's own compressed probabilities, in float64."""
  with float64():
    q_BTHD, k_BTKD = jnp.asarray(q[:, -query_len:]), jnp.asarray(k)
    offset = k.shape[1] - query_len
    k_cmp_BNKD = reference.compress(k_BTKD, BLOCK_SIZE)
    _, probs_BTHN = reference.compressed_attention(
        q_BTHD, k_cmp_BNKD, k_cmp_BNKD, block_size=BLOCK_SIZE, scale=q.shape[-1] ** -0.5,
        query_offset=offset)
    return np.asarray(reference.select_blocks(
        probs_BTHN, num_kv_heads=k.shape[2], block_size=BLOCK_SIZE, block_count=block_count,
        query_offset=offset))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("query_len", [45, 5])
@pytest.mark.parametrize("block_count", [2, 3, 4])
def test_matches_brute_force(block_count, query_len, dtype):
  # T = 45 is not a multiple of the block; block_count 3 keeps only the forced blocks once IC >= 2,
  # 4 makes top-k choose among earlier blocks, 2 makes forced blocks compete (lower index wins).
  q, k, v, gates = _inputs(1)
  expected, expected_selection = _brute_force(
      q[:, -query_len:], k, v, gates[:, -query_len:], block_size=BLOCK_SIZE,
      block_count=block_count, window_size=WINDOW_SIZE)
  actual = _nsa(dtype, q, k, v, gates, block_count=block_count, query_len=query_len)
  assert_close(actual, expected, dtype)
  if dtype == jnp.float64:
    np.testing.assert_array_equal(
        _selection(q, k, block_count=block_count, query_len=query_len), expected_selection)


def test_top_k_chooses_among_earlier_blocks():
  # Guards the brute-force comparison against being vacuous: with block_count 4 some query picks a
  # block that is not forced, and not the same one everywhere.
  q, k, _, _ = _inputs(1)
  selection_BTKN = _selection(q, k, block_count=4, query_len=45)
  free_blocks_chosen = set()
  for t in range(45):
    current = t // BLOCK_SIZE
    for c in range(1, current - 1):  # neither block 0 nor IC - 1 nor IC
      if selection_BTKN[:, t, :, c].any():
        free_blocks_chosen.add(c)
  assert len(free_blocks_chosen) >= 2, free_blocks_chosen


def _random_probs(seed, *, batch=2, query_len=200, num_q_heads=4):
  """Compressed-attention-like probabilities: each row a random distribution over its complete
  blocks, peaked so that non-forced blocks often carry most of the mass."""
  rng = np.random.default_rng(seed)
  num_blocks = -(-query_len // BLOCK_SIZE)
  logits = 4.0 * rng.standard_normal((batch, query_len, num_q_heads, num_blocks))
  complete_T = (np.arange(query_len) + 1) // BLOCK_SIZE
  visible_TN = np.arange(num_blocks)[None] < complete_T[:, None]
  weights = np.where(visible_TN[:, None], np.exp(logits), 0.0)
  return weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)


@pytest.mark.parametrize("block_count", [3, 5, 8])
def test_select_blocks_rules(block_count):
  probs = _random_probs(2)
  selection_BTKN = np.asarray(reference.select_blocks(
      jnp.asarray(probs, jnp.float32), num_kv_heads=2, block_size=BLOCK_SIZE,
      block_count=block_count))
  for t in range(probs.shape[1]):
    current = t // BLOCK_SIZE
    row_BKN = selection_BTKN[:, t]
    forced = sorted({0, max(current - 1, 0), current})
    assert row_BKN[:, :, forced].all(), t  # forced blocks always win
    assert not row_BKN[:, :, current + 1:].any(), t  # blocks after the current one never
    assert (row_BKN.sum(-1) == min(block_count, current + 1)).all(), t
    if current + 1 <= block_count:  # few valid blocks: every one of them is selected
      assert row_BKN[:, :, :current + 1].all(), t
  # The non-forced choices are the most important blocks of the group.
  group_importance = probs.reshape(2, 200, 2, 2, -1).sum(3)
  t = 199
  current = t // BLOCK_SIZE
  free = np.arange(1, current - 1)
  for b in range(2):
    for h in range(2):
      ranked = free[np.argsort(-group_importance[b, t, h, free], kind="stable")]
      np.testing.assert_array_equal(
          np.nonzero(selection_BTKN[b, t, h, free])[0] + 1, np.sort(ranked[:block_count - 3]))


def test_compress_averages_partial_block():
  _, k, _, _ = _inputs(3)
  k_cmp = np.asarray(reference.compress(jnp.asarray(k, jnp.float32), BLOCK_SIZE))
  assert k_cmp.shape == (2, 6, 2, 8)
  np.testing.assert_allclose(k_cmp[:, 0], k[:, :8].mean(1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(k_cmp[:, 5], k[:, 40:45].mean(1), rtol=1e-5, atol=1e-6)


def test_first_block_queries_have_no_compressed_output():
  q, k, v, _ = _inputs(4)
  k_cmp, v_cmp = (reference.compress(jnp.asarray(x, jnp.float32), BLOCK_SIZE) for x in (k, v))
  o_cmp, probs = reference.compressed_attention(
      jnp.asarray(q, jnp.float32), k_cmp, v_cmp, block_size=BLOCK_SIZE, scale=8**-0.5)
  o_cmp, probs = np.asarray(o_cmp), np.asarray(probs)
  # Positions 0..6 have no complete block yet; position 7 completes block 0 and sees it alone.
  assert np.all(o_cmp[:, :BLOCK_SIZE - 1] == 0) and np.all(probs[:, :BLOCK_SIZE - 1] == 0)
  np.testing.assert_allclose(probs[:, BLOCK_SIZE - 1, :, 0], 1.0, rtol=1e-6)
  np.testing.assert_allclose(probs.sum(-1)[:, BLOCK_SIZE - 1:], 1.0, rtol=1e-5)
  assert np.all(probs[:, 20, :, 2:] == 0)  # (20 + 1) // 8 = 2 complete blocks


@pytest.mark.parametrize("last_seen", [20, 31, 32])
def test_causal(last_seen):
  q, k, v, gates = _inputs(5)
  base = _nsa(jnp.float32, q, k, v, gates, block_count=4)
  future = slice(last_seen + 1, None)
  rng = np.random.default_rng(6)
  for x in (q, k, v, gates):
    x[:, future] = rng.standard_normal(x[:, future].shape) * 5.0
  changed = _nsa(jnp.float32, q, k, v, gates, block_count=4)
  np.testing.assert_allclose(changed[:, :last_seen + 1], base[:, :last_seen + 1], rtol=0, atol=1e-6)
  assert np.abs(changed[:, last_seen + 1:] - base[:, last_seen + 1:]).max() > 1e-2


@pytest.mark.parametrize("query_len", [1, 5])
def test_decode_rows_equal_last_rows_of_full(query_len):
  q, k, v, gates = _inputs(7)
  full = _nsa(jnp.float32, q, k, v, gates, block_count=4)
  decode = _nsa(jnp.float32, q, k, v, gates, block_count=4, query_len=query_len)
  assert_close(decode, full[:, -query_len:], jnp.float32)


def _grads(dtype, q, k, v, gates, cotangent):
  def loss(q_, k_, v_, gates_):
    out = nsa_attention(q_, k_, v_, gates_, block_size=BLOCK_SIZE, block_count=4,
                        window_size=WINDOW_SIZE)
    return jnp.sum(out * jnp.asarray(cotangent, dtype))
  args = [jnp.asarray(x, dtype) for x in (q, k, v, gates)]
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  return [np.asarray(g).astype(np.float64) for g in grads]


def test_gradients_match_float64():
  q, k, v, gates = _inputs(8)
  cotangent = np.random.default_rng(9).standard_normal(q.shape)
  with float64():
    expected = _grads(jnp.float64, q, k, v, gates, cotangent)
  actual = _grads(jnp.float32, q, k, v, gates, cotangent)
  for name, got, want in zip(("q", "k", "v", "gates"), actual, expected):
    assert np.all(np.isfinite(got)), name
    assert_close(got, want, jnp.float32, name=f"d{name}")


def test_bfloat16_within_tolerance():
  q, k, v, gates = _inputs(10)
  # float64 on the same bf16-rounded inputs: only the computation's error is measured.
  q, k, v, gates = (np.asarray(jnp.asarray(x, jnp.bfloat16)).astype(np.float64)
                    for x in (q, k, v, gates))
  out = nsa_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, gates)),
                      block_size=BLOCK_SIZE, block_count=4, window_size=WINDOW_SIZE)
  assert out.dtype == jnp.bfloat16
  assert_close(out, _nsa(jnp.float64, q, k, v, gates, block_count=4), jnp.bfloat16)
