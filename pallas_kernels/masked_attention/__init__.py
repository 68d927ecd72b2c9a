"""Masked softmax attention shared by full attention, SWA (with sinks) and LTE.

Public entry: `masked_attention`; `attention_mask` builds the boolean visibility mask that defines
it (see `reference` for the exact set definition).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.attention_checks import check_mask, check_positive_int, check_qkv
from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.masked_attention import cudnn, pallas, reference
from pallas_kernels.masked_attention.reference import attention_mask

__all__ = ["masked_attention", "attention_mask", "gpu_default"]


def _check_arguments(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS):
  op = "masked_attention"
  check_qkv(op, q_BTHD, k_BSKD, v_BSKD, names=("q_BTHD", "k_BSKD", "v_BSKD"))
  batch, key_len, num_kv_heads = k_BSKD.shape[:3]
  check_positive_int(op, "window_size", window_size, optional=True)
  if num_sinks < 0:
    raise ValueError(f"{op}: num_sinks must be >= 0, got {num_sinks}")
  check_mask(op, "kept_BSK", kept_BSK, {"[B, S, Hkv]": (batch, key_len, num_kv_heads)})
  check_mask(op, "key_valid_BS", key_valid_BS, {"[B, S]": (batch, key_len)})


def _under_multi_device_mesh() -> bool:
  """Whether the call is traced under a mesh of several devices (`jax.set_mesh`, shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1


def gpu_default(q_BTHD, *, window_size) -> tuple[str, ...]:
  """What implementation=None tries on a GPU, fastest first (a version that cannot compute the
  inputs passes them on: cuDNN takes only plain causal/window attention in bf16/f16 at head dim
  64 or 128 without key padding, Pallas only power-of-two head dims; "xla" takes anything).

    plain causal                       -> cudnn  (ours fwd+bwd 1.14x cuDNN at B8 T4096,
                                                  1.35x at B2 T16384)
    plain window, head dim 128         -> cudnn  (not measured at 128)
    plain window, other head dims      -> pallas (SWA-1024 fwd+bwd 0.91-0.93x cuDNN at 4K-16K)
    sinks, kept keys, key padding, T<S -> pallas (cuDNN has no such masks)
    any call under a multi-device mesh -> pallas (cuDNN's path crashed the gdn_swa-0.4b FSDP step
                                                  with SIGSEGV on 2 x H200)
  Measured on one H100, Hq32 Hkv8 D64 bf16 (docs/benchmarks.md, "Attention kernels").
  """
  if _under_multi_device_mesh():
    return ("pallas", "xla")
  if window_size is None or q_BTHD.shape[-1] == 128:
    return ("cudnn", "pallas", "xla")
  return ("pallas", "xla")


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
    implementation: see `pallas_kernels.dispatch`: "xla" (dense reference), "pallas" (tiled
      kernels that visit only the window tiles and the kept keys) or "cudnn" (plain causal or
      window attention only); None: `gpu_default` on a GPU, "xla" elsewhere.

  Returns:
    [B, T, Hq, Dv] in q's dtype; a query with no visible key gets zeros. Softmax statistics are
    float32 (float64 for float64 inputs).
  """
  _check_arguments(q_BTHD, k_BSKD, v_BSKD, window_size, num_sinks, kept_BSK, key_valid_BS)
  version = resolve(
      "masked_attention", implementation,
      {"xla": reference.masked_attention, "pallas": pallas.masked_attention,
       "cudnn": cudnn.masked_attention},
      gpu_default=gpu_default(q_BTHD, window_size=window_size))
  return version(
      q_BTHD, k_BSKD, v_BSKD, scale=scale, window_size=window_size, num_sinks=num_sinks,
      kept_BSK=kept_BSK, key_valid_BS=key_valid_BS)
