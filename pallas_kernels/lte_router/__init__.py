"""The LTE router's CNN (§4.1): per KV head, L layers silu(conv(dropout(x)) + bias) over the
concatenated pre-RoPE key and value, then a linear projection to one logit per token.

Public entries: `router_logits` (every token of a sequence: training and prefill) and
`settled_logit` (one token per row from the span of its receptive field: a decoding step,
settled.py). Layer l's convolution is per head ('same' zero padding, dilation
d_l, an odd number of taps): pre_l[t] = b_l + sum_i drop_l(x_{l-1})[t + i d_l - half_l] W_l,i with
half_l = (taps // 2) d_l. Dropout draws its masks from the counter hash (counter_hash.py), so
every pass and recomputation drops the same units.
"""

from __future__ import annotations

import jax

import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.lte_router import pallas, reference, settled
from pallas_kernels.lte_router.reference import ROUTER_ACTIVATION

__all__ = ["router_logits", "settled_logit", "ROUTER_ACTIVATION", "GPU_DEFAULT"]

# The per-layer fused kernels (pallas.py): the router's forward and backward 0.79x XLA's time
# with every activation kept, the lalte-0.4b training step 0.996-0.997x (one H200, 2026-11-30,
# B8 T4096; unrolled layer groups: under the scanned loop they had not gained); building the
# first layer's input from k and v in a kernel, and its gradient back, 0.973-0.997x more.
# Kernels that read k and v in place at every tap of the first conv measured 1.15x XLA's time.
GPU_DEFAULT = ("pallas", "xla")


def _pallas(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K, seeds, *, dilations,
            rate, mask_BT=None, row_offset=0):
  if mask_BT is not None:
    raise NotImplementedError("lte_router[pallas]: no padding mask (a prompt's router runs XLA)")
  logit_KBT = pallas.router_logits(k_BTKD, v_BTKD, weights, biases, proj_weight_KC, proj_bias_K,
                                   seeds, dilations=dilations, rate=rate, row_offset=row_offset)
  return jnp.transpose(logit_KBT, (1, 2, 0))


def _check_cnn(k_BTKD, weights, biases, dilations, proj_weight_KC, proj_bias_K) -> None:
  """ValueError naming the first weight, bias or dilation that does not fit the CNN's input."""
  heads, channels = k_BTKD.shape[2], 2 * k_BTKD.shape[3]
  if not (len(weights) == len(biases) == len(dilations)) or not weights:
    raise ValueError(f"lte_router: {len(weights)} weights, {len(biases)} biases and"
                     f" {len(dilations)} dilations; expected one of each per layer (>= 1)")
  for layer, (weight, bias, dilation) in enumerate(zip(weights, biases, dilations)):
    if weight.ndim != 4 or weight.shape[0] != heads or weight.shape[2] != channels:
      raise ValueError(f"lte_router: layer {layer} weight {weight.shape} does not fit its input"
                       f" [{heads}, B, T, {channels}]")
    if weight.shape[1] % 2 != 1:
      raise ValueError(f"lte_router: layer {layer} has {weight.shape[1]} taps; 'same' padding"
                       " needs an odd count")
    if bias.shape != (heads, weight.shape[3]):
      raise ValueError(f"lte_router: layer {layer} bias {bias.shape} does not fit its weight"
                       f" {weight.shape}")
    if not isinstance(dilation, int) or dilation < 1:
      raise ValueError(f"lte_router: layer {layer} dilation must be an int >= 1, got"
                       f" {dilation!r}")
    channels = weight.shape[3]
  if proj_weight_KC.shape != (heads, channels) or proj_bias_K.shape != (heads,):
    raise ValueError(f"lte_router: projection {proj_weight_KC.shape} / {proj_bias_K.shape} does"
                     f" not fit [{heads}, {channels}] / [{heads}]")


