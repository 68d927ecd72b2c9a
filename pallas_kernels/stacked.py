"""Operands stacked over layer groups, read and written in place by the decode ops.

A model's decode cache keeps one array per cache leaf for all its layer groups, `[G, ...]`, and
the decode step scans over the groups with that array in its carry. The decode ops (decode
attention, NSA decoding, the LTE cache step, the recurrent gated delta rule) therefore take the
stacked array and a group index `group` and touch only group `group`'s part; a plain (unstacked)
operand is a stack of one (`as_stacked`), so each version of an op has one code path.

Pallas kernels read the group index from an int32 [1] operand and index the stacked refs
themselves. The XLA versions read a group's cache in blocks of slots inside a loop (`slot_blocks`,
`read_slot_block`): read whole, XLA would materialise the group's slice as a new buffer (XLA:CPU
fuses a dynamic-slice into neither a dot nor a reduction), i.e. copy the cache every step.
`streamed_attention` and `streamed_scores` are the two reads the decode ops need;
`update_group_rows` steps a group's recurrent state one batch row at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention.reference import HIGHEST, compute_dtype
from pallas_kernels.pallas_common import cdiv

__all__ = ["as_stacked", "group_operand", "per_group", "read_slot_block", "slot_blocks",
           "streamed_attention", "streamed_scores", "update_group_rows"]

# Slots per block of the XLA reads: the most a step materialises of one cache leaf.
MAX_BLOCK_SLOTS = 512
# Running maximum before any visible slot: finite, so exp(m_old - m_new) stays 1 instead of NaN.
EMPTY_MAX = -1e30


def per_group(op_name: str, name: str, x, group, ndim: int):
  """The shape and dtype of one group's part of operand `name` (x itself when group is None), for
  an op's argument checks; `ndim` is the rank of one group's part. Raises ValueError for a group
  index that is not an integer scalar or an operand that is not stacked."""
  if group is None:
    return x
  if jnp.shape(group) != () or not jnp.issubdtype(jnp.result_type(group), jnp.integer):
    raise ValueError(f"{op_name}: group must be an integer scalar, got {jnp.result_type(group)}"
                     f" {jnp.shape(group)}")
  if x.ndim != ndim + 1:
    raise ValueError(f"{op_name}: with a group index, {name} must be stacked over the layer groups"
                     f" ({ndim + 1}-D [G, ...]), got shape {x.shape}")
  return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)


def as_stacked(x: jax.Array, group) -> tuple[jax.Array, jax.Array]:
  """(x stacked over groups, the group index as int32 []): a plain operand (group None) is a stack
  of one, so every version of an op reads stacked operands."""
  if group is None:
    return x[None], jnp.zeros((), jnp.int32)
  return x, jnp.asarray(group, jnp.int32).reshape(())


def group_operand(group: jax.Array) -> jax.Array:
  """The group index as the int32 [1] operand that the Pallas kernels read."""
  return jnp.reshape(group, (1,)).astype(jnp.int32)


def slot_blocks(num_slots: int) -> tuple[int, int]:
  """(slots per block, blocks) of an XLA read over `num_slots` slots: at most MAX_BLOCK_SLOTS, and
  at least two blocks (a power of two >= half the slots), so that even a small cache is never read
  as a whole. The last block is shifted back to end at the last slot (`read_slot_block`)."""
  block = min(MAX_BLOCK_SLOTS, num_slots, 1 << max(cdiv(num_slots, 2) - 1, 0).bit_length())
  return block, cdiv(num_slots, block)


def read_slot_block(stacked: jax.Array, group: jax.Array, index: jax.Array, block: int
                    ) -> tuple[jax.Array, jax.Array]:
  """Block `index` of group `group`'s slots (axis 2 of [G, B, N, ...]): (x[group, :, start:start +
  block], start). The last block starts at N - block so that it stays inside; its slots before
  index * block belong to the previous block, and the caller must not count them twice."""
  num_slots = stacked.shape[2]
  start = jnp.minimum(index * block, num_slots - block).astype(jnp.int32)
  starts = (group, jnp.zeros((), jnp.int32), start) + (jnp.zeros((), jnp.int32),) * (
      stacked.ndim - 3)
  part = jax.lax.dynamic_slice(stacked, starts, (1, stacked.shape[1], block, *stacked.shape[3:]))
  return part[0], start


def _block_visible(index, start, block: int, length_BK, key_valid) -> jax.Array:
  """bool [B or 1, Hkv or 1, block]: the block's slots that are visible (slot < length_BK[b, h]
  and key_valid[b, (h,) slot]) and not covered by an earlier block."""
  slot_N = start + jnp.arange(block)
  visible_BKN = (slot_N >= index * block)[None, None, :]
  if length_BK is not None:
    visible_BKN = visible_BKN & (slot_N[None, None, :] < length_BK[:, :, None])
  if key_valid is not None:
    valid = jax.lax.dynamic_slice_in_dim(key_valid, start, block, axis=key_valid.ndim - 1)
    visible_BKN = visible_BKN & (valid[:, None, :] if valid.ndim == 2 else valid)
  return visible_BKN


def streamed_attention(q_BHD: jax.Array, k_GBNKD: jax.Array, v_GBNKD: jax.Array, group: jax.Array,
                       *, scale: float, length_BK: jax.Array | None = None,
                       key_valid: jax.Array | None = None) -> jax.Array:
  """Softmax attention of one query per (row, query head) over group `group`'s visible slots,
  computed block by block with an online softmax: [B, Hq, Dv] in the compute dtype (float32, or
  float64 for float64 inputs), zeros for a query that sees no slot.

  Slot n of KV head h in row b is visible iff n < length_BK[b, h] and key_valid[b, (h,) n]
  (`decode_attention`'s rule; each only when given). Query head i reads KV head i // (Hq // Hkv).
  Invisible slots may hold anything (NaN included).
  """
  batch, num_q_heads, head_dim = q_BHD.shape
  num_slots, num_kv_heads, value_dim = k_GBNKD.shape[2], k_GBNKD.shape[3], v_GBNKD.shape[-1]
  group_size = num_q_heads // num_kv_heads
  dtype = compute_dtype(q_BHD.dtype)
  q_BKGD = q_BHD.astype(dtype).reshape(batch, num_kv_heads, group_size, head_dim)
  block, count = slot_blocks(num_slots)

  def step(index, carry):
    max_BKG, sum_BKG, acc_BKGV = carry
    k_BNKD, start = read_slot_block(k_GBNKD, group, index, block)
    v_BNKD, _ = read_slot_block(v_GBNKD, group, index, block)
    visible_BKN = _block_visible(index, start, block, length_BK, key_valid)
    scores_BKGN = scale * jnp.einsum("bkgd,bnkd->bkgn", q_BKGD, k_BNKD.astype(dtype),
                                     precision=HIGHEST)
    scores_BKGN = jnp.where(visible_BKN[:, :, None], scores_BKGN, -jnp.inf)
    new_max_BKG = jnp.maximum(max_BKG, jnp.max(scores_BKGN, axis=-1))
    probs_BKGN = jnp.exp(scores_BKGN - new_max_BKG[..., None])
    rescale_BKG = jnp.exp(max_BKG - new_max_BKG)
    # Invisible values are zeroed so that a NaN there cannot reach the output through 0 * NaN.
    values_BNKV = jnp.where(jnp.swapaxes(visible_BKN, 1, 2)[..., None], v_BNKD.astype(dtype), 0)
    acc_BKGV = acc_BKGV * rescale_BKG[..., None] + jnp.einsum(
        "bkgn,bnkv->bkgv", probs_BKGN, values_BNKV, precision=HIGHEST)
    return new_max_BKG, sum_BKG * rescale_BKG + jnp.sum(probs_BKGN, axis=-1), acc_BKGV

  shape_BKG = (batch, num_kv_heads, group_size)
  init = (jnp.full(shape_BKG, EMPTY_MAX, dtype), jnp.zeros(shape_BKG, dtype),
          jnp.zeros((*shape_BKG, value_dim), dtype))
  _, sum_BKG, acc_BKGV = jax.lax.fori_loop(0, count, step, init)
  out_BKGV = acc_BKGV / jnp.where(sum_BKG > 0, sum_BKG, 1)[..., None]
  return out_BKGV.reshape(batch, num_q_heads, value_dim)


def streamed_scores(q_BHD: jax.Array, k_GBNKD: jax.Array, group: jax.Array, *, scale: float
                    ) -> jax.Array:
  """The scaled scores q . k of one query per (row, query head) over every slot of group `group`,
  read block by block: [B, Hq, N] in the compute dtype."""
  batch, num_q_heads, head_dim = q_BHD.shape
  num_slots, num_kv_heads = k_GBNKD.shape[2], k_GBNKD.shape[3]
  group_size = num_q_heads // num_kv_heads
  dtype = compute_dtype(q_BHD.dtype)
  q_BKGD = q_BHD.astype(dtype).reshape(batch, num_kv_heads, group_size, head_dim)
  block, count = slot_blocks(num_slots)

  def step(index, scores_BKGN):
    k_BNKD, start = read_slot_block(k_GBNKD, group, index, block)
    part_BKGN = scale * jnp.einsum("bkgd,bnkd->bkgn", q_BKGD, k_BNKD.astype(dtype),
                                   precision=HIGHEST)
    # An overlapping last block writes the same scores again.
    return jax.lax.dynamic_update_slice_in_dim(scores_BKGN, part_BKGN, start, axis=3)

  scores_BKGN = jax.lax.fori_loop(
      0, count, step, jnp.zeros((batch, num_kv_heads, group_size, num_slots), dtype))
  return scores_BKGN.reshape(batch, num_q_heads, num_slots)


def update_group_rows(state_GB_: jax.Array, group: jax.Array, update_fn: Callable,
                      update_inputs: tuple, output_fn: Callable, output_inputs: tuple
                      ) -> tuple[jax.Array, jax.Array]:
  """Steps every batch row of group `group` of a state stacked over groups, [G, B, ...], one row
  at a time: the row's new state `update_fn(row, *update_inputs[b])` is written in place, then
  `output_fn(new row, *output_inputs[b])` reads it back from the written buffer.

  The output must not be computed from the old row alongside the write: XLA would fuse the update
  into that read as well, and a read of the old row that the write does not depend on makes it
  copy the whole stacked state. Inputs carry a leading batch axis. Returns (the outputs stacked
  over the rows, the stacked state).
  """
  batch = state_GB_.shape[1]
  zero = jnp.zeros((), jnp.int32)
  row_shape = (1, 1, *state_GB_.shape[2:])
  row_of = lambda inputs, row: [jax.lax.dynamic_index_in_dim(x, row, keepdims=False)
                                for x in inputs]

  def one_row(row, carry):
    state, out = carry
    start = (group, row.astype(jnp.int32)) + (zero,) * (state.ndim - 2)
    new_row = update_fn(jax.lax.dynamic_slice(state, start, row_shape)[0, 0],
                        *row_of(update_inputs, row))
    state = jax.lax.dynamic_update_slice(state, new_row.astype(state.dtype)[None, None], start)
    out_row = output_fn(jax.lax.dynamic_slice(state, start, row_shape)[0, 0],
                        *row_of(output_inputs, row))
    return state, jax.lax.dynamic_update_index_in_dim(out, out_row, row, 0)

  out_row = jax.eval_shape(output_fn, jax.ShapeDtypeStruct(state_GB_.shape[2:], state_GB_.dtype),
                           *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in output_inputs))
  out = jnp.zeros((batch, *out_row.shape), out_row.dtype)
  state_GB_, out = jax.lax.fori_loop(0, batch, one_row, (state_GB_, out))
  return out, state_GB_
