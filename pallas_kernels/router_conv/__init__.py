"""One layer of the LTE router's CNN: silu(conv(dropout(x)) + bias) over heads-first activations.

Public entry: `conv_silu`. `reference` holds the jnp definition (and `grouped_conv_same`, the
convolution the router runs in XLA); `pallas` the fused forward and backward kernels.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.router_conv import pallas, reference

__all__ = ["conv_silu", "grouped_conv_same", "pallas_handles"]

grouped_conv_same = reference.grouped_conv_same
pallas_handles = pallas.handles  # (input channels, output channels) -> bool

# What implementation=None runs on a GPU: "xla" until the Pallas kernels are measured against it
# in the training step (tools/bench_router.py, tools/gpu_stages.sh trainlte).
GPU_DEFAULT = ("xla",)


def _pallas(x_KBTC, weight_KICO, bias_KO, seed, mask_BT, rate, dilation):
  if mask_BT is not None:
    raise NotImplementedError("router_conv pallas: no padding mask (training inputs only)")
  pallas.check_shapes(x_KBTC, weight_KICO)
  return pallas.conv_silu(x_KBTC, weight_KICO, bias_KO, seed, rate, dilation)


@functools.partial(jax.jit, static_argnames=("rate", "dilation", "implementation"))
def conv_silu(x_KBTC: jax.Array, weight_KICO: jax.Array, bias_KO: jax.Array,
              seed: jax.Array | None = None, mask_BT: jax.Array | None = None, *,
              rate: float, dilation: int, implementation: Implementation = None) -> jax.Array:
  """silu(conv(dropout(x)) + bias): one router layer, [K, B, T, C] -> [K, B, T, O] in x's dtype.

  Args:
    x_KBTC: the layer's input, heads leading.
    weight_KICO: [K, taps, C, O] per-head taps (odd count; 'same' zero padding at `dilation`).
    bias_KO: [K, O].
    seed: uint32 [2], the dropout's seed words (`counter_hash.seed_words` of the layer's key);
      None: no dropout.
    mask_BT: bool [B, T], True at real tokens: the conv output is zeroed elsewhere before the
      SiLU (prefill of padded prompts); None: every token is real.
    rate: the dropout rate in [0, 1).
    implementation: "xla" (reference.conv_silu) or "pallas" (fused kernels; power-of-two channel
      widths >= 16, no mask). None: GPU_DEFAULT on a GPU, "xla" elsewhere.
  """
  heads, _, _, channels = x_KBTC.shape
  if weight_KICO.shape[0] != heads or weight_KICO.shape[2] != channels:
    raise ValueError(f"router_conv.conv_silu: weight_KICO {weight_KICO.shape} does not fit"
                     f" x_KBTC {x_KBTC.shape}")
  if weight_KICO.shape[1] % 2 != 1:
    raise ValueError(f"router_conv.conv_silu: 'same' padding needs an odd tap count, got"
                     f" {weight_KICO.shape[1]}")
  version = resolve("router_conv.conv_silu", implementation,
                    {"xla": reference.conv_silu, "pallas": _pallas}, gpu_default=GPU_DEFAULT)
  return version(x_KBTC, weight_KICO, bias_KO, seed, mask_BT, rate, dilation)