def settled_logit(k_BSKD: jax.Array, v_BSKD: jax.Array, real_BS: jax.Array, weights, biases,
                  proj_weight_KC: jax.Array, proj_bias_K: jax.Array, *, dilations,
                  implementation: Implementation = None) -> jax.Array:
  """The router's logit, float32 [B, K], of the centre of a span of S = 2 m + 1 tokens, m the
  CNN's receptive half-width (the token a decoding step scores once its right context exists):
  `router_logits(..., mask_BT=real_BS)[:, m]` without dropout, computed on the positions that
  can reach the centre only (settled.py: the convolutions without their padding).

  Args: k_BSKD, v_BSKD [B, S, K, D] pre-RoPE keys and values of the span; real_BS bool [B, S],
    True at real tokens (blanks read as zeros); the weights as for `router_logits`.
    implementation: "xla", the only version (None picks it).
  """
  _check_cnn(k_BSKD, weights, biases, dilations, proj_weight_KC, proj_bias_K)
  taps = tuple(w.shape[1] for w in weights)
  span = 2 * settled.receptive_half_width(taps, tuple(dilations)) + 1
  if k_BSKD.shape != v_BSKD.shape or k_BSKD.ndim != 4 or k_BSKD.shape[1] != span:
    raise ValueError(f"lte_router settled logit: k {k_BSKD.shape} and v {v_BSKD.shape} must be"
                     f" equal [B, {span}, K, D] (S: the receptive field of taps {taps} and"
                     f" dilations {tuple(dilations)})")
  if real_BS.shape != k_BSKD.shape[:2]:
    raise ValueError(f"lte_router settled logit: real_BS {real_BS.shape}, expected"
                     f" {k_BSKD.shape[:2]}")
  version = resolve("lte_router settled logit", implementation, {"xla": settled.settled_logit},
                    gpu_default=("xla",))
  return version(k_BSKD, v_BSKD, real_BS, tuple(weights), tuple(biases), proj_weight_KC,
                 proj_bias_K, dilations=tuple(dilations))


def router_logits(k_BTKD: jax.Array, v_BTKD: jax.Array, weights, biases,
                  proj_weight_KC: jax.Array, proj_bias_K: jax.Array, seeds: jax.Array | None, *,
                  dilations, rate: float, mask_BT: jax.Array | None = None,
                  row_offset: jax.Array | int = 0,
                  implementation: Implementation = None) -> jax.Array:
  """The router's logits, float32 [B, T, K].

  Args:
    k_BTKD, v_BTKD: [B, T, K, D] pre-RoPE keys and values; the CNN's input is concat(k, v) per
      head (key dims, then value dims).
    weights: per layer [K, taps_l, C_{l-1}, C_l] (C_0 = 2D); biases: per layer [K, C_l].
    proj_weight_KC: [K, C_L]; proj_bias_K: [K].
    seeds: uint32 [L, 2], each layer's dropout seed words (`counter_hash.seed_words`), or None
      (no dropout).
    dilations: per layer, >= 1. rate: the dropout rate in [0, 1).
    mask_BT: bool [B, T], True at real tokens: padded tokens read as zeros at every layer (the
      conv output is zeroed there before the SiLU); None: every token is real.
    row_offset: the global index of row 0 (int32; a batch shard's first row): the dropout
      masks hash global rows, so a sharded batch draws the whole batch's masks.
    implementation: see `pallas_kernels.dispatch`: "xla" (reference.py) or "pallas" (pallas.py:
      fused kernels per layer, no mask_BT, power-of-two widths >= 16); None: GPU_DEFAULT on a GPU
      (the first that handles the inputs), "xla" elsewhere.
  """
  if k_BTKD.shape != v_BTKD.shape or k_BTKD.ndim != 4:
    raise ValueError(f"lte_router: k {k_BTKD.shape} and v {v_BTKD.shape} must be equal [B, T, K,"
                     " D]")
  _check_cnn(k_BTKD, weights, biases, dilations, proj_weight_KC, proj_bias_K)
  if seeds is not None and seeds.shape != (len(weights), 2):
    raise ValueError(f"lte_router: seeds {seeds.shape}, expected ({len(weights)}, 2)")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"lte_router: dropout rate must be in [0, 1), got {rate}")
  version = resolve("lte_router", implementation,
                    {"xla": reference.router_logits, "pallas": _pallas}, gpu_default=GPU_DEFAULT)
  return version(k_BTKD, v_BTKD, tuple(weights), tuple(biases), proj_weight_KC, proj_bias_K,
                 seeds, dilations=tuple(dilations), rate=float(rate), mask_BT=mask_BT,
                 row_offset=row_offset)
