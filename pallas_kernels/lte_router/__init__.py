"""The LTE router (§4.1): a per-KV-head CNN over concat(pre-RoPE key, value) that scores each
token, score = sigmoid(logit) - 0.5 (kept iff > 0).

Public entry: `lte_router_scores`. Versions: "xla" is `reference.router_scores` (each conv layer
one batched matmul, autodiff for the backward); "pallas" runs the whole router, forward and
backward, as one kernel each (pallas.py). The kernels take no padding mask (prefill's left
padding) and tile channel widths that are powers of two >= 16; other inputs go to "xla".
"""

from __future__ import annotations

import jax

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.lte_router import pallas, reference

__all__ = ["kernels_apply", "lte_router_scores"]

# What implementation=None runs on a GPU, fastest first.
GPU_DEFAULT = ("pallas", "xla")


def kernels_apply(conv_weights, dilations, mask_BT: jax.Array | None = None) -> bool:
  """Whether "pallas" takes a router of these weights (and padding mask)."""
  return mask_BT is None and pallas.unsupported(pallas.router_shape(conv_weights,
                                                                     dilations)) is None


def lte_router_scores(k_BTKD: jax.Array, v_BTKD: jax.Array, conv_weights, conv_biases,
                      proj_weight_KC: jax.Array, proj_bias_K: jax.Array,
                      seeds_L2: jax.Array | None, *, dilations: tuple[int, ...], rate: float,
                      mask_BT: jax.Array | None = None,
                      implementation: Implementation = None) -> jax.Array:
  """The router's scores [B, T, Hkv] float32; arguments as `reference.router_scores`."""
  if k_BTKD.shape != v_BTKD.shape:
    raise ValueError(f"lte_router_scores: k_BTKD {k_BTKD.shape} and v_BTKD {v_BTKD.shape}"
                     " differ")
  if len(conv_weights) != len(conv_biases) or len(conv_weights) != len(dilations):
    raise ValueError(f"lte_router_scores: {len(conv_weights)} conv weights, {len(conv_biases)}"
                     f" biases and {len(dilations)} dilations")
  if conv_weights[0].shape[2] != 2 * k_BTKD.shape[-1] or conv_weights[0].shape[0] != \
      k_BTKD.shape[2]:
    raise ValueError(f"lte_router_scores: the first conv weight {conv_weights[0].shape} does not"
                     f" fit keys {k_BTKD.shape} ([Hkv, taps, 2D, O])")
  version = resolve("lte_router_scores", implementation,
                    {"xla": reference.router_scores, "pallas": pallas.router_scores},
                    gpu_default=GPU_DEFAULT)
  return version(k_BTKD, v_BTKD, conv_weights, conv_biases, proj_weight_KC, proj_bias_K,
                 seeds_L2, dilations=tuple(dilations), rate=rate, mask_BT=mask_BT)
