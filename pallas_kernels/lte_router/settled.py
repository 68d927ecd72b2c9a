"""The router's logit of one token per row, for decoding: the CNN without its padding.

A decoding step scores the token that has just received its right context (§5.4): the centre of a
span of S = 2 m + 1 ring tokens, m the CNN's receptive half-width (the sum of (taps // 2) *
dilation over its layers). The training version over the span pads every layer to S outputs
('same' padding). Only outputs whose taps stay inside the span can reach the centre, so here each
layer is the training version's convolution (reference.head_conv: one matmul batched over heads
giving every tap's product, then the shifted sum and bias; then the padding mask and SiLU) with
'valid' outputs only: 9, 5 and 1 positions for the paper's three layers of 3 taps at dilation 2,
instead of 13 each. The rounding points are the training version's, so the score is the one the
prompt's router gives that token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.lte_router import reference


def receptive_half_width(taps: tuple[int, ...], dilations: tuple[int, ...]) -> int:
  """How many tokens on each side of a position its router logit reads."""
  return sum((t // 2) * d for t, d in zip(taps, dilations))


def settled_logit(k_BSKD, v_BSKD, real_BS, weights, biases, proj_weight_KC, proj_bias_K, *,
                  dilations):
  """float32 [B, K]: the logit at the span's centre (see lte_router.settled_logit)."""
  dtype = k_BSKD.dtype
  taps = tuple(w.shape[1] for w in weights)
  real_BS = real_BS.astype(dtype)
  # Heads lead, as in the training version: each layer is one matmul batched over heads.
  x_KBSC = jnp.transpose(jnp.concatenate([k_BSKD, v_BSKD], axis=-1) * real_BS[:, :, None, None],
                         (2, 0, 1, 3))
  first = 0  # span position of x's first row
  for weight_KICO, bias_KO, dilation, kernel_size in zip(weights, biases, dilations, taps):
    # The 'valid' outputs: no padding reaches the centre.
    pre_KBTO = reference.head_conv(x_KBSC, weight_KICO, bias_KO, dilation=dilation, valid=True)
    first += (kernel_size // 2) * dilation
    mask_BT = real_BS[:, first:first + pre_KBTO.shape[2]]
    x_KBSC = jax.nn.silu(pre_KBTO * mask_BT[None, :, :, None])
  logit_KB = (jnp.einsum("kbc,kc->kb", x_KBSC[:, :, 0], proj_weight_KC.astype(dtype),
                         preferred_element_type=jnp.float32)
              + proj_bias_K.astype(jnp.float32)[:, None])
  return jnp.transpose(logit_KB)
