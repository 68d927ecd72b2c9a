"""masked_attention: the reference against a per-query loop over the set definition, plus the
properties that SWA, sinks, LTE's kept keys, GQA, decoding and padding rely on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.masked_attention import attention_mask, masked_attention
from tests.kernel_testing import assert_close, float64


def _is_visible(i, j, *, query_len, key_len, window_size, num_sinks, kept_SK, key_valid_S, kv_head):
  """The set definition, one (query, key) pair at a time."""
  position = key_len - query_len + i
  if j > position:
    return False
  if key_valid_S is not None and not key_valid_S[j]:
    return False
  if window_size is None:
    return True
  return (position - j < window_size or j < num_sinks
          or (kept_SK is not None and bool(kept_SK[j, kv_head])))


def _brute_force(q, k, v, *, scale=None, window_size=None, num_sinks=0, kept=None, key_valid=None):
  """Per-(b, h, i) float64 loop: softmax over the visible keys, zeros when none."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, query_len, num_q_heads, head_dim = q.shape
  key_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  scale = head_dim**-0.5 if scale is None else scale
  out = np.zeros(q.shape[:3] + v.shape[-1:])
  for b in range(batch):
    for h in range(num_q_heads):
      kv_head = h // group
      for i in range(query_len):
        keys = [j for j in range(key_len) if _is_visible(
            i, j, query_len=query_len, key_len=key_len, window_size=window_size,
            num_sinks=num_sinks, kept_SK=None if kept is None else kept[b],
            key_valid_S=None if key_valid is None else key_valid[b], kv_head=kv_head)]
        if not keys:
          continue
        scores = np.array([scale * q[b, i, h] @ k[b, j, kv_head] for j in keys])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[b, i, h] = sum(w * v[b, j, kv_head] for w, j in zip(weights, keys))
  return out


def _inputs(seed, *, batch=2, query_len=40, key_len=40, num_q_heads=4, num_kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, query_len, num_q_heads, head_dim))
  k = rng.standard_normal((batch, key_len, num_kv_heads, head_dim))
  v = rng.standard_normal((batch, key_len, num_kv_heads, head_dim))
  kept = rng.random((batch, key_len, num_kv_heads)) < 0.2
  return q, k, v, kept


def _run(dtype, q, k, v, **kwargs):
  """masked_attention on inputs cast to `dtype` (float64 with x64 on); returns a float64 array."""
  def call():
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    extra = {name: None if x is None else jnp.asarray(x) for name, x in kwargs.items()
             if name in ("kept_BSK", "key_valid_BS")}
    rest = {name: x for name, x in kwargs.items() if name not in extra}
    return np.asarray(masked_attention(*args, **extra, **rest)).astype(np.float64)
  if jnp.dtype(dtype) == jnp.float64:
    with float64():
      return call()
  return call()


CASES = {
    "causal": dict(query_len=40),
    "window": dict(query_len=40, window_size=16),
    "window_sinks_kept": dict(query_len=40, window_size=16, num_sinks=3, kept=True),
    "padding_kept": dict(query_len=40, window_size=7, num_sinks=2, kept=True, pad=True),
    "decode_T5": dict(query_len=5, window_size=16, num_sinks=3, kept=True, pad=True),
    "decode_T1": dict(query_len=1, window_size=16, num_sinks=3, kept=True),
    "decode_T1_causal": dict(query_len=1),
}


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_brute_force(case, dtype):
  config = dict(CASES[case])
  q, k, v, kept = _inputs(1, query_len=config.pop("query_len"))
  kept = kept if config.pop("kept", False) else None
  key_valid = None
  if config.pop("pad", False):
    key_valid = np.ones(k.shape[:2], bool)
    key_valid[1, :6] = False  # left padding of the second row
  expected = _brute_force(q, k, v, kept=kept, key_valid=key_valid, **config)
  actual = _run(dtype, q, k, v, kept_BSK=kept, key_valid_BS=key_valid, **config)
  assert_close(actual, expected, dtype)


