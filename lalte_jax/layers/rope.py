"""Rotary position embedding, rotate-half (GPT-NeoX) convention, and its inverse (§1.3).

inv_freq[i] = theta^(-2i/d); a key or query at position p is rotated by angle p * inv_freq, its
first and second halves mixed as [x1 cos - x2 sin, x2 cos + x1 sin]. `derope` rotates by the
negative angle; the LTE decoder uses it to recover pre-RoPE keys for rescoring (§5.4).
Angles and the rotation are computed in float32 (positions in fp32 as in the reference) and the
result is cast back to the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions_BT: jax.Array, head_dim: int, theta: float) -> jax.Array:
  """Angles [B, T, head_dim/2] in float32."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  return positions_BT.astype(jnp.float32)[..., None] * inv_freq


def _rotate(x_BTHD: jax.Array, angles_BTF: jax.Array) -> jax.Array:
  cos = jnp.cos(angles_BTF)[:, :, None, :]
  sin = jnp.sin(angles_BTF)[:, :, None, :]
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BTHD.dtype)


def apply_rope(x_BTHD: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  return _rotate(x_BTHD, rope_angles(positions_BT, x_BTHD.shape[-1], theta))


def derope(x_BTHD: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
  """Inverse of `apply_rope` at the same positions."""
  return _rotate(x_BTHD, -rope_angles(positions_BT, x_BTHD.shape[-1], theta))


def default_positions(batch: int, length: int) -> jax.Array:
  """Positions 0..T-1 for every row: [B, T] int32."""
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
