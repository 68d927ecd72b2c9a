"""GDN's short convolution: SiLU(causal depthwise convolution) of the q/k/v projections (§2).

Public entry: `short_conv_silu`. See `reference` for the definition (weight [C, K], tap K-1 on the
current token, an optional state of the K-1 inputs before the first). The Pallas version fuses the
convolution with the SiLU in one pass forward and one pass backward (input and weight gradients
together); XLA's form of the backward re-reads the inputs several times for the weight gradient's
column sums.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.short_conv import pallas, reference
from pallas_kernels.short_conv.pallas import ShortConvBlocks

__all__ = ["short_conv_silu", "ShortConvBlocks", "GPU_DEFAULT"]

# What implementation=None runs on a GPU, fastest first; the Pallas kernels take no state (a
# decode step or a continued prefill chunk passes one) and hand those calls to XLA.
GPU_DEFAULT = ("pallas", "xla")


@functools.partial(jax.jit, static_argnames=("implementation", "blocks"))
def short_conv_silu(x_BTC: jax.Array, weight_CK: jax.Array, state_BKC: jax.Array | None = None,
                    *, implementation: Implementation = None,
                    blocks: ShortConvBlocks = ShortConvBlocks()) -> jax.Array:
  """SiLU(causal depthwise conv(x)) [B, T, C] in x's dtype.

  Args:
    x_BTC: [B, T, C] the convolution's input.
    weight_CK: [C, K] (any float dtype; rounded to x's dtype as the reference does).
    state_BKC: [B, K-1, C] the inputs before x's first token, oldest first; None: zeros.
    implementation: "xla" (reference.py) or "pallas" (fused kernels, state None only); None:
      GPU_DEFAULT on a GPU, "xla" elsewhere.
    blocks: the Pallas kernels' tiles and launch parameters.
  """
  if x_BTC.ndim != 3 or weight_CK.ndim != 2 or weight_CK.shape[0] != x_BTC.shape[2]:
    raise ValueError(f"short_conv_silu: x {x_BTC.shape} must be [B, T, C] and weight"
                     f" {weight_CK.shape} [C, K] with the same C")
  taps = weight_CK.shape[1]
  if taps < 1:
    raise ValueError("short_conv_silu: the weight needs at least one tap")
  if state_BKC is not None and state_BKC.shape != (x_BTC.shape[0], taps - 1, x_BTC.shape[2]):
    raise ValueError(f"short_conv_silu: state {state_BKC.shape} must be [B, K-1, C] ="
                     f" {(x_BTC.shape[0], taps - 1, x_BTC.shape[2])}")
  version = resolve("short_conv_silu", implementation,
                    {"xla": reference.short_conv_silu,
                     "pallas": functools.partial(pallas.short_conv_silu, blocks=blocks)},
                    gpu_default=GPU_DEFAULT)
  return version(x_BTC, weight_CK, state_BKC)
