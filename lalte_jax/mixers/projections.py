"""The bias-free projections every mixer uses, with the reference's init (§1.4)."""

from __future__ import annotations

from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.layers import initializers


def input_projection(config: ModelConfig, in_features: int, out_features: int,
                     rngs: nnx.Rngs) -> nnx.Linear:
  """A projection read from the normed residual stream: Normal(0, init_std), no bias."""
  return nnx.Linear(in_features, out_features, use_bias=False, dtype=config.compute_dtype,
                    kernel_init=initializers.normal(config.init_std), rngs=rngs)


def output_projection(config: ModelConfig, in_features: int, rngs: nnx.Rngs) -> nnx.Linear:
  """o_proj: writes into the residual stream; hybrid-family models rescale its init (G17)."""
  rescale = config.num_layers if config.rescale_prenorm_residual else None
  return nnx.Linear(
      in_features, config.hidden_size, use_bias=False, dtype=config.compute_dtype,
      kernel_init=initializers.residual_output(config.init_std, in_features, rescale), rngs=rngs)
