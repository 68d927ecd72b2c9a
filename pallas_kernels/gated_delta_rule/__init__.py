"""Gated delta rule (the token mixer of Gated DeltaNet): public entries with FLA's semantics.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

`chunk_gated_delta_rule` is the training / prefill entry (chunked, parallel within chunks);
`fused_recurrent_gated_delta_rule` steps token by token, for decoding with small T. Both take
q, k `[B,T,H,K]`, v `[B,T,H,V]`, g, beta `[B,T,H]` and an optional float32 state `[B,H,K,V]`, and
return `(o [B,T,H,V] in v's dtype, final_state [B,H,K,V] float32 or None)`. Inputs may be bf16;
states and accumulation are float32 (float64 when the inputs are, under x64).

For decoding, `fused_recurrent_gated_delta_rule` also takes a state stacked over the model's layer
groups with the group to step (`group=`, `pallas_kernels.stacked`): it then reads that group's state
and writes the new one back into the stacked buffer, in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.gated_delta_rule.pallas import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta_rule.pallas_recurrent import (
    STATE_LAYOUTS,
    RecurrentConfig,
    fused_recurrent_gated_delta_rule_pallas,
)
from pallas_kernels.gated_delta_rule.pallas_state_pass import StatePassConfig
from pallas_kernels.gated_delta_rule.reference import (
    _prepare_inputs,
    as_key_value,
    chunk_gated_delta_rule_reference,
    delta_rule_output,
    delta_rule_update,
    naive_recurrent_gated_delta_rule,
)
from pallas_kernels.stacked import per_group, update_group_rows

# What implementation=None runs on a GPU, for both entries: the Pallas kernels; inputs they cannot
# take (float64, K or V above 256, a chunk size that is not a power of two >= 16) go to "xla".
GPU_DEFAULT = ("pallas", "xla")

__all__ = [
    "ChunkConfig",
    "RecurrentConfig",
    "STATE_LAYOUTS",
    "StatePassConfig",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
]


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
  """Block sizes of the chunked form.

  chunk_size: tokens per chunk; any positive size is exact (T is padded to a multiple of it) for
    "xla", which takes T itself when T is shorter; "pallas" needs a power of two >= 16.
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


def _validate(op_name, q, k, v, g, beta, initial_state, state_layout="kv") -> None:
  """Raises ValueError naming the first argument whose rank, shape or dtype is wrong (the state's
  last two axes in the order `state_layout` gives)."""
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
            "beta": "[B,T,H]", "initial_state": f"[B,H,{state_layout.upper()[0]},"
                                                    f"{state_layout.upper()[1]}]"}
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
      "initial_state": (batch, heads) + ((key_dim, value_dim) if state_layout == "kv" else
                                         (value_dim, key_dim)),
  }
  for name, shape in expected_shape.items():
    if name in arrays and tuple(arrays[name].shape) != shape:
      raise ValueError(
          f"{op_name}: {name} must have shape {layout[name]} = {shape} to match q"
          f" {tuple(q.shape)} and v {tuple(v.shape)}, got {tuple(arrays[name].shape)}")


def _chunk_xla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
               config: ChunkConfig):
  # A sequence shorter than a chunk is one chunk of its own length (exact for any size here):
  # padded to 64, T = 32 doubles the work (lalte-tiny's train step at B64 T32 on a 2-core CPU,
  # 2026-11-28: 0.26 s with chunks of 64, 0.17 s with 32).
  return chunk_gated_delta_rule_reference(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
      chunk_size=min(config.chunk_size, q.shape[1]))


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


def _recurrent_xla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm,
                   group, state_layout):
  """The reference recurrence; on a stacked state, token by token and one batch row of the group
  at a time, in place (read whole, XLA would copy the group's state out and back every step)."""
  # A "vk" state is transposed around the reference's [.., K, V] steps.
  as_kv = functools.partial(as_key_value, state_layout=state_layout)
  if group is None:
    o_BTHV, state = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=as_kv(initial_state),
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    return o_BTHV, as_kv(state)
  q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, _ = _prepare_inputs(
      q, k, v, g, beta, None, scale, use_qk_l2norm)

  def one_row(fn):  # a batched step applied to one row's state [H, K, V] and inputs
    return lambda state_HKV, *inputs: fn(state_HKV[None], *(x[None] for x in inputs))[0]

  def update(state_row, *inputs):
    return as_kv(one_row(delta_rule_update)(as_kv(state_row), *inputs))

  def output(state_row, *inputs):
    return one_row(delta_rule_output)(as_kv(state_row), *inputs)

  def token(t, carry):
    o_BTHV, state = carry
    at_t = lambda *xs: tuple(jax.lax.dynamic_index_in_dim(x, t, 1, keepdims=False) for x in xs)
    o_BHV, state = update_group_rows(
        state, group, update, at_t(k_BTHK, v_BTHV, g_BTH, beta_BTH), output, at_t(q_BTHK))
    return jax.lax.dynamic_update_index_in_dim(o_BTHV, o_BHV.astype(v.dtype), t, 1), state

  o_BTHV, state = jax.lax.fori_loop(0, q.shape[1], token,
                                    (jnp.zeros(v.shape, v.dtype), initial_state))
  return o_BTHV, state


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
    group: jax.Array | None = None,
    state_layout: str = "kv",
    implementation: Implementation = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule stepped token by token, for decoding (typically T = 1).

  Same arguments, shapes and results as `chunk_gated_delta_rule` (without `config`); its cost is
  T sequential steps, so use the chunked entry for long sequences.

  group: int32 [] layer group to step when `initial_state` is stacked over the model's layer
    groups, [G, B, H, K, V] float32: the final state returned is then that stacked array with the
    group's state replaced (in place on a donated buffer); `output_final_state` must be True.
  state_layout: "kv" (states [..., K, V], as above) or "vk" (initial and final states stored
    transposed, [..., V, K]: the Pallas kernel's tiles are then contiguous, which makes a decoding
    step read and write the state at the copy bandwidth; decode caches keep their state so).
  """
  op = "fused_recurrent_gated_delta_rule"
  if state_layout not in STATE_LAYOUTS:
    raise ValueError(f"{op}: state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
  state = initial_state
  if group is not None:
    if initial_state is None or not output_final_state:
      raise ValueError(f"{op}: group needs the stacked initial_state and output_final_state=True")
    state = per_group(op, "initial_state", initial_state, group, 4)
  _validate(op, q, k, v, g, beta, state, state_layout)
  version = resolve(
      op, implementation,
      {"xla": _recurrent_xla, "pallas": fused_recurrent_gated_delta_rule_pallas},
      gpu_default=GPU_DEFAULT)
  return version(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, group=group,
      state_layout=state_layout)
