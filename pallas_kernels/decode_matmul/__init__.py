"""A decode step's projection of a few rows with the op before it fused in: `decode_matmul`.

At one prompt a decode step is a chain of small dependent launches: each projection's GEMM is
preceded by an RMSNorm (and the residual add before it) or SwiGLU's product, separate kernels of
1.4-1.9 us that read and write a few rows. Here the projection's kernel computes that prologue
from its inputs itself, so the chain loses those launches. See `reference` for the definition;
`tools/bench_decode_matmul.py` times it against the unfused ops.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode_matmul import pallas, reference
from pallas_kernels.decode_matmul.pallas import MAX_ROWS, DecodeMatmulConfig
from pallas_kernels.dispatch import Implementation, resolve

__all__ = ["DecodeMatmulConfig", "GPU_DEFAULT", "MAX_ROWS", "decode_matmul"]

# What implementation=None runs on a GPU: XLA until the kernel has been measured against it at a
# decode step's rows (`tools/bench_decode_matmul.py`); "pallas" takes at most MAX_ROWS rows, sizes
# that are multiples of 16 and one dtype, and hands other inputs on.
GPU_DEFAULT = ("xla",)


def _check(x_MX, w_KN, residual_MK, norm_weight_K, swiglu) -> None:
  """ValueError naming the first argument of the wrong rank, shape or dtype."""
  op = "decode_matmul"
  for name, array, rank in (("x", x_MX, 2), ("w", w_KN, 2), ("residual", residual_MK, 2),
                            ("norm_weight", norm_weight_K, 1)):
    if array is None:
      continue
    if not jnp.issubdtype(array.dtype, jnp.floating):
      raise ValueError(f"{op}: {name} must have a floating dtype, got {array.dtype}")
    if array.ndim != rank:
      raise ValueError(f"{op}: {name} must have rank {rank}, got shape {tuple(array.shape)}")
  rows, key_dim = x_MX.shape[0], w_KN.shape[0]
  if swiglu:
    if residual_MK is not None or norm_weight_K is not None:
      raise ValueError(f"{op}: swiglu takes neither residual nor norm_weight")
    if x_MX.shape[1] != 2 * key_dim:
      raise ValueError(f"{op}: with swiglu, x must be [M, 2K] (gate, up) = [{rows},"
                       f" {2 * key_dim}] for w {tuple(w_KN.shape)}, got {tuple(x_MX.shape)}")
    return
  if x_MX.shape[1] != key_dim:
    raise ValueError(f"{op}: x {tuple(x_MX.shape)} must be [M, K] for w {tuple(w_KN.shape)}")
  if residual_MK is not None:
    if norm_weight_K is None:
      raise ValueError(f"{op}: residual is the add before an RMSNorm; give norm_weight too")
    if residual_MK.shape != x_MX.shape or residual_MK.dtype != x_MX.dtype:
      raise ValueError(f"{op}: residual {residual_MK.dtype} {tuple(residual_MK.shape)} must match"
                       f" x {x_MX.dtype} {tuple(x_MX.shape)}")
  if norm_weight_K is not None and norm_weight_K.shape != (key_dim,):
    raise ValueError(f"{op}: norm_weight must be [K] = ({key_dim},), got"
                     f" {tuple(norm_weight_K.shape)}")


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "implementation", "config"))
def decode_matmul(x_MX: jax.Array, w_KN: jax.Array, *, residual_MK: jax.Array | None = None,
                  norm_weight_K: jax.Array | None = None, eps: float = 1e-6, swiglu: bool = False,
                  implementation: Implementation = None,
                  config: DecodeMatmulConfig = DecodeMatmulConfig()
                  ) -> tuple[jax.Array, jax.Array | None]:
  """prologue(x) @ w for a few rows, and the residual stream after its pending add.

  Args:
    x_MX: [M, K] the residual stream (or a projection's input), or with `swiglu` [M, 2K]: the gate
      and up projections side by side.
    w_KN: [K, N] the projection.
    residual_MK: [M, K] a residual add still to apply before the RMSNorm (h = x + residual).
    norm_weight_K: [K] an RMSNorm's weight: the projection's input is RMSNorm(h) (else h).
    eps: the RMSNorm's epsilon.
    swiglu: the projection's input is SiLU(gate) * up.
    implementation: "xla" (reference.py) or "pallas" (one kernel, M <= MAX_ROWS); None: GPU_DEFAULT
      on a GPU, "xla" elsewhere.
    config: the Pallas kernel's tiles and launch parameters.

  Returns:
    (y [M, N] in x's dtype, h [M, K] when residual_MK is given, else None).
  """
  _check(x_MX, w_KN, residual_MK, norm_weight_K, swiglu)
  version = resolve(
      "decode_matmul", implementation,
      {"xla": functools.partial(reference.decode_matmul, eps=eps, swiglu=swiglu),
       "pallas": lambda *a: pallas.decode_matmul(*a, eps, swiglu, config)},
      gpu_default=GPU_DEFAULT)
  return version(x_MX, w_KN, residual_MK, norm_weight_K)
