"""SwiGLU MLP (FLA's GatedMLP): down(silu(gate(x)) * up(x)), no biases.

For decoding, `fuse_decode_projections` holds the gate and up kernels side by side as one, and
`decode_residual` runs the block's whole second half (the pending residual add, the RMSNorm and
the MLP) as two `pallas_kernels.decode_matmul` calls: a step of a few rows is bound by reading
weights and by its chain of small launches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.layers import initializers
from pallas_kernels.decode_matmul import decode_matmul


class SwiGLU(nnx.Module):

  def __init__(self, hidden_size: int, intermediate_size: int, *, init_std: float,
               rescale_num_layers: int | None, dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    linear = dict(use_bias=False, dtype=dtype, rngs=rngs)
    self.gate_proj = nnx.Linear(hidden_size, intermediate_size,
                                kernel_init=initializers.normal(init_std), **linear)
    self.up_proj = nnx.Linear(hidden_size, intermediate_size,
                              kernel_init=initializers.normal(init_std), **linear)
    self.down_proj = nnx.Linear(
        intermediate_size, hidden_size,
        kernel_init=initializers.residual_output(init_std, intermediate_size, rescale_num_layers),
        **linear)

  @jax.named_scope("swiglu")  # names its kernels in profiles (tools/step_profile.py)
  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    if self.decode_only:
      raise RuntimeError("SwiGLU: this MLP was prepared by fuse_decode_projections (gate and up"
                         " as one decode_gate_up_kernel), so it only decodes (decode_residual)")
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))

  @property
  def decode_only(self) -> bool:
    """Whether `fuse_decode_projections` has replaced gate_proj and up_proj."""
    return hasattr(self, "decode_gate_up_kernel")

  def fuse_decode_projections(self) -> None:
    """Prepares the MLP for decoding: the gate and up kernels side by side as the parameter
    `decode_gate_up_kernel` ([..., hidden, 2 x intermediate]; stacked groups keep their leading
    axis), which replaces the two, so the weights are held once. Idempotent."""
    if self.decode_only:
      return
    self.decode_gate_up_kernel = nnx.Param(jnp.concatenate(
        [self.gate_proj.kernel[...], self.up_proj.kernel[...]], axis=-1))
    del self.gate_proj, self.up_proj

  @jax.named_scope("swiglu")
  def decode_residual(self, h_B1D: jax.Array, mixed_B1D: jax.Array, norm,
                      implementation=None) -> jax.Array:
    """h + mixed + SwiGLU(norm(h + mixed)) of a decode step's tokens (a prepared MLP; `norm` the
    block's RMSNorm module): the add and the norm inside the gate|up projection's kernel, the
    SiLU product inside the down projection's."""
    rows_D = lambda x: x.reshape(-1, x.shape[-1]).astype(self.dtype)
    as_dtype = lambda w: w[...].astype(self.dtype)
    gate_up, summed = decode_matmul(
        rows_D(h_B1D), as_dtype(self.decode_gate_up_kernel), residual_MK=rows_D(mixed_B1D),
        norm_weight_K=norm.weight[...], eps=norm.eps, implementation=implementation)
    delta, _ = decode_matmul(gate_up, as_dtype(self.down_proj.kernel), swiglu=True,
                             implementation=implementation)
    return (summed + delta).reshape(h_B1D.shape)
