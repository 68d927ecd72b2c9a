"""The dtype a model holds its parameters in for inference (training keeps float32 master weights).

Decoding reads every weight once per token, so holding the matrices in bfloat16 halves the bytes a
decode step reads. `cast_params_for_inference(model, "bfloat16")` casts every parameter whose
per-layer shape has ndim >= 2 (embedding / tied LM head, untied LM head, q/k/v/o, g/a/b and MLP
projections, GDN short-conv kernels, LTE router conv and projection weights and the router's
per-head conv biases [Hkv, C]) and keeps every 1-D vector in float32: RMSNorm weights, GDN's
per-head output-norm weight, A_log and dt_bias, the router's projection bias.

Why the rule is safe: every parameter of ndim >= 2 is cast to the activation dtype
(`ModelConfig.dtype`) where it is used (`nnx.Linear` / `nnx.Embed` with `dtype=compute_dtype`,
`ShortConv` and the LM head with `.astype(x.dtype)`, the router's weights and biases with
`.astype(k.dtype)`), so with bfloat16 activations storing them in bfloat16 changes no result, and
with float32 activations it only rounds them (each matrix is then converted to float32 where it is
used, as float32 compute asks: serve with bfloat16 activations to read half the bytes). The 1-D
vectors multiply or shift float32 values (`rms_norm(x, weight)`, the float32 gates
`-exp(A_log) * softplus(a + dt_bias)`), where rounding would be a real change; the router's
projection bias is added in the activation dtype and stays float32 as every vector does, for no
loss: the vectors are a few kilobytes.

The layer groups' parameters carry a leading stacked [num_groups] axis (`HybridLM.groups`), which
does not count towards ndim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

PARAM_DTYPES = ("float32", "bfloat16")
# The --param-dtype help of every command that loads a model for inference.
PARAM_DTYPE_HELP = ("parameter dtype in memory (default float32; bfloat16: matrices only,"
                    " vectors stay float32)")
STACKED_GROUPS = "groups"  # HybridLM attribute whose parameters have a leading [num_groups] axis


def check_param_dtype(param_dtype: str) -> None:
  if param_dtype not in PARAM_DTYPES:
    raise ValueError(f"param_dtype: expected one of {PARAM_DTYPES}, got {param_dtype!r}")


def inference_dtype(path: tuple, leaf: jax.Array, param_dtype: str) -> jnp.dtype:
  """The dtype of the parameter at `path` (keys of the model's pure dict) under `param_dtype`."""
  per_layer_ndim = leaf.ndim - (1 if path[0] == STACKED_GROUPS else 0)
  return jnp.dtype(param_dtype if per_layer_ndim >= 2 else jnp.float32)


def cast_params_for_inference(model, param_dtype: str):
  """A copy of the HybridLM `model` holding its matrices in `param_dtype` and its vectors in
  float32 (see the module docstring); `model` itself is unchanged. ValueError for a
  `param_dtype` outside PARAM_DTYPES."""
  check_param_dtype(param_dtype)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
  cast = [leaf.astype(inference_dtype(tuple(key.key for key in path), leaf, param_dtype))
          for path, leaf in leaves]
  nnx.replace_by_pure_dict(params, jax.tree_util.tree_unflatten(treedef, cast))
  return nnx.merge(graphdef, params, rest)
