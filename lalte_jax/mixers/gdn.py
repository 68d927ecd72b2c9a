"""Gated DeltaNet mixer (§2, FLA's GatedDeltaNet layer with use_gate and short conv).

x -> q, k, v (projection, causal depthwise conv 4, SiLU), beta = sigmoid(b_proj x),
g = -exp(A_log) * softplus(a_proj x + dt_bias) (natural-log decay, float32), the gated delta rule
with q/k l2-normalised inside the kernel, then a per-head RMSNorm gated by SiLU(g_proj x), o_proj.

Decoding carries the cache `GDNCache`: rings of the last `conv_size` conv inputs of q, k and v and
the float32 recurrent state, stored transposed ([B, H, V, K]: the decode kernel's tiles are then
contiguous). `prefill` runs the chunked rule over the prompt and fills the cache;
`decode` steps one token on the layer group's part of the stacked cache (`GroupSlot` leaves),
in place. A layer prepared by `fuse_decode_projections` (as `inference.stack.split_groups`
prepares the GPU's layer groups) decodes with its six input projections (q, k, v, g, a, b) as one
GEMM. Left pads leave the state unchanged (and give zero conv inputs), so a padded row ends in the
state of its unpadded prompt.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes

from lalte_jax.config import ModelConfig
from lalte_jax.inference import chunking
from lalte_jax.inference.caches import GDNCache, StepContext, ring_from_tail
from lalte_jax.layers.norms import gated_rms_norm
from lalte_jax.layers.short_conv import ShortConv
from lalte_jax.mixers.projections import input_projection, output_projection
from lalte_jax.sharding import per_shard
from pallas_kernels.gated_delta_rule import (ChunkConfig, chunk_gated_delta_rule,
                                             fused_recurrent_gated_delta_rule)

# The input projections, in the order of their columns in `decode_input_kernel`.
INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")


def init_a_log(key: jax.Array, num_heads: int) -> jax.Array:
  """A ~ U(0, 16), A_log = log A (§1.4; G18: the intended init, not the reference's meta-device
  leftovers). A is kept away from exactly 0 so that A_log is finite."""
  a = jax.random.uniform(key, (num_heads,), jnp.float32, minval=0.0, maxval=16.0)
  return jnp.log(jnp.maximum(a, 1e-6))


def init_dt_bias(key: jax.Array, num_heads: int) -> jax.Array:
  """dt = exp(U(log 1e-3, log 1e-1)) clamped >= 1e-4; dt_bias = softplus^-1(dt) (§1.4)."""
  log_dt = jax.random.uniform(key, (num_heads,), jnp.float32, minval=math.log(1e-3),
                              maxval=math.log(1e-1))
  dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
  return dt + jnp.log(-jnp.expm1(-dt))


class GatedDeltaNet(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    gdn = config.gdn
    self.config = config
    hidden = config.hidden_size
    key_dim = gdn.num_heads * gdn.head_dim
    value_dim = gdn.num_heads * gdn.value_dim
    self.q_proj = input_projection(config, hidden, key_dim, rngs)
    self.k_proj = input_projection(config, hidden, key_dim, rngs)
    self.v_proj = input_projection(config, hidden, value_dim, rngs)
    self.g_proj = input_projection(config, hidden, value_dim, rngs)
    self.a_proj = input_projection(config, hidden, gdn.num_heads, rngs)
    self.b_proj = input_projection(config, hidden, gdn.num_heads, rngs)
    short_conv = functools.partial(ShortConv, kernel_size=gdn.conv_size,
                                   init_std=config.init_std, rngs=rngs,
                                   implementation=gdn.implementation)
    self.q_conv = short_conv(key_dim)
    self.k_conv = short_conv(key_dim)
    self.v_conv = short_conv(value_dim)
    self.A_log = nnx.Param(init_a_log(rngs.params(), gdn.num_heads))
    self.dt_bias = nnx.Param(init_dt_bias(rngs.params(), gdn.num_heads))
    # One RMSNorm weight over d_v, shared by all heads.
    self.o_norm_weight = nnx.Param(jnp.ones((gdn.value_dim,), jnp.float32))
    self.o_proj = output_projection(config, value_dim, rngs)

  # The named scopes name the kernels in profiles (tools/step_profile.py); `gates` and `output`
  # hold them too, so that their projections count with them.
  @jax.named_scope("gdn_gates")
  def gates(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(g, beta), each [B, T, H] float32."""
    return self.gates_from(self.a_proj(x_BTD), self.b_proj(x_BTD))

  @jax.named_scope("gdn_gates")
  def gates_from(self, a_BTH: jax.Array, b_BTH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(g, beta), each [B, T, H] float32, from the projections a_proj x and b_proj x."""
    beta_BTH = jax.nn.sigmoid(b_BTH.astype(jnp.float32))
    g_BTH = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a_BTH.astype(jnp.float32)
                                                        + self.dt_bias[...])
    return g_BTH, beta_BTH

  @jax.named_scope("gdn_output")
  def output(self, o_BTHV: jax.Array, x_BTD: jax.Array) -> jax.Array:
    """Gated per-head RMSNorm, then o_proj."""
    return self.output_from(o_BTHV, self.g_proj(x_BTD))

  @jax.named_scope("gdn_output")
  def output_from(self, o_BTHV: jax.Array, gate_BTC: jax.Array) -> jax.Array:
    """Per-head RMSNorm gated by SiLU of the projection g_proj x [B, T, value_dim], then
    o_proj."""
    gdn = self.config.gdn
    batch, length = gate_BTC.shape[:2]
    gate_BTHV = gate_BTC.reshape(batch, length, gdn.num_heads, gdn.value_dim)
    gated = gated_rms_norm(o_BTHV, gate_BTHV, self.o_norm_weight[...],
                           gdn.norm_eps).astype(gate_BTC.dtype)
    return self.o_proj(gated.reshape(batch, length, -1))

  @property
  def decode_only(self) -> bool:
    """Whether `fuse_decode_projections` has replaced the input projections by their fused
    kernel (the layer then only decodes)."""
    return hasattr(self, "decode_in_kernel")

  def _check_not_decode_only(self, what: str) -> None:
    if self.decode_only:
      raise RuntimeError(
          f"GatedDeltaNet.{what}: this layer was prepared by fuse_decode_projections, which"
          " replaced its q/k/v/g/a/b projections by one decode_in_kernel, so it only decodes;"
          f" run {what} on the unprepared layer")

  def input_widths(self) -> tuple[int, ...]:
    """The output widths of the input projections, in the order of INPUT_PROJECTIONS."""
    gdn = self.config.gdn
    key_dim = gdn.num_heads * gdn.head_dim
    value_dim = gdn.num_heads * gdn.value_dim
    return key_dim, key_dim, value_dim, value_dim, gdn.num_heads, gdn.num_heads

  def decode_input_kernel(self) -> jax.Array:
    """[hidden, sum of input_widths()]: the kernels of INPUT_PROJECTIONS side by side, which a
    decode step of a prepared layer reads in one GEMM (a step is bound by reading weights and by
    kernel launches). The stored `decode_in_kernel` once `fuse_decode_projections` has run; else
    concatenated here, a copy of the weights."""
    if self.decode_only:
      return self.decode_in_kernel[...]
    # The last axis: a model's layer groups hold their kernels stacked, [groups, hidden, width].
    return jnp.concatenate([getattr(self, name).kernel[...] for name in INPUT_PROJECTIONS],
                           axis=-1)

  def fuse_decode_projections(self) -> None:
    """Prepares the layer for decoding: stores `decode_input_kernel()` as the parameter
    `decode_in_kernel` and removes the six projections it replaces, so the weights are held once.
    The prepared layer only decodes (`__call__` and `prefill` raise). Idempotent."""
    if self.decode_only:
      return
    self.decode_in_kernel = nnx.Param(self.decode_input_kernel())
    for name in INPUT_PROJECTIONS:
      delattr(self, name)

  def _decode_projections(self, x_B1D: jax.Array) -> tuple[jax.Array, ...]:
    """The token through each input projection, [B, 1, width] in the order of INPUT_PROJECTIONS.
    Prepared, one GEMM with the fused kernel, promoted and contracted as nnx.Linear does, then
    split; unprepared (the CPU's rolled group scan, single layers), the six projections, which
    read their kernels where they are: concatenating the kernels there would copy them every
    step."""
    if not self.decode_only:
      return tuple(getattr(self, name)(x_B1D) for name in INPUT_PROJECTIONS)
    x_B1D, kernel_DN = dtypes.promote_dtype((x_B1D, self.decode_input_kernel()),
                                            dtype=self.config.compute_dtype)
    y_B1N = jax.lax.dot_general(x_B1D, kernel_DN, (((2,), (0,)), ((), ())))
    return tuple(jnp.split(y_B1N, np.cumsum(self.input_widths())[:-1], axis=-1))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    self._check_not_decode_only("__call__")
    gdn = self.config.gdn
    batch, length = x_BTD.shape[:2]
    heads = (batch, length, gdn.num_heads)
    q_BTHK = self.q_conv(self.q_proj(x_BTD)).reshape(*heads, gdn.head_dim)
    k_BTHK = self.k_conv(self.k_proj(x_BTD)).reshape(*heads, gdn.head_dim)
    v_BTHV = self.v_conv(self.v_proj(x_BTD)).reshape(*heads, gdn.value_dim)
    g_BTH, beta_BTH = self.gates(x_BTD)
    chunk_config = ChunkConfig(chunk_size=gdn.chunk_size)

    def delta_rule(q, k, v, g, beta):
      return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True,
                                    implementation=gdn.implementation, config=chunk_config)[0]

    o_BTHV = per_shard(delta_rule, q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)
    return self.output(o_BTHV, x_BTD)

  @staticmethod
  def _conv_inputs(projected: tuple, ctx: StepContext) -> tuple[jax.Array, ...]:
    """The pre-activation q, k, v projections [B, T, C] as the short convs read them: zeros at
    pads, which are exactly the zero padding of an unpadded row."""
    valid_BT1 = ctx.valid_BT[:, :, None]
    return tuple(jnp.where(valid_BT1, y_BTC, 0) for y_BTC in projected)

  def _rule_inputs(self, convolved: tuple, gates: tuple, ctx: StepContext) -> tuple:
    """q, k, v, g, beta of the gated delta rule from the conv outputs [B, T, C] and the gates
    (g, beta) [B, T, H]."""
    gdn = self.config.gdn
    batch, length = convolved[0].shape[:2]
    q_BTHK, k_BTHK, v_BTHV = (
        y_BTC.reshape(batch, length, gdn.num_heads, dim)
        for y_BTC, dim in zip(convolved, (gdn.head_dim, gdn.head_dim, gdn.value_dim)))
    g_BTH, beta_BTH = gates
    # g = 0 (no decay) and beta = 0 (no write) make a pad an identity step of the recurrence.
    valid_BT1 = ctx.valid_BT[:, :, None]
    return (q_BTHK, k_BTHK, v_BTHV, jnp.where(valid_BT1, g_BTH, 0.0),
            jnp.where(valid_BT1, beta_BTH, 0.0))

  def prefill(self, h_BTD: jax.Array, norm, cache: GDNCache, ctx: StepContext
              ) -> tuple[jax.Array, GDNCache]:
    """h + GDN(norm(h)) over a left-padded prompt of T >= 1 tokens (h: the block's residual
    stream, `norm` its pre-mixer RMSNorm) and the cache after it (the cache's conv rings on entry
    are ignored: a prompt starts a sequence). With `ctx.chunk_tokens` the layer runs chunk by
    chunk (`chunking.chunk_loop`), carrying the recurrent state and the last `conv_size` conv
    inputs, normalising each chunk's h and adding its output in place: the one-piece computation,
    in pieces, with no normalised copy or output of the whole prompt."""
    self._check_not_decode_only("prefill")
    gdn = self.config.gdn
    batch, length = h_BTD.shape[:2]
    channels = (gdn.num_heads * gdn.head_dim,) * 2 + (gdn.num_heads * gdn.value_dim,)
    tails = tuple(jnp.zeros((batch, gdn.conv_size, width), h_BTD.dtype) for width in channels)
    state_BHKV = jnp.swapaxes(cache.state_BHVK, -1, -2)
    if ctx.chunk_tokens is None or length <= ctx.chunk_tokens:
      (state_BHKV, tails), out_BTD = self._prefill_span(norm(h_BTD), (state_BHKV, tails), ctx)
      h_BTD = h_BTD + out_BTD
    else:
      def body(start, size, carry):
        span_carry, h_BTD = carry
        h_BCD, valid_BC = (jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)
                           for a in (h_BTD, ctx.valid_BT))
        span_carry, out_BCD = self._prefill_span(norm(h_BCD), span_carry,
                                                 ctx.replace(valid_BT=valid_BC))
        return span_carry, jax.lax.dynamic_update_slice_in_dim(h_BTD, h_BCD + out_BCD, start,
                                                               axis=1)

      (state_BHKV, tails), h_BTD = chunking.chunk_loop(
          body, ((state_BHKV, tails), h_BTD), length, ctx.chunk_tokens)
    rings = tuple(ring_from_tail(tail_BRC, length) for tail_BRC in tails)
    # One transposition of the state per prompt, for the decode kernel's layout (lalte-1.4b's
    # prefill of 32 x 4096 tokens: 193,911 tokens/s with it, 193,584-194,745 before, one H200).
    state_BHVK = jnp.swapaxes(state_BHKV, -1, -2).astype(jnp.float32)
    return h_BTD, GDNCache(*rings, state_BHVK=state_BHVK)

  def _prefill_span(self, x_BTD: jax.Array, carry: tuple, ctx: StepContext) -> tuple:
    """The layer over one span of the prompt: (state, last conv_size conv inputs of q, k, v) ->
    ((the same after the span), output [B, T, hidden])."""
    gdn = self.config.gdn
    state_BHKV, tails = carry
    inputs = self._conv_inputs((self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)),
                               ctx)
    convolved = [conv(x_BTC, tail_BRC[:, 1:])
                 for conv, x_BTC, tail_BRC in zip((self.q_conv, self.k_conv, self.v_conv), inputs,
                                                  tails)]
    if x_BTD.shape[1] == 1:
      kernel = fused_recurrent_gated_delta_rule
    else:
      kernel = functools.partial(chunk_gated_delta_rule,
                                 config=ChunkConfig(chunk_size=gdn.chunk_size))
    o_BTHV, state_BHKV = kernel(*self._rule_inputs(convolved, self.gates(x_BTD), ctx),
                                initial_state=state_BHKV, output_final_state=True,
                                use_qk_l2norm=True, implementation=gdn.implementation)
    tails = tuple(jnp.concatenate([tail_BRC, x_BTC], axis=1)[:, -gdn.conv_size:]
                  for tail_BRC, x_BTC in zip(tails, inputs))
    return (state_BHKV.astype(jnp.float32), tails), self.output(o_BTHV, x_BTD)

  def decode(self, x_B1D: jax.Array, cache: GDNCache, ctx: StepContext
             ) -> tuple[jax.Array, GDNCache]:
    """One token per row at padded index ctx.position, on the layer group's part of the stacked
    cache (`GroupSlot` leaves), in place: the token's conv inputs go into the rings' oldest slot,
    the convs then read the rings, and the recurrent state is stepped in the stacked buffer.
    A layer prepared by `fuse_decode_projections` runs its input projections as one GEMM."""
    gdn = self.config.gdn
    q_B1C, k_B1C, v_B1C, gate_B1C, a_B1H, b_B1H = self._decode_projections(x_B1D)
    inputs = self._conv_inputs((q_B1C, k_B1C, v_B1C), ctx)
    rings = [slot.write(x_B1C, (0, ctx.position % gdn.conv_size))
             for slot, x_B1C in zip((cache.conv_q_BKC, cache.conv_k_BKC, cache.conv_v_BKC),
                                    inputs)]
    # The rings hold inputs p - conv_size + 1 .. p; rolled oldest first, all but p are the state.
    oldest = (ctx.position + 1) % gdn.conv_size
    convolved = [conv(x_B1C, jnp.roll(ring.read(), -oldest, axis=1)[:, :-1])
                 for conv, x_B1C, ring in zip((self.q_conv, self.k_conv, self.v_conv), inputs,
                                              rings)]
    state = cache.state_BHVK
    o_B1HV, stacked_state = fused_recurrent_gated_delta_rule(
        *self._rule_inputs(convolved, self.gates_from(a_B1H, b_B1H), ctx),
        initial_state=state.stacked, output_final_state=True, use_qk_l2norm=True,
        group=state.group, state_layout="vk", implementation=gdn.implementation)
    return (self.output_from(o_B1HV, gate_B1C),
            GDNCache(*rings, state.replace(stacked=stacked_state)))
