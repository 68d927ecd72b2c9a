"""Gated delta rule (the token mixer of Gated DeltaNet): public entries with FLA's semantics.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

`chunk_gated_delta_rule` is the training / prefill entry (chunked, parallel within chunks);
`fused_recurrent_gated_delta_rule` steps token by token, for decoding with small T. Both take
q, k `[B,T,H,K]`, v `[B,T,H,V]`, g, beta `[B,T,H]` and an optional float32 state `[B,H,K,V]`, and
return `(o [B,T,H,V] in v's dtype, final_state [B,H,K,V] float32 or None)`. Inputs may be bf16;
states and accumulation are float32 (float64 when the inputs are, under x64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.gated_delta_rule.pallas import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.pallas_recurrent import (
    RecurrentConfig,
    fused_recurrent_gated_delta_rule_pallas,
)
from pallas_kernels.gated_delta_rule.pallas_state_pass import StatePassConfig
from pallas_kernels.gated_delta_rule.reference import (
    chunk_gated_delta_rule_reference,
    naive_recurrent_gated_delta_rule,
)

# What implementation=None runs on a GPU, for both entries: the Pallas kernels; inputs they cannot
# take (float64, K or V above 256, a chunk size that is not a power of two >= 16) go to "xla".
GPU_DEFAULT = ("pallas", "xla")

__all__ = [
    "ChunkConfig",
    "RecurrentConfig",
    "StatePassConfig",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
]


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
  """Block sizes of the chunked form.

  chunk_size: tokens per chunk; any positive size is exact (T is padded to a multiple of it) for
    "xla"; "pallas" needs a power of two >= 16.
  state_pass: launch parameters of the Pallas chunk-scan kernels ("pallas" only); None picks
    them by head size (`pallas_state_pass.default_state_config`).
  """
  chunk_size: int = 64
  state_pass: StatePassConfig | None = None

  def __post_init__(self):
    if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) \
        or self.chunk_size < 1:
      raise ValueError(f"ChunkConfig.chunk_size must be a positive int, got {self.chunk_size!r}")
    if self.state_pass is not None and not isinstance(self.state_pass, StatePassConfig):
      raise ValueError(
          "ChunkConfig.state_pass must be a StatePassConfig or None, got"
          f" {type(self.state_pass).__name__}")


def _validate(op_name, q, k, v, g, beta, initial_state) -> None:
  """Raises ValueError naming the first argument whose rank, shape or dtype is wrong."""
  arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
  if initial_state is not None:
    arrays["initial_state"] = initial_state
  for name, array in arrays.items():
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
      raise ValueError(f"{op_name}: {name} must be an array, got {type(array).__name__}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
      raise ValueError(f"{op_name}: {name} must have a floating dtype, got {array.dtype}")
  expected_rank = {"q": 4, "k": 4, "v": 4, "g": 3, "beta": 3, "initial_state": 4}
  layout = {"q": "[B,T,H,K]", "k": "[B,T,H,K]", "v": "[B,T,H,V]", "g": "[B,T,H]",
            "beta": "[B,T,H]", "initial_state": "[B,H,K,V]"}
  for name, array in arrays.items():
    if array.ndim != expected_rank[name]:
      raise ValueError(
          f"{op_name}: {name} must have rank {expected_rank[name]} {layout[name]}, got shape"
          f" {tuple(array.shape)}")
  batch, seq_len, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  if seq_len < 1:
    raise ValueError(f"{op_name}: q has no tokens (T = 0), shape {tuple(q.shape)}")
  expected_shape = {
      "k": (batch, seq_len, heads, key_dim),
      "v": (batch, seq_len, heads, value_dim),
      "g": (batch, seq_len, heads),
      "beta": (batch, seq_len, heads),
      "initial_state": (batch, heads, key_dim, value_dim),
  }
  for name, shape in expected_shape.items():
    if name in arrays and tuple(arrays[name].shape) != shape:
      raise ValueError(
          f"{op_name}: {name} must have shape {layout[name]} = {shape} to match q"
          f" {tuple(q.shape)} and v {tuple(v.shape)}, got {tuple(arrays[name].shape)}")


def _chunk_xla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
               config: ChunkConfig):
  return chunk_gated_delta_rule_reference(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
      chunk_size=config.chunk_size)


def _chunk_pallas(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                  config: ChunkConfig):
  return chunk_gated_delta_rule_pallas(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
      chunk_size=config.chunk_size, state_config=config.state_pass)


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    implementation: Implementation = None,
    config: ChunkConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule over a whole sequence, chunk-parallel (FLA's `chunk_gated_delta_rule`).

  Args:
    q, k: `[B,T,H,K]` queries and keys; any T >= 1.
    v: `[B,T,H,V]` values.
    g: `[B,T,H]` natural-log decay (<= 0 for a contraction), alpha_t = exp(g_t).
    beta: `[B,T,H]` write strengths, in (0, 1) for Gated DeltaNet.
    scale: multiplies q (after normalisation); None means K**-0.5.
    initial_state: `[B,H,K,V]` state before the first token (float32), or None for zeros.
    output_final_state: also return the state after the last token.
    use_qk_l2norm: l2-normalise q and k per head inside (x / sqrt(sum x^2 + 1e-6)).
    implementation: None | "xla" | "pallas" (see `pallas_kernels.dispatch`; None: GPU_DEFAULT
      on a GPU, "xla" elsewhere).
    config: block sizes (`ChunkConfig()` when None).

  Returns:
    `(o, final_state)`: o `[B,T,H,V]` in v's dtype; final_state `[B,H,K,V]` float32 (float64 for
    float64 inputs) when `output_final_state`, else None. Differentiable in q, k, v, g, beta and
    initial_state.
  """
  _validate("chunk_gated_delta_rule", q, k, v, g, beta, initial_state)
  version = resolve("chunk_gated_delta_rule", implementation,
                    {"xla": _chunk_xla, "pallas": _chunk_pallas}, gpu_default=GPU_DEFAULT)
  return version(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
      config=ChunkConfig() if config is None else config)


def fused_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    implementation: Implementation = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule stepped token by token, for decoding (typically T = 1).

  Same arguments, shapes and results as `chunk_gated_delta_rule` (without `config`); its cost is
  T sequential steps, so use the chunked entry for long sequences.
  """
  _validate("fused_recurrent_gated_delta_rule", q, k, v, g, beta, initial_state)
  version = resolve(
      "fused_recurrent_gated_delta_rule", implementation,
      {"xla": naive_recurrent_gated_delta_rule,
       "pallas": fused_recurrent_gated_delta_rule_pallas},
      gpu_default=GPU_DEFAULT)
  return version(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
