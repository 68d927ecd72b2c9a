"""The fused LTE decode cache step (§5.3 step 3) in Pallas (Triton backend), updating in place.

The XLA version rebuilds the whole OOW segment with a one-hot select (it reads and writes all
b entries of K and V per step). Here one program per (row, KV head) reads the OOW scores (b
floats), finds the minimum, and moves at most one K/V row into the set and one new K/V row into
the ring: the cache buffers are aliased to the outputs (input_output_aliases), so every other
slot is left untouched and the step costs O(b + D) bytes per (row, head) instead of O(b * D).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.pallas_common import interpret_mode, triton_compiler_params
from pallas_kernels.stacked import group_operand


def _evict_insert_kernel(group_ref, ptr_ref, past_len_ref, k_ref, v_ref, score_ref, new_k_ref,
                         new_v_ref, new_score_ref, k_out, v_out, score_out, past_len_out, *,
                         window_keys, cap, cap_pad):
  # The outputs alias the cache inputs: read the old contents through the inputs, write through
  # the outputs, and leave every other slot as it is. Index g is the layer group.
  row, kv_head = pl.program_id(0), pl.program_id(1)
  g = group_ref[0]
  head_dim, value_dim = k_ref.shape[-1], v_ref.shape[-1]
  ptr = ptr_ref[0]
  past_len = past_len_ref[g, row, kv_head]
  leaving_score = score_ref[g, row, ptr, kv_head]

  entry_C = jnp.arange(cap_pad)
  valid_C = entry_C < jnp.minimum(past_len, cap)
  # A traced start: the padded range may pass the array's end (masked), which JAX's static slice
  # check would reject.
  oow_start = jnp.asarray(window_keys, jnp.int32)
  oow_score_C = plgpu.load(score_ref.at[g, row, pl.ds(oow_start, cap_pad), kv_head],
                           mask=valid_C, other=jnp.inf)
  oow_score_C = jnp.where(valid_C, oow_score_C, jnp.inf)
  min_score = jnp.min(oow_score_C)
  # First index of the minimum (jnp.argmin's choice), so both versions pick the same entry.
  min_index = jnp.min(jnp.where(oow_score_C == min_score, entry_C, cap_pad))

  has_room = past_len < cap
  write = (leaving_score > 0) & (has_room | (min_score < leaving_score))
  target = window_keys + jnp.where(has_room, past_len, min_index)

  leaving_k_D = k_ref[g, row, ptr, kv_head, :]
  leaving_v_V = v_ref[g, row, ptr, kv_head, :]
  plgpu.store(k_out.at[g, row, target, kv_head, :], leaving_k_D,
              mask=jnp.broadcast_to(write, (head_dim,)))
  plgpu.store(v_out.at[g, row, target, kv_head, :], leaving_v_V,
              mask=jnp.broadcast_to(write, (value_dim,)))
  plgpu.store(score_out.at[g, row, target, kv_head], leaving_score, mask=write)
  past_len_out[g, row, kv_head] = past_len + (write & has_room).astype(jnp.int32)

  # The new token takes the leaving token's ring slot (read above, so the order is safe).
  k_out[g, row, ptr, kv_head, :] = new_k_ref[row, kv_head, :].astype(k_out.dtype)
  v_out[g, row, ptr, kv_head, :] = new_v_ref[row, kv_head, :].astype(v_out.dtype)
  score_out[g, row, ptr, kv_head] = new_score_ref[row, kv_head].astype(score_out.dtype)


def _check_supported(k_BSKD, v_BSKD):
  for name, dim in (("head dim", k_BSKD.shape[-1]), ("value dim", v_BSKD.shape[-1])):
    if dim & (dim - 1):
      raise NotImplementedError(
          f"evict_and_insert[pallas]: {name} {dim} must be a power of two (Triton block shapes)")


@functools.partial(jax.jit, static_argnames=("window_keys",))
def evict_and_insert(k_GBSKD, v_GBSKD, score_GBSK, past_len_GBK, ptr, new_k_BKD, new_v_BKD,
                     new_score_BK, group, *, window_keys: int):
  """Same contract as `reference.evict_and_insert`; the stacked cache buffers are updated in place
  (XLA copies them first only when the caller still needs the old ones)."""
  _check_supported(k_GBSKD, v_GBSKD)
  batch, slots, num_kv_heads = k_GBSKD.shape[1:4]
  cap = slots - window_keys
  kernel = functools.partial(_evict_insert_kernel, window_keys=window_keys, cap=cap,
                             cap_pad=pl.next_power_of_2(max(cap, 1)))
  ptr_1 = jnp.reshape(ptr, (1,)).astype(jnp.int32)
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct(k_GBSKD.shape, k_GBSKD.dtype),
                 jax.ShapeDtypeStruct(v_GBSKD.shape, v_GBSKD.dtype),
                 jax.ShapeDtypeStruct(score_GBSK.shape, score_GBSK.dtype),
                 jax.ShapeDtypeStruct(past_len_GBK.shape, jnp.int32)),
      grid=(batch, num_kv_heads),
      input_output_aliases={3: 0, 4: 1, 5: 2, 2: 3},
      compiler_params=triton_compiler_params(num_warps=1, num_stages=1),
      interpret=interpret_mode(),
      name="lte_evict_and_insert",
  )(group_operand(group), ptr_1, past_len_GBK.astype(jnp.int32), k_GBSKD, v_GBSKD, score_GBSK,
    new_k_BKD, new_v_BKD, new_score_BK)
