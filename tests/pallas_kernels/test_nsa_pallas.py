"""nsa_attention's Pallas version and NSA decoding against the dense reference.

On CPU the kernels run in Pallas interpret mode on tiny shapes (block size 16, 16-wide tiles, so
that a few dozen tokens span several blocks and tiles); interpret mode fills every output buffer
with NaN before a kernel runs and the comparisons reject non-finite values, so every output element
must be written. Lengths are not multiples of the block. The `gpu` tests compile the kernels with
Triton at the paper's laNSA shape (Hq 32, Hkv 2, D 64, block 64, 16 blocks, window 512). Also:
the selection and its inverse on their own, the decode cache updates, and the kernels' lowering to
Triton (checked on any backend).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import (
    NSABlockSizes, append_token, cache_length, compress_prompt, compressed_blocks,
    nsa_attention, nsa_decode_attention, pallas, pallas_compressed, pallas_decode, reference,
    selection)
from pallas_kernels.nsa.tiling import make_problem
from tests.kernel_testing import (GROUP, assert_close, assert_other_groups_untouched,
                                  stacked_in_poison)

BLOCKS = NSABlockSizes(cmp_keys=16, cmp_bwd_keys=16, cmp_bwd_queries_per_program=16,
                       slc_queries_per_program=8, decode_splits=2)
BLOCK_SIZE, WINDOW_SIZE = 16, 20
PAPER = dict(block_size=64, block_count=16, window_size=512)


def _inputs(seed, *, batch=2, query_len, key_len=None, num_q_heads=4, num_kv_heads=2,
            head_dim=16):
  rng = np.random.default_rng(seed)
  key_len = query_len if key_len is None else key_len
  normal = lambda *shape: rng.standard_normal(shape)
  # Larger keys make compressed attention peaked, so that importances differ clearly between blocks.
  return dict(q=normal(batch, query_len, num_q_heads, head_dim),
              k=2.0 * normal(batch, key_len, num_kv_heads, head_dim),
              v=normal(batch, key_len, num_kv_heads, head_dim),
              gates=1.0 / (1.0 + np.exp(-normal(batch, query_len, num_q_heads, 3))),
              do=normal(batch, query_len, num_q_heads, head_dim))


def _outputs_and_grads(fn):
  """Jitted (o, dq, dk, dv, dgates) of fn(q, k, v, gates) against the cotangent do."""
  def run(q, k, v, gates, do):
    o, vjp = jax.vjp(fn, q, k, v, gates)
    return (o,) + vjp(do.astype(o.dtype))
  return jax.jit(run)


def _check(fn, inputs, dtype, *, grads=True, factor=1.0):
  """fn and the reference on the same inputs rounded to dtype (the reference in float32)."""
  args = [jnp.asarray(inputs[n], dtype) for n in ("q", "k", "v", "gates", "do")]
  sizes = {name: fn.keywords[name] for name in ("block_size", "block_count", "window_size")}
  expected_fn = functools.partial(reference.nsa_attention, **sizes)
  f32 = [x.astype(jnp.float32) for x in args]
  if grads:
    actual = _outputs_and_grads(fn)(*args)
    expected = _outputs_and_grads(expected_fn)(*f32)
  else:
    actual, expected = (jax.jit(fn)(*args[:4]),), (expected_fn(*f32[:4]),)
  for name, a, e in zip(("o", "dq", "dk", "dv", "dgates"), actual, expected):
    assert a.dtype == dtype, (name, a.dtype)
    assert_close(a, e, dtype, factor=factor, name=name)


def _interpret(block_count):
  return functools.partial(pallas.nsa_attention, block_size=BLOCK_SIZE, block_count=block_count,
                           window_size=WINDOW_SIZE, block_sizes=BLOCKS, interpret=True)


@pytest.mark.slow
def test_interpret_matches_reference_float32():
  # T = 75: 5 blocks, the last one partial; block_count 4 leaves a free choice among the earlier
  # blocks once the current block is the fourth (forced: first, previous, current).
  _check(_interpret(4), _inputs(0, query_len=75), jnp.float32)


@pytest.mark.slow
def test_interpret_matches_reference_bfloat16():
  # 3 blocks and block_count 3: every valid block is selected, so the selection cannot differ from
  # the reference's through bf16 rounding of near-equal importances.
  _check(_interpret(3), _inputs(1, query_len=45), jnp.bfloat16)


@pytest.mark.slow
def test_public_entry_queries_after_a_longer_key_sequence():
  """T_q < T_k (prefill continuing a sequence): query i sits at position T_k - T_q + i. Through
  the public entry, with the default block sizes."""
  fn = functools.partial(nsa_attention, implementation="pallas", block_size=BLOCK_SIZE,
                         block_count=4, window_size=WINDOW_SIZE)
  _check(fn, _inputs(2, query_len=21, key_len=75), jnp.float32, grads=False)


def test_public_entry_refuses_untiled_shapes():
  inputs = _inputs(3, query_len=20, batch=1)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "gates")]
  sizes = dict(block_size=BLOCK_SIZE, block_count=2, window_size=WINDOW_SIZE)
  with pytest.raises(NotImplementedError, match="power of two"):
    nsa_attention(*(x[..., :12] for x in args[:3]), args[3], implementation="pallas", **sizes)
  with pytest.raises(NotImplementedError, match=">= 16"):
    nsa_attention(*args, implementation="pallas", **dict(sizes, block_size=8))


def test_compressed_kernel_importance_matches_reference():
  """The compressed kernel's outputs and block importance (fused into its second pass) against
  reference.compressed_attention and reference.block_importance, T_q < T_k."""
  inputs = _inputs(10, query_len=37, key_len=70)
  q, k, v = (jnp.asarray(inputs[n], jnp.float32) for n in "qkv")
  problem = make_problem(q.shape, k.shape, block_size=BLOCK_SIZE, block_count=4, scale=0.25,
                         blocks=BLOCKS, interpret=True)
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))
  k_cmp, v_cmp = (reference.compress(x, BLOCK_SIZE) for x in (k, v))
  o, _, importance = pallas_compressed.forward(
      problem, BLOCKS, pad(q, problem.padded_query_len), pad(k_cmp, problem.num_blocks_padded),
      pad(v_cmp, problem.num_blocks_padded))
  expected_o, probs = reference.compressed_attention(q, k_cmp, v_cmp, block_size=BLOCK_SIZE,
                                                     scale=0.25, query_offset=33)
  expected = np.asarray(reference.block_importance(
      probs, num_kv_heads=2, block_size=BLOCK_SIZE, position_BT=33 + jnp.arange(37)[None]))
  assert_close(o[:, :37], expected_o, jnp.float32)
  importance = np.asarray(importance[:, :37])
  num_blocks = expected.shape[-1]
  assert np.all(importance[..., num_blocks:] == -np.inf)
  np.testing.assert_array_equal(np.isinf(importance[..., :num_blocks]), np.isinf(expected))
  finite = np.isfinite(expected)
  np.testing.assert_allclose(importance[..., :num_blocks][finite], expected[finite], atol=1e-6)


def test_block_sizes_are_validated():
  assert NSABlockSizes(num_stages=3).num_stages == 3
  for bad, message in ((dict(cmp_keys=48), "cmp_keys"), (dict(num_warps=0), "num_warps"),
                       (dict(cmp_bwd_queries_per_program=2), "cmp_bwd_queries_per_program")):
    with pytest.raises(ValueError, match=message):
      NSABlockSizes(**bad)


def test_select_top_blocks_matches_reference():
  rng = np.random.default_rng(4)
  batch, length, num_q_heads, num_kv_heads, num_blocks = 2, 90, 4, 2, 6
  logits = 3.0 * rng.standard_normal((batch, length, num_q_heads, num_blocks))
  complete_T = (np.arange(length) + 1) // BLOCK_SIZE
  visible = np.arange(num_blocks)[None] < complete_T[:, None]
  probs = np.where(visible[:, None], np.exp(logits), 0.0)
  probs = jnp.asarray(probs / np.maximum(probs.sum(-1, keepdims=True), 1e-30), jnp.float32)
  current_T = np.arange(length) // BLOCK_SIZE
  block_N = np.arange(num_blocks)
  forced = (block_N == 0) | (block_N == current_T[:, None] - 1) | (block_N == current_T[:, None])
  per_head = np.where(forced[:, None], 1.0, np.where(block_N < current_T[:, None, None], probs,
                                                     0.0))
  importance = per_head.reshape(batch, length, num_kv_heads, -1, num_blocks).sum(3)
  importance = np.where(block_N <= current_T[:, None, None], importance, -np.inf)
  for block_count in (2, 4, 8):
    indices, counts = selection.select_top_blocks(jnp.asarray(importance, jnp.float32),
                                                  block_count)
    expected = reference.select_blocks(probs, num_kv_heads=num_kv_heads, block_size=BLOCK_SIZE,
                                       block_count=block_count)
    chosen = np.zeros(expected.shape, bool)
    b, t, h, s = np.nonzero(np.asarray(indices) >= 0)
    chosen[b, t, h, np.asarray(indices)[b, t, h, s]] = True
    np.testing.assert_array_equal(chosen, expected)
    np.testing.assert_array_equal(counts, np.asarray(expected).sum(-1))
    assert indices.shape[-1] == block_count


def test_queries_by_block_lists_every_pair_once_in_items_of_bounded_size():
  rng = np.random.default_rng(5)
  batch, length, num_kv_heads, count, num_blocks, per_program = 2, 50, 2, 3, 4, 8
  indices = np.full((batch, length, num_kv_heads, count), selection.NO_BLOCK)
  for b, t, h in np.ndindex(batch, length, num_kv_heads):
    valid = rng.permutation(t // BLOCK_SIZE + 1)[:rng.integers(1, count + 1)]
    indices[b, t, h, :len(valid)] = valid
  queries, items = selection.queries_by_block(
      jnp.asarray(indices, jnp.int32), num_blocks=num_blocks, queries_per_program=per_program,
      pad=4)
  queries, items = np.asarray(queries), np.asarray(items)
  for b, h in np.ndindex(batch, num_kv_heads):
    seen = {c: [] for c in range(num_blocks)}
    for block, first, end, _ in items[b, h]:
      assert 0 <= end - first <= per_program
      seen[block] += list(queries[first:end])
    for c in range(num_blocks):
      assert seen[c] == [t for t in range(length) if c in indices[b, t, h]], (b, h, c)


def _decode_inputs(seed, prompt_lengths, steps, max_length, block_size=BLOCK_SIZE, **shape):
  """A sequence's q, k, v, gates and caches filled with each row's prompt (its first
  prompt_lengths[b] tokens), ready to decode `steps` tokens."""
  inputs = _inputs(seed, query_len=max(prompt_lengths) + steps, **shape)
  slots = cache_length(max_length, block_size)
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  in_prompt = (np.arange(slots)[None, :] < np.asarray(prompt_lengths)[:, None])[..., None, None]
  pad = lambda x: np.pad(x, ((0, 0), (0, slots - x.shape[1]), (0, 0), (0, 0)))
  caches = [jnp.asarray(np.where(in_prompt, pad(inputs[n]), 0.0), jnp.float32) for n in "kv"]
  return inputs, lengths, caches


@pytest.mark.parametrize("positions", [(200, 95), (15, 47)])
def test_decode_select_kernel_equals_reference_selection(positions):
  """The decode's select kernel (partials merged, importance, top-n) against the reference's
  compressed attention, block_importance and select_top_blocks, float32: 13 and 6 complete blocks
  for a top-5, so the order matters, with the forced blocks tied at the group size (the lower
  block first); a row before its second block (position 15) selects fewer than block_count."""
  block_count, num_blocks = 5, compressed_blocks(256, BLOCK_SIZE, BLOCKS)
  rng = np.random.default_rng(7)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q_BHD, position_B = normal(2, 4, 16), jnp.asarray(positions, jnp.int32)
  k_cmp_BNKD, v_cmp_BNKD = 2.0 * normal(2, num_blocks, 2, 16), normal(2, num_blocks, 2, 16)
  problem = make_problem(
      (2, 1, 4, 16), (2, 256, 2, 16), block_size=BLOCK_SIZE, block_count=block_count,
      scale=0.25, blocks=BLOCKS, interpret=True)
  o_cmp_BHD, indices_BKS, counts_BK = jax.jit(functools.partial(
      pallas_decode._compressed_and_select, problem, BLOCKS))(  # pylint: disable=protected-access
          q_BHD, k_cmp_BNKD[None], v_cmp_BNKD[None], position_B, jnp.zeros((1,), jnp.int32))
  for row, position in enumerate(positions):
    o_ref, probs = reference.compressed_attention(
        q_BHD[row][None, None], k_cmp_BNKD[row][None], v_cmp_BNKD[row][None],
        block_size=BLOCK_SIZE, scale=0.25, query_offset=position)
    importance = reference.block_importance(probs, num_kv_heads=2, block_size=BLOCK_SIZE,
                                            position_BT=jnp.asarray([[position]]))
    want_indices, want_counts = selection.select_top_blocks(importance, block_count)
    assert_close(o_cmp_BHD[row], o_ref[0, 0], jnp.float32, name=f"o_cmp row {row}")
    np.testing.assert_array_equal(indices_BKS[row, :, :block_count], want_indices[0, 0])
    assert (np.asarray(indices_BKS[row, :, block_count:]) == selection.NO_BLOCK).all()
    np.testing.assert_array_equal(counts_BK.reshape(2, 2)[row], want_counts[0, 0])


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["xla", "pallas", "reference"])
def test_decode_equals_full_forward(implementation):
  """Teacher forcing: the prompt pooled by compress_prompt, then one append_token and one decode
  step per token; every step equals the full forward at that position. Rows decode from their
  own positions and cross block boundaries (32, 48) at different steps. The caches are one layer
  group of a stack whose other groups hold NaN (`group=`): they are never read or written."""
  block_count = 4
  inputs, position, (k_cache, v_cache) = _decode_inputs(6, (30, 41), 10, max_length=64)
  # Every step jitted (op by op, each small op would lower and compile on its own).
  full = jax.jit(functools.partial(
      reference.nsa_attention, block_size=BLOCK_SIZE, block_count=block_count,
      window_size=WINDOW_SIZE))(*(jnp.asarray(inputs[n], jnp.float32)
                                  for n in ("q", "k", "v", "gates")))
  num_blocks = compressed_blocks(64, BLOCK_SIZE, BLOCKS)
  caches = [stacked_in_poison(x) for x in (k_cache, v_cache) + compress_prompt(
      k_cache, v_cache, position, block_size=BLOCK_SIZE, num_blocks=num_blocks)]
  group = jnp.int32(GROUP)
  sizes = dict(block_size=BLOCK_SIZE, block_count=block_count, window_size=WINDOW_SIZE)
  if implementation == "pallas":
    step = jax.jit(functools.partial(pallas_decode.decode_attention, block_sizes=BLOCKS,
                                     interpret=True, **sizes))
  elif implementation == "reference":
    step = jax.jit(functools.partial(reference.decode_attention, **sizes))
  else:
    step = jax.jit(lambda *args: nsa_decode_attention(*args[:-1], group=args[-1],
                                                      implementation="xla", **sizes))
  append = jax.jit(functools.partial(append_token, block_size=BLOCK_SIZE))
  rows = jnp.arange(2)
  at = lambda name: jnp.asarray(inputs[name], jnp.float32)[rows, position]
  for _ in range(10):
    caches = append(*caches, at("k"), at("v"), position, group=group)
    out = step(at("q"), at("gates"), *caches, position, group)
    assert_close(out, full[rows, position], jnp.float32, name=f"position {position}")
    position = position + 1
  for cache in caches:
    assert_other_groups_untouched(cache)


def test_compressed_cache_holds_the_complete_blocks_means():
  inputs, lengths, (k_cache, _) = _decode_inputs(7, (30, 41), 0, max_length=64)
  k_cmp, _ = compress_prompt(k_cache, k_cache, lengths, block_size=BLOCK_SIZE, num_blocks=16)
  expected = np.asarray(reference.compress(jnp.asarray(inputs["k"], jnp.float32), BLOCK_SIZE))
  k_cmp = np.asarray(k_cmp)
  assert k_cmp.shape == (2, 16, 2, 16)
  np.testing.assert_allclose(k_cmp[0, :1], expected[0, :1], rtol=1e-5)  # 30 tokens: 1 block
  np.testing.assert_allclose(k_cmp[1, :2], expected[1, :2], rtol=1e-5)  # 41 tokens: 2 blocks
  assert not k_cmp[0, 1:].any() and not k_cmp[1, 2:].any()


def test_kernels_lower_to_triton():
  """The Pallas kernels of training (forward and backward) and decoding at the paper's shape
  lower to Triton for a GPU, checked without one (lowering only, no Triton compilation)."""
  shape = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  q, k = shape((1, 300, 32, 64), bf16), shape((1, 300, 2, 64), bf16)
  gates = shape((1, 300, 32, 3), bf16)
  train = functools.partial(pallas.nsa_attention, interpret=False, **PAPER)
  grads = jax.grad(lambda *a: train(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))
  decode = functools.partial(pallas_decode.decode_attention, interpret=False, **PAPER)
  decode_args = (shape((4, 32, 64), bf16), shape((4, 32, 3), bf16),
                 shape((12, 4, 1024, 2, 64), bf16), shape((12, 4, 1024, 2, 64), bf16),
                 shape((12, 4, 64, 2, 64), bf16), shape((12, 4, 64, 2, 64), bf16),
                 shape((4,), jnp.int32), shape((), jnp.int32))
  for fn, args, kernels in (
      (grads, (q, k, k, gates), {"nsa_compressed_fwd", "nsa_compressed_dq", "nsa_compressed_dkdv",
                                 "nsa_selected_fwd", "nsa_selected_dq", "nsa_selected_dkdv",
                                 "masked_attention_fwd"}),
      (decode, decode_args, {"nsa_decode_compressed", "nsa_decode_select",
                             "nsa_decode_selected_window"})):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert kernels <= set(re.findall(r'name = "([a-z_]+)"', text))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,query_len,block_count",
                         [(jnp.bfloat16, 1000, 16), (jnp.float32, 1000, 8)])
def test_gpu_matches_reference(dtype, query_len, block_count):
  # bf16: 16 blocks and block_count 16 select every valid block (no near-tie can flip with bf16
  # rounding); float32: block_count 8 chooses among earlier blocks.
  fn = functools.partial(pallas.nsa_attention, **dict(PAPER, block_count=block_count))
  _check(fn, _inputs(8, query_len=query_len, num_q_heads=32, head_dim=64), dtype)


@pytest.mark.gpu
def test_gpu_decode_equals_full_forward():
  sizes = dict(PAPER, block_count=8)
  inputs, position, (k_cache, v_cache) = _decode_inputs(
      9, (700, 961), 70, max_length=1100, num_q_heads=32, head_dim=64, block_size=64)
  full = reference.nsa_attention(
      *(jnp.asarray(inputs[n], jnp.float32) for n in ("q", "k", "v", "gates")), **sizes)
  k_cmp, v_cmp = compress_prompt(k_cache, v_cache, position, block_size=64,
                                 num_blocks=compressed_blocks(1100, 64))
  rows = jnp.arange(2)
  at = lambda name: jnp.asarray(inputs[name], jnp.float32)[rows, position]
  for _ in range(70):
    k_cache, v_cache, k_cmp, v_cmp = append_token(k_cache, v_cache, k_cmp, v_cmp, at("k"),
                                                  at("v"), position, block_size=64)
    out = nsa_decode_attention(at("q"), at("gates"), k_cache, v_cache, k_cmp, v_cmp, position,
                               implementation="pallas", **sizes)
    assert_close(out, full[rows, position], jnp.float32, name=f"position {position}")
    position = position + 1
