"""decode_attention: the dense reference and the blocked "xla" version against a per-query loop
over the visible slots, and the Pallas split-K kernel (interpret mode on CPU, compiled on GPU)
against "xla"; decode_attention_weights against the same loop; one layer group of a stacked
cache read in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import (DecodeBlockSizes, decode_attention,
                                             decode_attention_weights, reference)
from tests.kernel_testing import GROUP, assert_close, float64, stacked_in_poison


def _inputs(seed, *, batch=2, num_slots=45, num_q_heads=4, num_kv_heads=2, head_dim=16,
            per_head_mask=False):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, num_q_heads, head_dim))
  k = rng.standard_normal((batch, num_slots, num_kv_heads, head_dim))
  v = rng.standard_normal((batch, num_slots, num_kv_heads, head_dim))
  length = rng.integers(num_slots // 2, num_slots + 1, (batch, num_kv_heads)).astype(np.int32)
  length[-1, 0] = 0  # a (row, head) that sees nothing: zeros
  mask_shape = (batch, num_kv_heads, num_slots) if per_head_mask else (batch, num_slots)
  valid = rng.random(mask_shape) < 0.7
  return q, k, v, length, valid


def _visible(length, valid, num_slots):
  visible = np.arange(num_slots)[None, None, :] < length[:, :, None]
  return visible & (valid[:, None, :] if valid.ndim == 2 else valid)


def _brute_force(q, k, v, length, valid, scale):
  batch, num_q_heads, _ = q.shape
  num_slots, num_kv_heads = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  visible = _visible(length, valid, num_slots)
  out = np.zeros(q.shape[:2] + v.shape[-1:])
  for b in range(batch):
    for h in range(num_q_heads):
      slots = np.flatnonzero(visible[b, h // group])
      if slots.size == 0:
        continue
      scores = scale * k[b, slots, h // group] @ q[b, h]
      weights = np.exp(scores - scores.max())
      out[b, h] = weights @ v[b, slots, h // group] / weights.sum()
  return out


def _poison_invisible(k, v, length, valid):
  """NaN in every slot no query may read: a kernel that reads one fails the finiteness check."""
  hidden = ~_visible(length, valid, k.shape[1])  # [B, K, N]
  hidden_BNK = np.transpose(hidden, (0, 2, 1))[..., None]
  return np.where(hidden_BNK, np.nan, k), np.where(hidden_BNK, np.nan, v)


@pytest.mark.parametrize("version", ["reference", "xla"])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_reference_and_xla_match_brute_force(per_head_mask, version):
  """The dense reference, and the "xla" version that reads the slots in blocks (45 slots: blocks
  of 32, the last one shifted back to overlap the first)."""
  q, k, v, length, valid = _inputs(0, per_head_mask=per_head_mask)
  with float64():
    q, k, v, length, valid = (jnp.asarray(x) for x in (q, k, v, length, valid))
    if version == "reference":
      out = reference.decode_attention(q, k[None], v[None], jnp.int32(0), scale=0.3,
                                       length_BK=length, key_valid=valid)
    else:
      out = decode_attention(q, k, v, scale=0.3, length_BK=length, key_valid=valid,
                             implementation="xla")
    np.testing.assert_allclose(np.asarray(out), _brute_force(*(np.asarray(x) for x in (
        q, k, v, length, valid)), 0.3), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("version", ["reference", "xla"])
@pytest.mark.parametrize("per_head_mask", [False, True])
def test_weights_are_the_softmax_over_the_visible_slots(per_head_mask, version):
  q, k, _, length, valid = _inputs(1, per_head_mask=per_head_mask)
  group = q.shape[1] // k.shape[2]
  visible = _visible(length, valid, k.shape[1])
  with float64():
    args = (jnp.asarray(q), jnp.asarray(k))
    masks = dict(scale=0.3, length_BK=jnp.asarray(length), key_valid=jnp.asarray(valid))
    if version == "reference":
      weights = reference.decode_attention_weights(args[0], args[1][None], jnp.int32(0), **masks)
    else:
      weights = decode_attention_weights(*args, **masks)
    weights = np.asarray(weights)
  assert weights.shape == (q.shape[0], q.shape[1], k.shape[1])
  for b in range(q.shape[0]):
    for h in range(q.shape[1]):
      slots = visible[b, h // group]
      expected = np.zeros(k.shape[1])
      if slots.any():
        scores = 0.3 * k[b, slots, h // group] @ q[b, h]
        expected[slots] = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
      np.testing.assert_allclose(weights[b, h], expected, rtol=1e-10, atol=1e-12)
  with pytest.raises(NotImplementedError, match="decode_attention_weights"):
    decode_attention_weights(jnp.asarray(q), jnp.asarray(k), implementation="pallas")


def _check_pallas(seed, dtype, block_sizes, **shape):
  q, k, v, length, valid = _inputs(seed, **shape)
  cast = lambda x: jnp.asarray(x, dtype)
  # The float64 reference sees the same `dtype`-rounded inputs as the kernel.
  rounded = [np.asarray(cast(x)).astype(np.float64) for x in (q, k, v)]
  with float64():
    expected = np.asarray(decode_attention(
        *(jnp.asarray(x) for x in rounded), length_BK=jnp.asarray(length),
        key_valid=jnp.asarray(valid), implementation="xla"))
  k_poisoned, v_poisoned = _poison_invisible(k, v, length, valid)
  out = decode_attention(cast(q), cast(k_poisoned), cast(v_poisoned), length_BK=jnp.asarray(length),
                         key_valid=jnp.asarray(valid), implementation="pallas",
                         block_sizes=block_sizes)
  assert out.dtype == dtype and out.shape == q.shape
  assert_close(out, expected, dtype)
  empty_heads = out[-1, :q.shape[1] // k.shape[2]]  # KV head 0 of the last row has length 0
  assert np.all(np.asarray(empty_heads, np.float32) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_pallas_matches_reference(dtype, num_splits):
  # 45 slots: neither a multiple of the 16-slot block nor of the split.
  _check_pallas(1, dtype, DecodeBlockSizes(block_slots=16, num_splits=num_splits))


@pytest.mark.parametrize("num_q_heads,num_kv_heads,per_head_mask", [(2, 2, True), (8, 1, False)])
def test_pallas_gqa_groups_and_per_head_masks(num_q_heads, num_kv_heads, per_head_mask):
  _check_pallas(2, jnp.float32, DecodeBlockSizes(block_slots=16, num_splits=None),
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, per_head_mask=per_head_mask,
                num_slots=37)


@pytest.mark.parametrize("kv_heads_per_program,num_splits,per_head_mask",
                         [(2, 2, False), (4, 1, True), (3, None, False)])
def test_pallas_several_kv_heads_per_program(kv_heads_per_program, num_splits, per_head_mask):
  # 4 KV heads: 3 per program is reduced to 2 (a divisor of Hkv).
  _check_pallas(6, jnp.float32, DecodeBlockSizes(block_slots=16, num_splits=num_splits,
                                                 kv_heads_per_program=kv_heads_per_program),
                num_q_heads=8, num_kv_heads=4, per_head_mask=per_head_mask, num_slots=37)


def test_pallas_without_lengths_or_mask_reads_every_slot():
  q, k, v, _, _ = _inputs(3)
  args = (jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  expected = decode_attention(*args, implementation="xla")
  out = decode_attention(*args, implementation="pallas",
                         block_sizes=DecodeBlockSizes(block_slots=32, num_splits=1))
  assert_close(out, expected, jnp.float32)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_a_layer_group_of_a_stacked_cache_is_read_in_place(implementation):
  """`group=`: the group's slots of a cache stacked over layer groups (the others NaN) give the
  plain cache's output, and the weights too."""
  q, k, v, length, valid = (jnp.asarray(x) for x in _inputs(5, num_slots=45))
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  sizes = DecodeBlockSizes(block_slots=16, num_splits=2)
  expected = decode_attention(q, k, v, length_BK=length, key_valid=valid, implementation="xla")
  out = decode_attention(q, stacked_in_poison(k), stacked_in_poison(v), length_BK=length,
                         key_valid=valid, group=jnp.int32(GROUP), implementation=implementation,
                         block_sizes=sizes)
  assert_close(out, expected, jnp.float32)
  weights = decode_attention_weights(q, stacked_in_poison(k), length_BK=length, key_valid=valid,
                                     group=jnp.int32(GROUP))
  assert_close(weights, decode_attention_weights(q, k, length_BK=length, key_valid=valid),
               jnp.float32)


