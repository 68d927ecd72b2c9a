"""The definition of `decode_matmul`: the op before a decode step's projection, then the
projection, as the model's layers compute them unfused.

Prologues (the op that produces the projection's input a from x):
- plain:    a = x
- RMSNorm:  h = x + residual (when given: the residual stream's pending add), then
            a = h / sqrt(mean(h^2) + eps) * norm_weight in float32, rounded to x's dtype
            (`lalte_jax.layers.norms.rms_norm`); h is returned for the next add.
- SwiGLU:   x is [M, 2K], gate then up: a = SiLU(gate) * up.
The projection is the plain dot in x's dtype, as `nnx.Linear` computes it (XLA accumulates bf16
products in float32 on the GPU; the Pallas kernel does the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def prologue(x_MX: jax.Array, *, residual_MK: jax.Array | None, norm_weight_K: jax.Array | None,
             eps: float, swiglu: bool) -> tuple[jax.Array, jax.Array | None]:
  """(a [M, K] in x's dtype, h [M, K] when residual_MK is given else None)."""
  if swiglu:
    gate_MK, up_MK = jnp.split(x_MX, 2, axis=-1)
    return jax.nn.silu(gate_MK) * up_MK, None
  h_MK = x_MX if residual_MK is None else x_MX + residual_MK
  if norm_weight_K is None:
    return h_MK, (None if residual_MK is None else h_MK)
  h32_MK = h_MK.astype(jnp.float32)
  inverse_rms_M1 = jax.lax.rsqrt(jnp.mean(jnp.square(h32_MK), axis=-1, keepdims=True) + eps)
  a_MK = (h32_MK * inverse_rms_M1 * norm_weight_K.astype(jnp.float32)).astype(x_MX.dtype)
  return a_MK, (None if residual_MK is None else h_MK)


def decode_matmul(x_MX: jax.Array, w_KN: jax.Array, residual_MK: jax.Array | None = None,
                  norm_weight_K: jax.Array | None = None, *, eps: float, swiglu: bool
                  ) -> tuple[jax.Array, jax.Array | None]:
  """(y = prologue(x) @ w [M, N] in x's dtype, h or None): see the module doc."""
  a_MK, h_MK = prologue(x_MX, residual_MK=residual_MK, norm_weight_K=norm_weight_K, eps=eps,
                        swiglu=swiglu)
  return jnp.dot(a_MK, w_KN.astype(a_MK.dtype)), h_MK
