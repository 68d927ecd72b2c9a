"""masked_attention's Pallas version against the dense reference: outputs and gradients wrt q, k,
v for SWA, sinks, LTE's kept keys, full causal attention, key padding and T < S; lengths that are
not multiples of the tiles. On CPU the kernels run in Pallas interpret mode with 16-wide tiles (so
that tiny inputs span several tiles); the `gpu` tests compile them with Triton at larger sizes.
Also checks the tile-range arithmetic and the kept-list compaction on their own."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.masked_attention import attention_mask, compaction, masked_attention
from pallas_kernels.masked_attention import pallas as attention_pallas
from pallas_kernels.masked_attention import reference
from pallas_kernels.masked_attention.tiling import (
    BlockSizes, Problem, key_tiles_of_query_tile, query_tiles_of_key_tile)
from tests.kernel_testing import assert_close

TINY_BLOCKS = BlockSizes(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16,
                         block_k_dkv=16)


def _split_blocks(blocks: BlockSizes, tiles: int) -> BlockSizes:
  """`blocks` whose kept-list dk/dv kernel runs `tiles` query tiles per program at any length
  (0: one program per list tile), so that tiny inputs also run the split kernel that long
  sequences use."""
  if not tiles:
    return dataclasses.replace(blocks, kept_split_from=2**30)
  return dataclasses.replace(blocks, kept_split_from=1, kept_split_tiles=tiles)


def _inputs(seed, *, batch, query_len, key_len, num_q_heads, num_kv_heads, head_dim, dtype,
            kept_fraction=0.2, padded=False):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q = normal(batch, query_len, num_q_heads, head_dim)
  k = normal(batch, key_len, num_kv_heads, head_dim)
  v = normal(batch, key_len, num_kv_heads, head_dim)
  do = normal(batch, query_len, num_q_heads, head_dim)
  kept = jnp.asarray(rng.random((batch, key_len, num_kv_heads)) < kept_fraction)
  key_valid = None
  if padded:  # left padding of a different length per batch row
    starts = rng.integers(1, key_len // 3, size=(batch, 1))
    key_valid = jnp.asarray(np.arange(key_len)[None, :] >= starts)
  return q, k, v, do, kept, key_valid


def _outputs_and_grads(attention_fn, q, k, v, do, **kwargs):
  def loss(q, k, v):
    o = attention_fn(q, k, v, **kwargs)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), o

  # Jitted: op by op, each small op (and the interpreted kernels) would lower and compile alone.
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return (o,) + grads


def _check_against_reference(pallas_fn, *, dtype, batch=1, query_len=50, key_len=50,
                             num_q_heads=4, num_kv_heads=2, head_dim=16, window_size=7,
                             num_sinks=0, use_kept=True, padded=False, seed=0, factor=1.0,
                             kept_fraction=0.2):
  q, k, v, do, kept, key_valid = _inputs(
      seed, batch=batch, query_len=query_len, key_len=key_len, num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, padded=padded,
      kept_fraction=kept_fraction)
  kwargs = dict(window_size=window_size, num_sinks=num_sinks,
                kept_BSK=kept if use_kept else None, key_valid_BS=key_valid)
  actual = _outputs_and_grads(pallas_fn, q, k, v, do, **kwargs)
  # The reference in float32 from the same (possibly bf16-rounded) inputs.
  as_f32 = lambda x: x.astype(jnp.float32)
  expected = _outputs_and_grads(reference.masked_attention, as_f32(q), as_f32(k), as_f32(v),
                                as_f32(do), **kwargs)
  for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
    assert a.dtype == dtype, (name, a.dtype)
    assert_close(a, e, dtype, factor=factor, name=name)


def _interpret_pallas(q, k, v, *, blocks=TINY_BLOCKS, **kwargs):
  return attention_pallas.masked_attention(q, k, v, block_sizes=blocks, interpret=True, **kwargs)


CASES = {
    # name: (dtype, overrides); kept_split: query tiles per kept dk/dv program (default 0).
    # One query tile per program: the atomics of several programs add up.
    "lte_sinks_kept": (jnp.float32, dict(window_size=7, num_sinks=2, kept_split=1)),
    "lte_wide_window_one_program_per_list_tile": (jnp.float32, dict(
        query_len=77, key_len=77, window_size=40, kept_fraction=0.4)),
    # Query chunks of 3 tiles over 5 tiles: a short last chunk, and list tiles that a chunk
    # sees only in part.
    "lte_split_three_query_tiles_per_program": (jnp.float32, dict(
        query_len=77, key_len=77, window_size=20, num_sinks=1, kept_fraction=0.4,
        kept_split=3)),
    # Full list tiles whose newest entry leaves the window long before the last query tile: the
    # dk/dv kernels' query tiles past it run without a mask.
    "lte_list_tiles_past_every_window": (jnp.float32, dict(
        query_len=200, key_len=200, window_size=20, num_sinks=1, kept_fraction=0.4)),
    "causal": (jnp.float32, dict(window_size=None, use_kept=False)),
    "prefill_padded_t_lt_s": (jnp.float32, dict(batch=2, query_len=30, key_len=77,
                                                window_size=20, num_sinks=2, padded=True)),
    "lte_bf16_d32": (jnp.bfloat16, dict(batch=2, query_len=77, key_len=77, head_dim=32,
                                        window_size=33, num_sinks=2, kept_split=1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_interpret_matches_reference(case):
  dtype, overrides = CASES[case]
  overrides = dict(overrides)
  blocks = _split_blocks(TINY_BLOCKS, overrides.pop("kept_split", 0))
  _check_against_reference(lambda q, k, v, **kw: _interpret_pallas(q, k, v, blocks=blocks, **kw),
                           dtype=dtype, **overrides)


@pytest.mark.parametrize("padded,query_len,key_len,kept_fraction", [
    (False, 30, 45, 0.2), (True, 30, 45, 0.2),
    # List tiles outside every query's window: the unmasked loop over the kept list.
    (True, 150, 200, 0.5)])
def test_inference_forward_matches_reference(padded, query_len, key_len, kept_fraction):
  """Not differentiated: the forward without logsumexp (prefill) that reads kept keys by
  position."""
  q, k, v, _, kept, key_valid = _inputs(
      4, batch=2, query_len=query_len, key_len=key_len, num_q_heads=4, num_kv_heads=1,
      head_dim=16, dtype=jnp.float32, padded=padded, kept_fraction=kept_fraction)
  kwargs = dict(window_size=9, kept_BSK=kept, key_valid_BS=key_valid)
  actual = _interpret_pallas(q, k, v, **kwargs)
  assert_close(actual, reference.masked_attention(q, k, v, **kwargs), jnp.float32)


def test_public_entry_routes_to_pallas():
  q, k, v, _, kept, _ = _inputs(3, batch=1, query_len=20, key_len=20, num_q_heads=2,
                                num_kv_heads=1, head_dim=16, dtype=jnp.float32)
  kwargs = dict(window_size=6, num_sinks=1, kept_BSK=kept)
  actual = masked_attention(q, k, v, implementation="pallas", **kwargs)
  assert_close(actual, reference.masked_attention(q, k, v, **kwargs), jnp.float32)
  with pytest.raises(NotImplementedError, match="power of two"):
    masked_attention(q[..., :12], k[..., :12], v[..., :12], implementation="pallas", **kwargs)


@pytest.mark.parametrize("window_size", [None, 1, 5, 16, 23, 40])
@pytest.mark.parametrize("query_len,key_len", [(50, 50), (20, 70)])
def test_tile_ranges_cover_exactly_the_window_pairs(window_size, query_len, key_len):
  """Every window-visible pair lies in a visited tile; interior tiles need no mask."""
  block_q, block_k = 16, 8
  padded_q, padded_k = -(-query_len // block_q) * block_q, -(-key_len // block_k) * block_k
  problem = Problem(query_len=query_len, key_len=key_len, padded_query_len=padded_q,
                    padded_key_len=padded_k, head_dim=16, num_q_heads=1, num_kv_heads=1,
                    window_size=window_size, has_kept_list=False, has_key_valid=False, scale=1.0,
                    interpret=True)
  mask_TS = np.asarray(attention_mask(query_len, key_len, window_size=window_size))[0, 0]
  mask_TS = np.pad(mask_TS, ((0, padded_q - query_len), (0, padded_k - key_len)))
  tile_mask = mask_TS.reshape(padded_q // block_q, block_q, padded_k // block_k, block_k)
  # Padded query rows (outputs dropped, zero gradient) may use unmasked tiles: ignore them.
  real_rows = (np.arange(padded_q) < query_len).reshape(-1, block_q, 1, 1)
  any_visible = tile_mask.any(axis=(1, 3))
  all_visible = (tile_mask | ~real_rows).all(axis=(1, 3))
  for qt in range(padded_q // block_q):
    first, lo, hi, end = (int(x) for x in key_tiles_of_query_tile(
        problem, qt * block_q, block_q, block_k))
    assert first <= lo <= hi <= end
    visited = np.zeros(padded_k // block_k, bool)
    visited[first:end] = True
    assert np.all(visited >= any_visible[qt]), (qt, first, end)
    assert np.all(all_visible[qt, lo:hi]), (qt, lo, hi)
  for kt in range(padded_k // block_k):
    first, lo, hi, end = (int(x) for x in query_tiles_of_key_tile(
        problem, kt * block_k, block_q, block_k))
    assert first <= lo <= hi <= end
    visited = np.zeros(padded_q // block_q, bool)
    visited[first:end] = True
    assert np.all(visited >= any_visible[:, kt]), (kt, first, end)
    assert np.all(all_visible[lo:hi, kt]), (kt, lo, hi)


def test_kept_list_is_sorted_and_counts_follow_the_window():
  rng = np.random.default_rng(5)
  batch, key_len, num_kv_heads, num_sinks, window = 2, 37, 3, 2, 6
  kept = rng.random((batch, key_len, num_kv_heads)) < 0.3
  key_valid = np.arange(key_len)[None, :] >= np.array([[0], [4]])
  k = jnp.asarray(rng.standard_normal((batch, key_len, num_kv_heads, 16)), jnp.float32)
  listed_BKS = compaction.listed_keys(
      batch=batch, key_len=key_len, num_kv_heads=num_kv_heads, num_sinks=num_sinks,
      kept_BSK=jnp.asarray(kept), key_valid_BS=jnp.asarray(key_valid))
  positions_BKC = compaction.kept_positions(listed_BKS, compaction.listed_before(listed_BKS),
                                           capacity=40)
  listed_k_BCKD, _ = compaction.gather_kept(k, k, positions_BKC)
  counts = compaction.entries_per_query_tile(compaction.listed_before(listed_BKS), block_q=8,
                                             num_q_tiles=5, query_offset=0, window_size=window)
  for b in range(batch):
    for h in range(num_kv_heads):
      expected = [j for j in range(key_len)
                  if (kept[b, j, h] or j < num_sinks) and key_valid[b, j]]
      positions = np.asarray(positions_BKC[b, h])
      assert list(positions[:len(expected)]) == expected
      assert np.all(positions[len(expected):] == compaction.PAD_POSITION)
      np.testing.assert_array_equal(listed_k_BCKD[b, :len(expected), h], k[b, expected, h])
      assert not np.any(listed_k_BCKD[b, len(expected):, h])  # padding entries hold zeros
      for t in range(5):
        last_query = 8 * t + 7
        assert counts[b, h, t] == sum(j <= last_query - window for j in expected)


def test_entries_to_keys_is_the_transpose_of_the_gather():
  """The kept entries' gradients reach the keys by the inverse map (a gather), as the automatic
  transpose of gather_kept (a scatter-add) would send them."""
  rng = np.random.default_rng(6)
  batch, key_len, num_kv_heads, capacity = 2, 37, 3, 48
  kept = jnp.asarray(rng.random((batch, key_len, num_kv_heads)) < 0.4)
  key_valid = jnp.asarray(np.arange(key_len)[None, :] >= np.array([[0], [5]]))
  listed_BKS = compaction.listed_keys(batch=batch, key_len=key_len, num_kv_heads=num_kv_heads,
                                      num_sinks=2, kept_BSK=kept, key_valid_BS=key_valid)
  kept_list, _ = compaction.kept_list_and_counts(
      listed_BKS, capacity=capacity, block_qs=(16,), padded_query_len=48, query_offset=0,
      window_size=7, with_slots=True)
  k = jnp.asarray(rng.standard_normal((batch, capacity, num_kv_heads, 16)), jnp.float32)
  d_entries = jnp.asarray(rng.standard_normal((batch, capacity, num_kv_heads, 16)), jnp.float32)
  transpose = jax.linear_transpose(
      lambda k: compaction.gather_kept(k, k, kept_list.positions_BKC)[0], k)
  np.testing.assert_array_equal(
      np.asarray(compaction.entries_to_keys(d_entries, kept_list.slots_BSK)),
      np.asarray(transpose(d_entries)[0]))


GPU_CASES = {
    "lte_bf16": (jnp.bfloat16, dict(batch=2, query_len=1000, key_len=1000, num_q_heads=8,
                                    num_kv_heads=2, head_dim=64, window_size=129, num_sinks=4)),
    "lte_f32": (jnp.float32, dict(batch=1, query_len=600, key_len=600, num_q_heads=4,
                                  num_kv_heads=2, head_dim=32, window_size=77, num_sinks=4)),
    "causal_bf16": (jnp.bfloat16, dict(batch=1, query_len=700, key_len=700, num_q_heads=4,
                                       num_kv_heads=1, head_dim=64, window_size=None,
                                       use_kept=False)),
    "swa_bf16": (jnp.bfloat16, dict(batch=1, query_len=900, key_len=900, num_q_heads=4,
                                    num_kv_heads=2, head_dim=128, window_size=256,
                                    use_kept=False)),
    "prefill_padded_bf16": (jnp.bfloat16, dict(batch=2, query_len=500, key_len=500,
                                               num_q_heads=4, num_kv_heads=2, head_dim=64,
                                               window_size=65, padded=True)),
}


GPU_CASES.update({
    # The split kept-list dk/dv (the default from 8K queries): 16 query tiles in chunks of 3.
    "lte_bf16_kept_split": (jnp.bfloat16, dict(
        batch=2, query_len=1000, key_len=1000, num_q_heads=8, num_kv_heads=2, head_dim=64,
        window_size=129, num_sinks=4, kept_split=3)),
})
# Forward-block candidates of tools/bench_attention.py --sweep, checked without gradients.
GPU_FORWARD_BLOCKS = (
    BlockSizes(block_k=128),
    BlockSizes(block_q=128, block_k=64, num_warps=8),
    BlockSizes(block_k=32, num_stages=4),
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_matches_reference(case):
  dtype, overrides = GPU_CASES[case]
  overrides = dict(overrides)
  if "kept_split" in overrides:
    blocks = _split_blocks(BlockSizes(), overrides.pop("kept_split"))
    fn = lambda q, k, v, **kw: attention_pallas.masked_attention(q, k, v, block_sizes=blocks,
                                                                 **kw)
  else:
    fn = lambda q, k, v, **kw: masked_attention(q, k, v, implementation="pallas", **kw)
  _check_against_reference(fn, dtype=dtype, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", GPU_FORWARD_BLOCKS, ids=str)
def test_gpu_inference_forward_matches_reference(blocks):
  q, k, v, _, kept, key_valid = _inputs(
      9, batch=2, query_len=700, key_len=900, num_q_heads=8, num_kv_heads=2, head_dim=64,
      dtype=jnp.bfloat16, padded=True)
  kwargs = dict(window_size=129, kept_BSK=kept, key_valid_BS=key_valid)
  actual = attention_pallas.masked_attention(q, k, v, block_sizes=blocks, **kwargs)
  as_f32 = lambda x: x.astype(jnp.float32)
  expected = reference.masked_attention(as_f32(q), as_f32(k), as_f32(v), **kwargs)
  assert_close(actual, expected, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("window_size,num_sinks", [(None, 0), (100, 0), (100, 2)])
def test_gpu_default_implementation_matches_reference(window_size, num_sinks):
  """implementation=None: cuDNN for plain causal in bf16, the Pallas kernels for windows."""
  fn = lambda q, k, v, **kw: masked_attention(q, k, v, **kw)
  _check_against_reference(fn, dtype=jnp.bfloat16, batch=1, query_len=300, key_len=300,
                           num_q_heads=4, num_kv_heads=2, head_dim=64, window_size=window_size,
                           num_sinks=num_sinks, use_kept=False)


def test_kept_split_uses_atomics_only_at_long_queries():
  assert BlockSizes().kept_split(4096) == 0
  assert BlockSizes().kept_split(8192) == 8
  assert BlockSizes(kept_split_from=1, kept_split_tiles=2).kept_split(64) == 2
  for bad in (dict(block_q=48), dict(num_warps=0), dict(num_stages=1.5)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      BlockSizes(**bad)
