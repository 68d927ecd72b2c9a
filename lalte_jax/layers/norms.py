"""RMSNorm and GDN's gated output norm: statistics in float32, output in the activation dtype.

Both have a hand-written backward that keeps only the input(s) in their own dtype and the
per-row inverse RMS in float32, and recomputes the normalised rows from them. Autodiff of the
float32 forward would keep the float32 copies it multiplies (x in float32, x * inv_rms, and for
the gated norm the normalised output and SiLU(gate)), each twice the bytes of the input, written
by the forward and read by the backward of every layer when nothing is rematerialised. Being
`jax.custom_vjp` functions, they differentiate in reverse mode only (grad, vjp), as training does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def inverse_rms(x32: jax.Array, eps: float) -> jax.Array:
  """1 / sqrt(mean(x^2, -1) + eps) of a float32 x, keeping the reduced axis."""
  return jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def _leading_sum(x32: jax.Array) -> jax.Array:
  """Sum over every axis but the last: a weight's gradient."""
  return jnp.sum(x32.reshape(-1, x32.shape[-1]), axis=0)


def _normalize_backward(dn32: jax.Array, n32: jax.Array, inv_rms: jax.Array) -> jax.Array:
  """d/dx of n = x * inv_rms(x) given dL/dn: inv_rms * (dn - n * mean(dn * n))."""
  return inv_rms * (dn32 - n32 * jnp.mean(dn32 * n32, axis=-1, keepdims=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2, -1) + eps) * weight in float32, rounded to x's dtype."""
  return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
  x32 = x.astype(jnp.float32)
  inv_rms = inverse_rms(x32, eps)
  return (x32 * inv_rms * weight).astype(x.dtype), (x, weight, inv_rms)


def _rms_norm_bwd(eps, residuals, dy):
  del eps
  x, weight, inv_rms = residuals
  n32 = x.astype(jnp.float32) * inv_rms
  dy32 = dy.astype(jnp.float32)
  dx = _normalize_backward(dy32 * weight, n32, inv_rms)
  return dx.astype(x.dtype), _leading_sum(dy32 * n32).astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2, -1) + eps) * weight * SiLU(gate) in float32, rounded to x's dtype
  (GDN's output norm, per head over the last axis)."""
  return _gated_rms_norm_fwd(x, gate, weight, eps)[0]


def _gated_rms_norm_fwd(x, gate, weight, eps):
  x32 = x.astype(jnp.float32)
  inv_rms = inverse_rms(x32, eps)
  y = (x32 * inv_rms * weight * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
  return y, (x, gate, weight, inv_rms)


def _gated_rms_norm_bwd(eps, residuals, dy):
  del eps
  x, gate, weight, inv_rms = residuals
  n32 = x.astype(jnp.float32) * inv_rms
  gate32 = gate.astype(jnp.float32)
  sigmoid = jax.nn.sigmoid(gate32)
  dy32 = dy.astype(jnp.float32)
  dnormed = dy32 * (gate32 * sigmoid)  # through normed * SiLU(gate)
  dgate = dy32 * n32 * weight * (sigmoid * (1.0 + gate32 * (1.0 - sigmoid)))  # SiLU'
  dx = _normalize_backward(dnormed * weight, n32, inv_rms)
  return (dx.astype(x.dtype), dgate.astype(gate.dtype),
          _leading_sum(dnormed * n32).astype(weight.dtype))


gated_rms_norm.defvjp(_gated_rms_norm_fwd, _gated_rms_norm_bwd)


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * weight over the last axis; weight starts at 1, no bias."""

  def __init__(self, dim: int, *, eps: float = 1e-6):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

  @jax.named_scope("rms_norm")  # names its kernels in profiles (tools/step_profile.py)
  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)