def test_attention_mask_matches_set_definition():
  _, _, _, kept = _inputs(2, key_len=30)
  key_valid = np.ones((2, 30), bool)
  key_valid[0, :4] = False
  mask = np.asarray(attention_mask(
      12, 30, window_size=5, num_sinks=2, kept_BSK=jnp.asarray(kept),
      key_valid_BS=jnp.asarray(key_valid)))
  assert mask.shape == (2, 2, 12, 30)
  expected = np.array([[[[_is_visible(
      i, j, query_len=12, key_len=30, window_size=5, num_sinks=2, kept_SK=kept[b],
      key_valid_S=key_valid[b], kv_head=h) for j in range(30)] for i in range(12)]
      for h in range(2)] for b in range(2)])
  np.testing.assert_array_equal(mask, expected)
  # Without kept keys or padding the mask does not depend on batch or head.
  assert attention_mask(12, 30, window_size=5).shape == (1, 1, 12, 30)


def test_swa_window_counts_keys_including_current():
  # SWA-1024 (G1): the last query of 2000 keys sees keys 976..1999, i.e. 1024 keys.
  row = np.asarray(attention_mask(1, 2000, window_size=1024))[0, 0, 0]
  np.testing.assert_array_equal(np.nonzero(row)[0], np.arange(2000 - 1024, 2000))
  # A window of 16 on 40 keys: min(p + 1, 16) keys per row, the current one included.
  mask = np.asarray(attention_mask(40, 40, window_size=16))[0, 0]
  np.testing.assert_array_equal(mask.sum(-1), np.minimum(np.arange(40) + 1, 16))
  assert mask[39, 39] and mask[39, 24] and not mask[39, 23]
  # And the output at 1024 agrees with the loop on a sequence longer than the window.
  q, k, v, _ = _inputs(3, batch=1, query_len=3, key_len=1030, num_q_heads=2, num_kv_heads=1,
                       head_dim=4)
  assert_close(_run(jnp.float32, q, k, v, window_size=1024),
               _brute_force(q, k, v, window_size=1024), jnp.float32)


def test_sinks_visible_outside_window():
  q, k, v, _ = _inputs(4)
  base = _run(jnp.float32, q, k, v, window_size=4, num_sinks=2)
  # Query 39 sees sinks 0, 1 and keys 36..39: changing key 1 moves it, key 2 (neither) does not.
  for key, moves in ((1, True), (2, False), (36, True), (35, False)):
    v_changed = v.copy()
    v_changed[:, key] += 10.0
    changed = _run(jnp.float32, q, k, v_changed, window_size=4, num_sinks=2)
    assert (np.abs(changed[:, 39] - base[:, 39]).max() > 1e-3) == moves, key


def test_kept_keys_visible_only_causally():
  q, k, v, _ = _inputs(5)
  kept = np.zeros((2, 40, 2), bool)
  kept[:, 20, 0] = True  # kept for KV head 0 only
  mask = np.asarray(attention_mask(40, 40, window_size=4, kept_BSK=jnp.asarray(kept)))
  query_pos = np.arange(40)
  np.testing.assert_array_equal(mask[:, 0, :, 20], np.tile(query_pos >= 20, (2, 1)))
  in_window = (query_pos >= 20) & (query_pos < 24)
  np.testing.assert_array_equal(mask[:, 1, :, 20], np.tile(in_window, (2, 1)))
  base = _run(jnp.float32, q, k, v, window_size=4, kept_BSK=kept)
  v_changed = v.copy()
  v_changed[:, 20] += 10.0
  changed = _run(jnp.float32, q, k, v_changed, window_size=4, kept_BSK=kept)
  diff_TH = np.abs(changed - base).max(axis=(0, 3))
  assert diff_TH[:20].max() == 0  # queries before the kept key never see it
  assert diff_TH[30, :2].min() > 1e-3  # query heads 0, 1 (KV head 0) see it out of window
  assert diff_TH[30, 2:].max() == 0  # query heads 2, 3 (KV head 1) do not


def test_gqa_mapping():
  # Query head h reads KV head h // G: the same as repeating each KV head G times in a row.
  q, k, v, kept = _inputs(6, num_q_heads=6, num_kv_heads=2)
  grouped = _run(jnp.float32, q, k, v, window_size=8, num_sinks=1, kept_BSK=kept)
  repeated = _run(jnp.float32, q, *(np.repeat(x, 3, axis=2) for x in (k, v)), window_size=8,
                  num_sinks=1, kept_BSK=np.repeat(kept, 3, axis=2))
  assert_close(grouped, repeated, jnp.float32)


