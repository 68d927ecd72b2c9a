"""`implementation="pallas"` of `fused_recurrent_gated_delta_rule`: the token-by-token recurrence
as one Pallas (Triton backend) kernel, for decoding.

Each program of the grid (B, H, V-blocks) holds its [K, block_v] slice of the float32 state on chip
and steps through the T tokens:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q.
XLA's version runs one scan step (several small kernels) per token; here a decoding step (T = 1) is
a single launch, which also upcasts q, k and v from the caller's dtype, l2-normalises q and k
(`use_qk_l2norm`) and scales q, so no XLA pass over them precedes it. Gradients (rarely needed
for decoding) come from the float32 reference recurrence through a custom_vjp, so they are exact
rather than unavailable.

The state operand is stacked over layer groups, [G, B, H, K, V], with the group index as an int32
[1] operand, and aliased to the final state: a decoding step reads and writes its layer group's
state in the stacked buffer, in place. A plain state is padded to power-of-two K and V and stacked
as a group of one; a stacked one must already have such sizes (no copy is made to pad it).

`state_layout="vk"` takes the state stored transposed, [..., V, K]: a program's tile is then one
contiguous block_v x K block instead of K rows of block_v values at a stride of V, which reads
and writes the state at the copy bandwidth (0.99-1.03 of a copy against 0.74-0.76 for "kv" at
the 1.4b presets' decode step, B32, one H200): the layout of the decode caches' GDN state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta_rule.reference import (
    as_key_value,
    compute_dtype,
    l2_normalize,
    naive_recurrent_gated_delta_rule,
    query_scale,
)
from pallas_kernels.pallas_common import interpret_mode, next_power_of_two, triton_compiler_params
from pallas_kernels.stacked import group_operand

__all__ = ["DEFAULT_CONFIGS", "RecurrentConfig", "STATE_LAYOUTS",
           "fused_recurrent_gated_delta_rule_pallas"]

# The order of a state's last two axes: "kv" is [..., K, V]; "vk" is [..., V, K].
STATE_LAYOUTS = ("kv", "vk")


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
  """block_v: state columns per program; num_warps, num_stages: Triton launch parameters.

  The defaults were the fastest of block_v 16-128 x 1-8 warps for the decode step of lalte-1.4b
  on a "kv" state (B32, H8, K = V = 256, one H200, `tools/bench_gdn_decode.py --sweep`): 0.76 of
  the copy bandwidth against 0.71 at 4 warps and 0.65 at block_v 64; one warp spills the
  32-column tile. `DEFAULT_CONFIGS` holds each layout's fastest.
  """
  block_v: int = 32
  num_warps: int = 2
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_v", "num_warps", "num_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"RecurrentConfig.{name} must be a positive int, got {value!r}")
    if self.block_v < 16 or self.block_v & (self.block_v - 1):
      raise ValueError(f"RecurrentConfig.block_v must be a power of two >= 16, got {self.block_v}")


# Each layout's fastest config at the 1.4b presets' decode step (B32, K = V = 256, one H200,
# 2026-11-30, `tools/bench_gdn_decode.py --sweep`): "vk" at block_v 16 and one warp read and
# wrote the state at 0.99-1.03 of the copy bandwidth (block_v 32 at 2 warps: 0.87-0.91; one warp
# at block_v >= 32 spills).
DEFAULT_CONFIGS = {"kv": RecurrentConfig(), "vk": RecurrentConfig(block_v=16, num_warps=1)}


def _recurrent_kernel(group_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, h_final_ref,
                      *, seq_len, block_v, scale, use_qk_l2norm, state_layout):
  # h0_ref and h_final_ref are the whole stacked state (aliased); this program owns block_v value
  # columns of (group, row, head). q, k and v arrive in the caller's dtype: the float32 upcast,
  # q and k's l2 normalisation and q's scale happen here (reference _prepare_inputs), so a
  # decoding step runs no XLA pass over them before the kernel.
  values = pl.ds(pl.program_id(2) * block_v, block_v)
  if state_layout == "kv":
    key_axis, tile = 0, (slice(None), values)  # h [K, block_v]
  else:
    key_axis, tile = 1, (values, slice(None))  # h [block_v, K]
  state_at = (group_ref[0], pl.program_id(0), pl.program_id(1)) + tile
  # A [1, n] row vector laid along the tile's key axis (as_keys) or value axis (as_values), so
  # that it broadcasts against h; each is its own inverse for the value axis' results.
  as_keys = lambda x_1K: x_1K.T if key_axis == 0 else x_1K
  as_values = lambda x_1V: x_1V if key_axis == 0 else x_1V.T

  def prepared(ref, token):
    x_1K = ref[token, :].astype(jnp.float32)
    if use_qk_l2norm:
      x_1K = l2_normalize(x_1K)
    return x_1K

  def step(t, h):
    token = pl.ds(t, 1)
    q_keys = as_keys(prepared(q_ref, token) * scale)
    k_keys = as_keys(prepared(k_ref, token))
    h = jnp.exp(g_ref[t]) * h
    predicted = jnp.sum(k_keys * h, axis=key_axis, keepdims=True)
    update = beta_ref[t] * (as_values(v_ref[token, :].astype(jnp.float32)) - predicted)
    h = h + k_keys * update
    o_1V = as_values(jnp.sum(q_keys * h, axis=key_axis, keepdims=True))
    o_ref[token, :] = o_1V.astype(o_ref.dtype)
    return h

  h_final_ref[state_at] = jax.lax.fori_loop(0, seq_len, step, h0_ref[state_at])


def _padded_dims(key_dim: int, value_dim: int) -> tuple[int, int]:
  return next_power_of_two(key_dim), next_power_of_two(value_dim)


def _key_value_axes(state_layout: str) -> tuple[int, int]:
  """The axes of K and V in a state of this layout."""
  return (-2, -1) if state_layout == "kv" else (-1, -2)


def _forward(q, k, v, g, beta, state_GBHKV, group, scale, use_qk_l2norm, config, state_layout):
  """(o [B, T, H, V], the stacked final state) for a stacked state of power-of-two K and V, laid
  out as `state_layout` says."""
  # q, k and v go in as they come: the kernel upcasts, normalises and scales them.
  g_BTH, beta_BTH = g.astype(jnp.float32), beta.astype(jnp.float32)
  batch, seq_len, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  key_axis, value_axis = _key_value_axes(state_layout)
  padded_k, padded_v = state_GBHKV.shape[key_axis], state_GBHKV.shape[value_axis]
  block_v = min(config.block_v, padded_v)
  pad_last = lambda x, width: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
  q_BTHK = pad_last(q, padded_k)
  k_BTHK = pad_last(k, padded_k)
  v_BTHV = pad_last(v, padded_v)
  token_spec = lambda width, index: pl.BlockSpec((None, seq_len, None, width), index)
  gate_spec = pl.BlockSpec((None, None, seq_len), lambda b, h, j: (b, h, 0))
  o_BTHV, final_state_GBHKV = pl.pallas_call(
      functools.partial(_recurrent_kernel, seq_len=seq_len, block_v=block_v,
                        scale=query_scale(scale, key_dim), use_qk_l2norm=use_qk_l2norm,
                        state_layout=state_layout),
      grid=(batch, heads, padded_v // block_v),
      in_specs=[pl.no_block_spec,
                token_spec(padded_k, lambda b, h, j: (b, 0, h, 0)),
                token_spec(padded_k, lambda b, h, j: (b, 0, h, 0)),
                token_spec(block_v, lambda b, h, j: (b, 0, h, j)),
                gate_spec, gate_spec, pl.no_block_spec],
      out_specs=[token_spec(block_v, lambda b, h, j: (b, 0, h, j)), pl.no_block_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, seq_len, heads, padded_v), v.dtype),
                 jax.ShapeDtypeStruct(state_GBHKV.shape, jnp.float32)],
      input_output_aliases={6: 1},
      compiler_params=triton_compiler_params(config.num_warps, config.num_stages),
      interpret=interpret_mode(),
      name="gdn_fused_recurrent",
  )(group_operand(group), q_BTHK, k_BTHK, v_BTHV, jnp.transpose(g_BTH, (0, 2, 1)),
    jnp.transpose(beta_BTH, (0, 2, 1)), state_GBHKV.astype(jnp.float32))
  return o_BTHV[..., :value_dim], final_state_GBHKV


def _plain_forward(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config, state_layout):
  """`_forward` for a plain [B, H, K, V] (or [B, H, V, K]) state: padded and stacked as a group of
  one."""
  key_axis, value_axis = _key_value_axes(state_layout)
  key_dim, value_dim = initial_state.shape[key_axis], initial_state.shape[value_axis]
  padded_k, padded_v = _padded_dims(key_dim, value_dim)
  padding = [(0, 0)] * 4
  padding[key_axis], padding[value_axis] = (0, padded_k - key_dim), (0, padded_v - value_dim)
  state_1BHKV = jnp.pad(initial_state.astype(jnp.float32), padding)[None]
  o_BTHV, final_state = _forward(q, k, v, g, beta, state_1BHKV, jnp.zeros((), jnp.int32), scale,
                                 use_qk_l2norm, config, state_layout)
  return o_BTHV, final_state[0, :, :, :initial_state.shape[-2], :initial_state.shape[-1]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _fused_recurrent(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config, state_layout):
  return _plain_forward(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config,
                        state_layout)


def _fused_recurrent_fwd(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config,
                         state_layout):
  outputs = _plain_forward(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config,
                           state_layout)
  return outputs, (q, k, v, g, beta, initial_state)


def _fused_recurrent_bwd(scale, use_qk_l2norm, config, state_layout, residuals, cotangents):
  del config
  as_kv = functools.partial(as_key_value, state_layout=state_layout)

  def reference(*args):
    o, state = naive_recurrent_gated_delta_rule(
        *args[:5], scale=scale, initial_state=as_kv(args[5]), output_final_state=True,
        use_qk_l2norm=use_qk_l2norm)
    return o, as_kv(state)
  _, vjp = jax.vjp(reference, *residuals)
  return vjp(cotangents)


_fused_recurrent.defvjp(_fused_recurrent_fwd, _fused_recurrent_bwd)


def fused_recurrent_gated_delta_rule_pallas(q, k, v, g, beta, *, scale, initial_state,
                                            output_final_state, use_qk_l2norm, group=None,
                                            state_layout: str = "kv",
                                            config: RecurrentConfig | None = None):
  """Same contract as `fused_recurrent_gated_delta_rule` (inputs validated there)."""
  dtype = compute_dtype(q, k, v, g, beta, initial_state)
  if dtype != jnp.float32:
    raise NotImplementedError(
        f"fused_recurrent_gated_delta_rule(implementation='pallas'): compute dtype {dtype}; the"
        " Triton kernel computes in float32 (use implementation='xla')")
  config = DEFAULT_CONFIGS[state_layout] if config is None else config
  if group is not None:
    key_dim, value_dim = initial_state.shape[-2:]
    if _padded_dims(key_dim, value_dim) != (key_dim, value_dim):
      raise NotImplementedError(
          f"fused_recurrent_gated_delta_rule(implementation='pallas'): a stacked state needs"
          f" power-of-two K and V >= 16 (it is updated in place, not padded), got {key_dim},"
          f" {value_dim}")
    return _forward(q, k, v, g, beta, initial_state, group, scale, use_qk_l2norm, config,
                    state_layout)
  if initial_state is None:
    batch, _, heads, key_dim = q.shape
    shape = (batch, heads) + ((key_dim, v.shape[3]) if state_layout == "kv" else
                              (v.shape[3], key_dim))
    initial_state = jnp.zeros(shape, jnp.float32)
  o, final_state = _fused_recurrent(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, config,
                                    state_layout)
  return o, (final_state if output_final_state else None)