def test_arguments_are_checked():
  q, k, v, length, valid = (jnp.asarray(x) for x in _inputs(4))
  with pytest.raises(ValueError, match="length_BK"):
    decode_attention(q, k, v, length_BK=length[:, :1])
  with pytest.raises(ValueError, match="key_valid"):
    decode_attention(q, k, v, key_valid=valid.astype(jnp.int32))
  with pytest.raises(ValueError, match="multiple of KV"):
    decode_attention(q[:, :3], k, v)
  with pytest.raises(NotImplementedError, match="power of two"):
    decode_attention(q[..., :12], k[..., :12], v[..., :12], implementation="pallas")
  with pytest.raises(ValueError, match="stacked over the layer groups"):
    decode_attention(q, k, v, group=jnp.int32(0))
  with pytest.raises(ValueError, match="group must be an integer scalar"):
    decode_attention(q, k[None], v[None], group=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="block_slots"):
    DecodeBlockSizes(block_slots=24)
  with pytest.raises(ValueError, match="kv_heads_per_program"):
    DecodeBlockSizes(kv_heads_per_program=0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_sizes", [
    DecodeBlockSizes(), DecodeBlockSizes(block_slots=32, kv_heads_per_program=8, num_stages=2)])
def test_compiled_kernel_at_model_shapes(num_q_heads, num_kv_heads, dtype, block_sizes):
  # The LTE cache of the 1.4b / 0.4b presets: 769 ring + 512 compacted slots, D 64.
  _check_pallas(5, dtype, block_sizes, batch=4, num_slots=1281, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=64)


def test_block_slots_follow_whether_the_grid_fits_at_two_programs_per_core():
  sizes = DecodeBlockSizes()
  # B32: lalte-1.4b (Hkv 8, 256 programs) fits on 132 cores at 2 per core, lalte-0.4b (512) not.
  assert sizes.slots_and_splits(32, 8, 1281, num_cores=132) == (128, 1)
  assert sizes.slots_and_splits(32, 16, 1281, num_cores=132) == (64, 1)
  # One sequence: the slots split to reach target_programs (at most one block per split).
  assert sizes.slots_and_splits(1, 8, 1281, num_cores=132) == (128, 11)
  assert sizes.slots_and_splits(1, 8, 1281, num_cores=4) == (64, 21)
  explicit = DecodeBlockSizes(block_slots=32, num_splits=3)
  assert explicit.slots_and_splits(32, 16, 1281, num_cores=132) == (32, 3)
  with pytest.raises(ValueError, match="block_slots"):
    DecodeBlockSizes(block_slots=48)