@pytest.mark.parametrize("query_len", [1, 5])
def test_decode_rows_equal_last_rows_of_full(query_len):
  q, k, v, kept = _inputs(7)
  config = dict(window_size=9, num_sinks=2, kept_BSK=kept)
  full = _run(jnp.float32, q, k, v, **config)
  decode = _run(jnp.float32, q[:, -query_len:], k, v, **config)
  assert_close(decode, full[:, -query_len:], jnp.float32)


def test_padding_and_fully_masked_rows():
  q, k, v, _ = _inputs(8)
  key_valid = np.ones((2, 40), bool)
  key_valid[1, :6] = False
  out = _run(jnp.float32, q, k, v, window_size=16, key_valid_BS=key_valid)
  # Queries 0..5 of row 1 sit on padding: no visible key, output exactly 0.
  assert np.all(out[1, :6] == 0) and np.all(np.abs(out[1, 6:]).max(-1) > 0)
  # Whatever the padded keys hold, the other outputs do not move.
  k_changed, v_changed = k.copy(), v.copy()
  k_changed[1, :6] = 50.0
  v_changed[1, :6] = -50.0
  np.testing.assert_array_equal(
      _run(jnp.float32, q, k_changed, v_changed, window_size=16, key_valid_BS=key_valid), out)
  # Gradients stay finite through the empty rows.
  grads = jax.jit(jax.grad(lambda q_, k_, v_: jnp.sum(masked_attention(
      q_, k_, v_, window_size=16, key_valid_BS=jnp.asarray(key_valid)) ** 2), argnums=(0, 1, 2)))(
          *(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
  assert np.all(np.asarray(grads[0])[1, :6] == 0)


def _grads(dtype, q, k, v, cotangent, kept, key_valid):
  def loss(q_, k_, v_):
    out = masked_attention(q_, k_, v_, window_size=10, num_sinks=2, kept_BSK=jnp.asarray(kept),
                           key_valid_BS=jnp.asarray(key_valid))
    return jnp.sum(out * jnp.asarray(cotangent, dtype))
  args = [jnp.asarray(x, dtype) for x in (q, k, v)]
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  return [np.asarray(g).astype(np.float64) for g in grads]


def test_gradients_match_float64():
  q, k, v, kept = _inputs(9)
  key_valid = np.ones((2, 40), bool)
  key_valid[0, :3] = False
  cotangent = np.random.default_rng(10).standard_normal(q.shape)
  with float64():
    expected = _grads(jnp.float64, q, k, v, cotangent, kept, key_valid)
  actual = _grads(jnp.float32, q, k, v, cotangent, kept, key_valid)
  for name, got, want in zip("qkv", actual, expected):
    assert_close(got, want, jnp.float32, name=f"d{name}")


def test_bfloat16_within_tolerance():
  q, k, v, kept = _inputs(11)
  # Compare with float64 on the same bf16-rounded inputs: only the computation's error is measured.
  q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16)).astype(np.float64) for x in (q, k, v))
  config = dict(window_size=12, num_sinks=2, kept_BSK=kept)
  out = masked_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
                         **{**config, "kept_BSK": jnp.asarray(kept)})
  assert out.dtype == jnp.bfloat16
  assert_close(out, _run(jnp.float64, q, k, v, **config), jnp.bfloat16)


def test_pallas_not_implemented():
  q, k, v, _ = _inputs(12, batch=1, query_len=4, key_len=4)
  with pytest.raises(NotImplementedError):
    masked_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), implementation="pallas")


BAD_ARGUMENTS = {
    "heads": (dict(num_q_heads=3, num_kv_heads=2), {}, "heads"),
    "head_dim": (dict(), dict(k_dim=4), "head dim"),
    "kept_shape": (dict(), dict(kept_BSK=np.zeros((2, 8, 1), bool), window_size=4), "kept_BSK"),
    "kept_dtype": (dict(), dict(kept_BSK=np.zeros((2, 8, 2)), window_size=4), "kept_BSK"),
    "key_valid_shape": (dict(), dict(key_valid_BS=np.ones((2, 7), bool)), "key_valid_BS"),
    "window_zero": (dict(), dict(window_size=0), "window_size"),
    "window_negative": (dict(), dict(window_size=-3), "window_size"),
    "T_gt_S": (dict(query_len=9), {}, "T=9"),
    "rank": (dict(), dict(q_rank3=True), "q_BTHD"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_raise_value_error(case):
  shape_args, kwargs, message = BAD_ARGUMENTS[case]
  kwargs = dict(kwargs)
  q, k, v, _ = _inputs(13, **{"query_len": 8, "key_len": 8, **shape_args})
  if kwargs.pop("k_dim", None):
    k = k[..., :4]
  if kwargs.pop("q_rank3", False):
    q = q[:, :, 0]
  for name in ("kept_BSK", "key_valid_BS"):
    if name in kwargs:
      kwargs[name] = jnp.asarray(kwargs[name])
  with pytest.raises(ValueError, match=message):
    masked_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), **kwargs)


