"""The LM head's matmul: float32 logits from compute-dtype hidden states and weights, with a
backward pass in the compute dtype.

The forward accumulates in float32 and returns float32 logits for the loss's softmax. Left to
autodiff, the backward would contract the float32 logits gradient [B, T, V] with the bf16 weight
and hidden states in float32 (TF32 GEMMs on the GPU: the step's largest single GEMM, 4.3 ms of a
gdn_swa-0.4b step at B4 T4096 on one H200). Here the gradient is rounded to the operands' dtype
first, as every other gradient of a bf16 step is, and both backward GEMMs run in it with float32
accumulation: gdn_swa-0.4b 137.6 -> 133.1 ms a step, lalte-0.4b 152.9 -> 149.1 ms on one H200
(2026-11-29, tools/bench_train.py, B4 T4096), the loss unchanged within run-to-run noise.
With float32 operands it is the plain float32 matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def float32_logits(h_BTD: jax.Array, head_DV: jax.Array) -> jax.Array:
  """h @ head with float32 accumulation: logits [B, T, V] float32 (operands in one dtype)."""
  if h_BTD.dtype != head_DV.dtype:
    raise ValueError(f"lm_head.float32_logits: hidden states in {h_BTD.dtype}, head weight in"
                     f" {head_DV.dtype}; cast both to the compute dtype")
  return jnp.einsum("btd,dv->btv", h_BTD, head_DV, preferred_element_type=jnp.float32)


def _forward(h_BTD, head_DV):
  return float32_logits(h_BTD, head_DV), (h_BTD, head_DV)


def _backward(residuals, dlogits_BTV):
  h_BTD, head_DV = residuals
  dlogits_BTV = dlogits_BTV.astype(h_BTD.dtype)
  dh_BTD = jnp.einsum("btv,dv->btd", dlogits_BTV, head_DV, preferred_element_type=jnp.float32)
  dhead_DV = jnp.einsum("btd,btv->dv", h_BTD, dlogits_BTV, preferred_element_type=jnp.float32)
  return dh_BTD.astype(h_BTD.dtype), dhead_DV.astype(head_DV.dtype)


float32_logits.defvjp(_forward, _backward)
