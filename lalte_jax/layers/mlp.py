"""SwiGLU MLP (FLA's GatedMLP): down(silu(gate(x)) * up(x)), no biases."""

from __future__ import annotations

import jax
from flax import nnx

from lalte_jax.layers import initializers


class SwiGLU(nnx.Module):

  def __init__(self, hidden_size: int, intermediate_size: int, *, init_std: float,
               rescale_num_layers: int | None, dtype, rngs: nnx.Rngs):
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
    return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))
