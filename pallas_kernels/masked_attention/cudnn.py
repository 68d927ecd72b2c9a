"""`implementation="cudnn"` of masked attention: cuDNN's fused attention through
`jax.nn.dot_product_attention`, for the inputs it can express (plain causal or sliding-window
attention over the whole sequence, bf16/f16, head dim 64 or 128, on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dispatch

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_supported(q_BTHD, k_BSKD, v_BSKD, *, window_size, num_sinks, kept_BSK,
                    key_valid_BS) -> None:
  """Raises NotImplementedError for inputs cuDNN cannot compute (callers may fall back)."""
  head_dim = q_BTHD.shape[-1]
  reasons = []
  if not dispatch.on_gpu():
    reasons.append("needs a GPU")
  if not (jnp.dtype(q_BTHD.dtype) in HALF_DTYPES and q_BTHD.dtype == k_BSKD.dtype
          == v_BSKD.dtype):
    reasons.append(f"q/k/v must share bf16 or f16, got {q_BTHD.dtype}, {k_BSKD.dtype},"
                   f" {v_BSKD.dtype}")
  if head_dim not in (64, 128) or v_BSKD.shape[-1] != head_dim:
    reasons.append(f"head dims must be 64 or 128 and equal, got {head_dim}, {v_BSKD.shape[-1]}")
  if q_BTHD.shape[1] != k_BSKD.shape[1]:
    reasons.append("T < S (queries over a longer key sequence)")
  if key_valid_BS is not None:
    reasons.append("key_valid_BS")
  # Without a window every earlier key is visible anyway, so sinks and kept keys change nothing.
  if window_size is not None and (num_sinks or kept_BSK is not None):
    reasons.append("sinks or kept keys outside the window")
  if reasons:
    raise NotImplementedError("masked_attention[cudnn]: " + "; ".join(reasons))


def masked_attention(q_BTHD, k_BSKD, v_BSKD, *, scale=None, window_size=None, num_sinks=0,
                     kept_BSK=None, key_valid_BS=None) -> jax.Array:
  """Same contract as `reference.masked_attention` for the inputs `check_supported` accepts."""
  check_supported(q_BTHD, k_BSKD, v_BSKD, window_size=window_size, num_sinks=num_sinks,
                  kept_BSK=kept_BSK, key_valid_BS=key_valid_BS)
  return jax.nn.dot_product_attention(
      q_BTHD, k_BSKD, v_BSKD, scale=scale, is_causal=True, implementation="cudnn",
      local_window_size=None if window_size is None else (window_size - 1, 0))