ROUTES = {
    # name: (head dim, masked_attention kwargs beyond q, k, v, versions tried in order)
    "causal": (64, {}, ["cudnn"]),
    "causal_with_padding": (64, dict(key_valid_BS=True), ["cudnn", "pallas"]),
    "window_d64": (64, dict(window_size=7), ["pallas"]),
    "window_d128": (128, dict(window_size=7), ["cudnn"]),
    "window_d128_sinks": (128, dict(window_size=7, num_sinks=1), ["cudnn", "pallas"]),
    "lte_kept": (64, dict(window_size=7, num_sinks=1, kept_BSK=True), ["pallas"]),
    "window_d24_untiled": (24, dict(window_size=7), ["pallas", "xla"]),
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_gpu_default_routing(case, monkeypatch):
  """implementation=None on a GPU follows `gpu_default` (cuDNN for plain causal attention and for
  plain windows at head dim 128, the Pallas kernels for other windows and LTE masks) and a version
  that refuses the inputs passes them on. Checked on any backend by standing in for the GPU and
  recording the versions tried (each still runs its own input check); a fresh shape per case, so
  no earlier trace of the jitted entry answers."""
  import pallas_kernels.masked_attention as entry  # pylint: disable=import-outside-toplevel
  from pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel
  head_dim, kwargs, expected = ROUTES[case]
  calls = []

  def recorder(name, check):
    def version(q, k, v, **kw):
      calls.append(name)
      check(q, k, v, **kw)
      return jnp.zeros_like(q)
    return version

  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(entry.cudnn, "masked_attention", recorder("cudnn", lambda q, k, v, **kw: (
      entry.cudnn.check_supported(q, k, v, **{n: kw[n] for n in (
          "window_size", "num_sinks", "kept_BSK", "key_valid_BS")}))))
  monkeypatch.setattr(entry.pallas, "masked_attention", recorder("pallas", lambda q, k, v, **kw: (
      entry.pallas.check_supported(q, k, v, interpret=False))))
  monkeypatch.setattr(entry.reference, "masked_attention", recorder("xla", lambda *a, **kw: None))
  length = 17 + sorted(ROUTES).index(case)
  rng = np.random.default_rng(3)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  q, k = normal(1, length, 4, head_dim), normal(1, length, 2, head_dim)
  if kwargs.get("kept_BSK"):
    kwargs = dict(kwargs, kept_BSK=jnp.asarray(rng.random((1, length, 2)) < 0.3))
  if kwargs.get("key_valid_BS"):
    kwargs = dict(kwargs, key_valid_BS=jnp.arange(length)[None] >= 2)
  entry.masked_attention(q, k, k, **kwargs)
  assert calls == expected


def test_gpu_default_under_a_multi_device_mesh_is_pallas():
  """Under a mesh of several devices nothing goes to cuDNN (its path crashed the FSDP step)."""
  from pallas_kernels.masked_attention import gpu_default  # pylint: disable=import-outside-toplevel
  q64, q128 = jnp.zeros((1, 8, 4, 64)), jnp.zeros((1, 8, 4, 128))
  assert gpu_default(q64, window_size=None) == ("cudnn", "pallas", "xla")
  assert gpu_default(q128, window_size=7) == ("cudnn", "pallas", "xla")
  assert gpu_default(q64, window_size=7) == ("pallas", "xla")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("fsdp",))):
    assert gpu_default(q64, window_size=None) == ("pallas", "xla")
    assert gpu_default(q128, window_size=7) == ("pallas", "xla")


def test_cudnn_can_be_named_and_refuses_what_it_cannot_compute():
  q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="cudnn.*sinks"):
    masked_attention(q, q, q, window_size=3, num_sinks=1, implementation="cudnn")
  with pytest.raises(ValueError, match="unknown"):
    masked_attention(q, q, q, implementation="triton")
