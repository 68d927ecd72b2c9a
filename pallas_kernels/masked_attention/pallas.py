"""Masked attention in Pallas (Triton backend): one kernel family for full causal attention, SWA,
sinks, LTE training (window + kept keys) and LTE prefill (window + kept keys + left padding).

XLA pads T and S to the tile sizes and builds the sorted kept list (sinks + kept keys); the
kernels (pallas_forward, pallas_backward) visit the window tiles plus only the list entries that
are outside each query's window. Gradients wrt q, k, v come from a custom VJP (dq kernel, dk/dv
window and kept-list kernels); the kept list's dk/dv reach k/v through the inverse of the
gather of its K/V (`compaction.entries_to_keys`). A call that is not differentiated (prefill) runs
the forward without its logsumexp output and reads the kept K/V by position; a differentiated
one gathers K/V copies for its kernels (see `Problem.gather_kept_in_kernel`).
On CPU the kernels run in Pallas interpret mode (for tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention import compaction
from pallas_kernels.masked_attention.pallas_backward import (
    backward_dkdv_kept, backward_dkdv_window)
from pallas_kernels.masked_attention.pallas_forward import backward_dq, forward
from pallas_kernels.masked_attention.tiling import BlockSizes, Problem
from pallas_kernels.pallas_common import (
    interpret_mode, is_power_of_two, round_up, save_kernel_outputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention_core(problem, blocks, q, k, v, key_valid, kept, counts_fwd, counts_dq,
                    counts_dkv):
  # Not differentiated (prefill, evaluation): the forward that writes no logsumexp, reading the
  # kept list's keys/values from k/v by position (no copies; measured 3-5% faster at B8 T4096 to
  # B2 T16384 than gathered copies on an H100, 2026-11-22).
  problem = dataclasses.replace(problem, gather_kept_in_kernel=True)
  o, _ = forward(problem, blocks, q, k, v, key_valid, kept, counts_fwd, with_lse=False)
  return o


def _attention_core_fwd(problem, blocks, q, k, v, key_valid, kept, counts_fwd, counts_dq,
                        counts_dkv):
  if kept is not None:  # the K/V copies that forward, dq and the kept dk/dv kernels read
    kept = kept._replace(**dict(zip(("k_BCKD", "v_BCKD"),
                                    compaction.gather_kept(k, v, kept.positions_BKC))))
  o, lse = save_kernel_outputs(*forward(problem, blocks, q, k, v, key_valid, kept, counts_fwd))
  return o, (q, k, v, key_valid, kept, counts_fwd, counts_dq, counts_dkv, o, lse)


def _attention_core_bwd(problem, blocks, residuals, do):
  q, k, v, key_valid, kept, counts_fwd, counts_dq, counts_dkv, o, lse = residuals
  do = do.astype(q.dtype)
  dq, delta = backward_dq(problem, blocks, q, k, v, do, o, lse, key_valid, kept, counts_dq)
  # Without a kept list the window kernel's dk/dv are final: written in k's dtype (no float32
  # round trip and conversion in XLA, 65 us of a B2 T16384 SWA fwd+bwd, 2026-11-23).
  dk, dv = backward_dkdv_window(problem, blocks, q, k, v, do, lse, delta, key_valid,
                                out_dtype=jnp.float32 if kept is not None else k.dtype)
  if kept is not None:
    # The kept dk/dv kernel reads the entries' k/v copies; their gradients go back to the keys
    # by the inverse of the gather that made them.
    dk_kept, dv_kept = backward_dkdv_kept(problem, blocks, q, do, lse, delta, kept,
                                          counts_dkv)
    dk = dk + compaction.entries_to_keys(dk_kept, kept.slots_BSK)
    dv = dv + compaction.entries_to_keys(dv_kept, kept.slots_BSK)
  return (dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def check_supported(q_BTHD, k_BSKD, v_BSKD, *, interpret: bool) -> None:
  """Raises NotImplementedError for inputs this version cannot handle (callers may fall back)."""
  head_dim = q_BTHD.shape[-1]
  if v_BSKD.shape[-1] != head_dim:
    raise NotImplementedError(
        f"masked_attention[pallas]: value head dim {v_BSKD.shape[-1]} != key head dim {head_dim}")
  if head_dim < 16 or not is_power_of_two(head_dim):
    raise NotImplementedError(
        f"masked_attention[pallas]: head dim {head_dim} must be a power of two >= 16 (Triton)")
  if not interpret and jnp.dtype(q_BTHD.dtype) not in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise NotImplementedError(f"masked_attention[pallas]: dtype {q_BTHD.dtype} on GPU")
  if not (q_BTHD.dtype == k_BSKD.dtype == v_BSKD.dtype):
    raise NotImplementedError(
        f"masked_attention[pallas]: q/k/v dtypes differ ({q_BTHD.dtype}, {k_BSKD.dtype},"
        f" {v_BSKD.dtype})")


def masked_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    scale: float | None = None,
    window_size: int | None = None,
    num_sinks: int = 0,
    kept_BSK: jax.Array | None = None,
    key_valid_BS: jax.Array | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> jax.Array:
  """Same contract as `reference.masked_attention`; differentiable wrt q, k, v.

  interpret: None -> Pallas interpret mode unless the default backend is a GPU.
  """
  if interpret is None:
    interpret = interpret_mode()
  check_supported(q_BTHD, k_BSKD, v_BSKD, interpret=interpret)
  batch, query_len, num_q_heads, head_dim = q_BTHD.shape
  key_len, num_kv_heads = k_BSKD.shape[1], k_BSKD.shape[2]
  if scale is None:
    scale = head_dim**-0.5
  if window_size is not None and window_size >= key_len and not num_sinks and kept_BSK is None:
    window_size = None  # the window covers every key: plain causal attention
  has_kept_list = window_size is not None and (num_sinks > 0 or kept_BSK is not None)
  padded_query_len = round_up(query_len, block_sizes.query_multiple)
  padded_key_len = round_up(key_len, block_sizes.key_multiple)
  problem = Problem(
      query_len=query_len, key_len=key_len, padded_query_len=padded_query_len,
      padded_key_len=padded_key_len, head_dim=head_dim, num_q_heads=num_q_heads,
      num_kv_heads=num_kv_heads, window_size=window_size, has_kept_list=has_kept_list,
      has_key_valid=key_valid_BS is not None, scale=float(scale), interpret=interpret)

  # Padding rows/keys are zeros: padded keys are masked by position, and padded query rows get a
  # zero output gradient, so they add nothing to dk/dv.
  q = jnp.pad(q_BTHD, ((0, 0), (0, padded_query_len - query_len), (0, 0), (0, 0)))
  key_pad = ((0, 0), (0, padded_key_len - key_len), (0, 0), (0, 0))
  k, v = jnp.pad(k_BSKD, key_pad), jnp.pad(v_BSKD, key_pad)
  key_valid = None
  if key_valid_BS is not None:
    key_valid = jnp.pad(key_valid_BS.astype(jnp.int32), ((0, 0), (0, padded_key_len - key_len)))
  kept = counts_fwd = counts_dq = counts_dkv = None
  if has_kept_list:
    listed_BKS = compaction.listed_keys(
        batch=batch, key_len=key_len, num_kv_heads=num_kv_heads, num_sinks=num_sinks,
        kept_BSK=kept_BSK, key_valid_BS=key_valid_BS)
    # Positions and slots only: the K/V copies, where the kernels use them, are gathered in the
    # differentiated forward (_attention_core_fwd); the slots serve its backward (XLA drops them
    # where nothing is differentiated).
    kept, (counts_fwd, counts_dq, counts_dkv) = compaction.kept_list_and_counts(
        listed_BKS, capacity=padded_key_len,
        block_qs=(block_sizes.block_q, block_sizes.block_q_dq, block_sizes.block_q_dkv),
        padded_query_len=padded_query_len, query_offset=key_len - query_len,
        window_size=window_size, with_slots=True)
  o = _attention_core(problem, block_sizes, q, k, v, key_valid, kept, counts_fwd, counts_dq,
                      counts_dkv)
  return o[:, :query_len]
