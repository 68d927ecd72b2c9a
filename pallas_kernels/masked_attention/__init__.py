"""Masked softmax attention shared by full attention, SWA (with sinks) and LTE.

Public entry: `masked_attention`; `attention_mask` builds the boolean visibility mask that defines
it (see `reference` for the exact set definition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation, on_gpu, resolve
from pallas_kernels.masked_attention import pallas, reference
from pallas_kernels.masked_attention.reference import attention_mask

__all__ = ["masked_attention", "attention_mask"]


def _check_arguments(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS):
  for name, array in (("q_BTHD", q_BTHD), ("k_BSKD", k_BSKD), ("v_BSKD", v_BSKD)):
    if array.ndim != 4:
      raise ValueError(
          f"masked_attention: {name} must be 4-D [B, T, H, D], got shape {array.shape}")
  batch, query_len, num_q_heads, head_dim = q_BTHD.shape
  _, key_len, num_kv_heads, key_dim = k_BSKD.shape
  if k_BSKD.shape[0] != batch:
    raise ValueError(
        f"masked_attention: k_BSKD batch {k_BSKD.shape[0]} != q_BTHD batch {batch}")
  if v_BSKD.shape[:3] != k_BSKD.shape[:3]:
    raise ValueError(
        f"masked_attention: v_BSKD shape {v_BSKD.shape} must match k_BSKD {k_BSKD.shape} on"
        " [B, S, Hkv]")
  if key_dim != head_dim:
    raise ValueError(f"masked_attention: k_BSKD head dim {key_dim} != q_BTHD head dim {head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"masked_attention: query heads ({num_q_heads}, q_BTHD) must be a multiple of KV heads"
        f" ({num_kv_heads}, k_BSKD)")
  if query_len > key_len:
    raise ValueError(
        f"masked_attention: q_BTHD has T={query_len} queries but k_BSKD only S={key_len} keys;"
        " queries are the last T of the S positions, so T <= S")
  if window_size is not None and window_size <= 0:
    raise ValueError(f"masked_attention: window_size must be positive or None, got {window_size}")
  if num_sinks < 0:
    raise ValueError(f"masked_attention: num_sinks must be >= 0, got {num_sinks}")
  if kept_BSK is not None:
    if kept_BSK.shape != (batch, key_len, num_kv_heads):
      raise ValueError(
          f"masked_attention: kept_BSK must have shape [B, S, Hkv] ="
          f" {(batch, key_len, num_kv_heads)}, got {kept_BSK.shape}")
    if kept_BSK.dtype != bool:
      raise ValueError(f"masked_attention: kept_BSK must be bool, got {kept_BSK.dtype}")
  if key_valid_BS is not None:
    if key_valid_BS.shape != (batch, key_len):
      raise ValueError(
          f"masked_attention: key_valid_BS must have shape [B, S] = {(batch, key_len)}, got"
          f" {key_valid_BS.shape}")
    if key_valid_BS.dtype != bool:
      raise ValueError(f"masked_attention: key_valid_BS must be bool, got {key_valid_BS.dtype}")


def _under_multi_device_mesh() -> bool:
  """Whether the call is traced under a mesh of several devices (`jax.set_mesh`, shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


def _cudnn_handles(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS) -> bool:
  """Plain attention in bf16/f16 where cuDNN's fused kernel was measured faster than ours.

  One H100, B8 T4096 Hq32 Hkv8 D64 bf16, paired (2026-11-23, docs/benchmarks.md): plain causal
  fwd+bwd is ours 1.14x (B2 T16384: 1.35x) cuDNN, so causal goes to cuDNN; SWA-1024 fwd+bwd is
  ours 0.91-0.93x at 4K-16K, so windows at head dim 64 stay on the Pallas kernels (at head dim
  128, not measured, cuDNN keeps them). Sinks, kept keys, key padding and T < S are ours anyway.
  Not under a mesh of several devices: there the gdn_swa-0.4b FSDP step crashed with SIGSEGV in
  cuDNN's path on 2 x H200 (2026-11-23; docs/benchmarks.md, "Multi-GPU").
  """
  half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  head_dim = q_BTHD.shape[-1]
  plain_window = num_sinks == 0 and kept_BSK is None
  return (
      on_gpu()
      and not _under_multi_device_mesh()
      and jnp.dtype(q_BTHD.dtype) in half
      and q_BTHD.dtype == k_BSKD.dtype == v_BSKD.dtype
      and head_dim in (64, 128) and v_BSKD.shape[-1] == head_dim
      and q_BTHD.shape[1] == k_BSKD.shape[1]
      and key_valid_BS is None
      and (window_size is None or (head_dim == 128 and plain_window)))


def _cudnn_attention(q_BTHD, k_BSKD, v_BSKD, *, scale, window_size):
  return jax.nn.dot_product_attention(
      q_BTHD, k_BSKD, v_BSKD, scale=scale, is_causal=True, implementation="cudnn",
      local_window_size=None if window_size is None else (window_size - 1, 0))


# Jitted so that eager callers (tests, notebooks) compile once per shape, not once per op; under an
# outer jit this is free. Validation runs at trace time.
@functools.partial(jax.jit, static_argnames=("scale", "window_size", "num_sinks", "implementation"))
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
    implementation: Implementation = None,
) -> jax.Array:
  """Causal softmax attention with an optional window, sinks, kept keys and key padding.

  Args:
    q_BTHD: [B, T, Hq, D] queries, the last T of the S positions (T == S in training, T = 1 for a
      decode step against a full cache).
    k_BSKD, v_BSKD: [B, S, Hkv, D] keys (after RoPE) and [B, S, Hkv, Dv] values; Hq % Hkv == 0 and
      query head h reads KV head h // (Hq // Hkv).
    scale: score multiplier, default D**-0.5.
    window_size: number of most recent keys visible, the current one included (SWA-1024: keys
      p-1023..p; LTE passes w + 1 = 769). None: plain causal attention.
    num_sinks: keys 0..num_sinks-1 stay visible outside the window.
    kept_BSK: bool [B, S, Hkv]; kept keys stay visible outside the window (LTE's selected set),
      still only causally.
    key_valid_BS: bool [B, S]; False keys (left padding) are never visible.
    implementation: see `pallas_kernels.dispatch.resolve`: "xla" (dense reference) or "pallas"
      (tiled kernels that visit only the window tiles and the kept keys; the GPU default). With
      None on GPU, plain causal attention in bf16/f16 goes to cuDNN (measured faster, see
      `_cudnn_handles`) and inputs the Pallas version cannot handle (`pallas.check_supported`)
      use "xla".

  Returns:
    [B, T, Hq, Dv] in q's dtype; a query with no visible key gets zeros. Softmax statistics are
    float32 (float64 for float64 inputs).
  """
  _check_arguments(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS)
  if implementation is None and on_gpu():
    # The GPU default is chosen here rather than by `resolve`: cuDNN comes first where it applies.
    if _cudnn_handles(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS):
      return _cudnn_attention(q_BTHD, k_BSKD, v_BSKD, scale=scale, window_size=window_size)
    try:
      pallas.check_supported(q_BTHD, k_BSKD, v_BSKD, interpret=False)
      version = pallas.masked_attention
    except NotImplementedError:
      version = reference.masked_attention
  else:
    version = resolve("masked_attention", implementation,
                      {"xla": reference.masked_attention, "pallas": pallas.masked_attention})
  return version(
      q_BTHD, k_BSKD, v_BSKD, scale=scale, window_size=window_size, num_sinks=num_sinks,
      kept_BSK=kept_BSK, key_valid_BS=key_valid_BS)
