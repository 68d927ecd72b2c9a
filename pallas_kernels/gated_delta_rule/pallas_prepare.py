"""Step (a) of the chunked gated delta rule as Pallas (Triton) kernels, one program per chunk.

`prepare_chunks` returns what `xla_prepare.prepare_scan_inputs` returns, without the initial
state. Per batch row, head and chunk of C tokens (G = in-chunk cumulative log-decay, e = exp(G),
Dm_ij = exp(G_i - G_j) for j <= i, beta on the diagonal of B):

    A = B (strict_lower(Dm) ⊙ k k^T),  X = (I + A)^-1
    w = X diag(beta e) k,  u = X diag(beta) v,  kd = diag(exp(G_C - G)) k,  qg = diag(e) q,
    p = (q k^T) ⊙ Dm,  chunk decay = exp(G_C)

Three kernels: `attention_kernel` reads the chunk's q, k from the public `[B,T,H,*]` layout (no
transposed copies), normalises them and writes A (float32) and kd, qg, p in the scan's head-major
layouts; the blockwise chunk inverse of pallas_inverse.py turns A into X; `wy_kernel` reads k, v
again and writes w, u. The XLA preparation runs the same steps as separate XLA programs over
head-major copies of q, k, v, with every [C, C] intermediate in memory.

The backward mirrors this split (pallas_prepare_kernels.py): `wy_backward_kernel` takes the
cotangents of w and u back through X (the forward's residual) to A, and
`attention_backward_kernel` adds those of kd, qg and p and runs the l2norm's backward, writing
dq, dk, dv in the public layout. (A first hand-written backward, one fused kernel after an
in-kernel row-by-row inverse, measured 13.5 ms against ~4 ms for XLA's forward + backward on one
H100 at B8 T4096 H8 K=V=128, 2026-11-22; the XLA preparation's forward +
autodiff measured 9.2-9.7 ms of a 13.4-14.1 ms GDN forward + backward at B4 T4096 H64.) The chunk
decay is one sum per chunk and stays in XLA (a Triton program cannot store one scalar).

Precision as in pallas.py: float32 inputs use full-precision float32 dots; otherwise q, k, v and
the outputs are bf16 with bf16 dot operands and float32 accumulation, the decays and A stay
float32, and the inverse runs in float32 with TF32 dots and stores X in bf16 (its consumers'
dots take bf16 operands), as FLA's preparation does.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta_rule.pallas_inverse import inverse_forward
from pallas_kernels.gated_delta_rule.pallas_prepare_kernels import (
    attention_backward_kernel,
    attention_kernel,
    wy_backward_kernel,
    wy_kernel,
)
from pallas_kernels.gated_delta_rule.reference import query_scale
from pallas_kernels.gated_delta_rule.xla_prepare import uses_exact_matmuls
from pallas_kernels.pallas_common import (
    check_launch_fields, interpret_mode, next_power_of_two, triton_compiler_params)

__all__ = ["PrepareConfig", "prepare_chunks"]


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
  """Triton launch parameters of the per-chunk kernels (the inverse uses one warp).

  Forward defaults: the fastest of warps 2/4/8 x stages 1/2 at 3 of the 4 shapes of compare_fla on
  one H100 (2026-11-22, docs/benchmarks.md); at B4 T4096 H64 one stage measured 2% faster (2.64 /
  2.70 ms). 4 warps spill at K = 256 (3.45 against 1.34 ms) and 2 warps everywhere (up to 20x
  slower). Backward (no loops, so no stages), 2026-11-23 on an H100, 4 / 8 warps: the first kernel
  2.6 / 3.7 ms at B4 T4096 H64 and 1.7 / 1.9 at B8 T4096 H8 K=V=256; the second 5.2 / 2.4 and
  7.6 / 1.5 (it spills at 4).
  """
  num_warps: int = 8
  num_stages: int = 2
  wy_backward_num_warps: int = 4
  attention_backward_num_warps: int = 8

  def __post_init__(self):
    check_launch_fields(self)


def _specs(q, v, chunk_size):
  """BlockSpecs of the grid (N, B, H): one chunk of one head of one batch row per program."""
  key_dim, value_dim = q.shape[-1], v.shape[-1]
  public = lambda dim: pl.BlockSpec((None, chunk_size, None, dim), lambda n, b, h: (b, n, h, 0))
  head_major = lambda dim: pl.BlockSpec((None, None, chunk_size, dim),
                                        lambda n, b, h: (b, h, n, 0))
  return {"public_k": public(key_dim), "public_v": public(value_dim),
          "token": pl.BlockSpec((None, None, chunk_size), lambda n, b, h: (b, h, n)),
          "k": head_major(key_dim), "v": head_major(value_dim), "c": head_major(chunk_size)}


def _forward(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size, exact, config):
  """w, u, kd, qg, p and the inverse X (the backward's residual; bf16 unless exact) from padded
  q, k, v `[B,Tp,H,*]` and head-major g, beta `[B,H,Tp]`."""
  batch, padded_len, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  store_dtype = jnp.float32 if exact else jnp.bfloat16
  specs = _specs(q, v, chunk_size)
  head_major = lambda dim, dtype: jax.ShapeDtypeStruct((batch, heads, padded_len, dim), dtype)
  call = _launcher(padded_len, batch, heads, chunk_size, config)
  a, kd, qg, p = call(
      functools.partial(attention_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm,
                        chunk_size=chunk_size, exact=exact),
      in_specs=[specs["public_k"], specs["public_k"], specs["token"], specs["token"]],
      out_specs=[specs["c"], specs["k"], specs["k"], specs["c"]],
      out_shape=[head_major(chunk_size, jnp.float32), head_major(key_dim, store_dtype),
                 head_major(key_dim, store_dtype), head_major(chunk_size, store_dtype)],
      name="gdn_prepare_attention",
  )(q, k, g, beta)
  x = inverse_forward(a.reshape(-1, chunk_size, chunk_size), exact=exact).reshape(a.shape)
  w, u = call(
      functools.partial(wy_kernel, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                        exact=exact),
      in_specs=[specs["public_k"], specs["public_v"], specs["token"], specs["token"], specs["c"]],
      out_specs=[specs["k"], specs["v"]],
      out_shape=[head_major(key_dim, store_dtype), head_major(value_dim, store_dtype)],
      name="gdn_prepare_wy",
  )(k, v, g, beta, x)
  return w, u, kd, qg, p, x


def _backward(q, k, v, g, beta, x, dw, du, dkd, dqg, dp, *, scale, use_qk_l2norm, chunk_size,
              exact, config):
  """dq, dk, dv `[B,Tp,H,*]` (the dtypes of q, k, v) and dg, dbeta `[B,H,Tp]` (float32; dg
  without the chunk decay's term) from the forward's inputs, X and the cotangents of w, u, kd,
  qg and p."""
  static = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, exact=exact, config=config)
  dv, dk_wy, dbeta, dcum_wy = wy_backward(k, v, g, beta, x, dw, du, **static)
  dq, dk, dg = attention_backward(q, k, g, dkd, dqg, dp, dk_wy, dcum_wy, scale=scale, **static)
  return dq, dk, dv, dg, dbeta


def wy_backward(k, v, g, beta, x, dw, du, *, use_qk_l2norm, chunk_size, exact, config):
  """The first backward kernel: dv, the partial dk (float32; it crosses to the second kernel in
  float32 because the l2norm's backward subtracts its projection on k, which would amplify a
  bf16 rounding), dbeta and the partial dG."""
  batch, padded_len, heads, _ = k.shape
  specs = _specs(k, v, chunk_size)
  token = jax.ShapeDtypeStruct((batch, heads, padded_len), jnp.float32)
  return _launcher(padded_len, batch, heads, chunk_size, config,
                   config.wy_backward_num_warps)(
      functools.partial(wy_backward_kernel, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                        exact=exact),
      in_specs=[specs["public_k"], specs["public_v"], specs["token"], specs["token"], specs["c"],
                specs["k"], specs["v"]],
      out_specs=[specs["public_v"], specs["public_k"], specs["token"], specs["token"]],
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(k.shape, jnp.float32), token, token],
      name="gdn_prepare_wy_backward",
  )(k, v, g, beta, x, dw, du)


def attention_backward(q, k, g, dkd, dqg, dp, dk_wy, dcum_wy, *, scale, use_qk_l2norm,
                       chunk_size, exact, config):
  """The second backward kernel: dq, dk and dg (without the chunk decay's term)."""
  batch, padded_len, heads, _ = q.shape
  specs = _specs(q, q, chunk_size)
  return _launcher(padded_len, batch, heads, chunk_size, config,
                   config.attention_backward_num_warps)(
      functools.partial(attention_backward_kernel, scale=scale, use_qk_l2norm=use_qk_l2norm,
                        chunk_size=chunk_size, exact=exact),
      in_specs=[specs["public_k"], specs["public_k"], specs["token"], specs["k"], specs["k"],
                specs["c"], specs["public_k"], specs["token"]],
      out_specs=[specs["public_k"], specs["public_k"], specs["token"]],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct((batch, heads, padded_len), jnp.float32)],
      name="gdn_prepare_attention_backward",
  )(q, k, g, dkd, dqg, dp, dk_wy, dcum_wy)


def _launcher(padded_len, batch, heads, chunk_size, config, num_warps=None):
  """pallas_call over the grid (N, B, H) with the config's launch parameters (the forward's
  warps unless given)."""
  num_warps = config.num_warps if num_warps is None else num_warps
  return functools.partial(pl.pallas_call, grid=(padded_len // chunk_size, batch, heads),
                           compiler_params=triton_compiler_params(num_warps, config.num_stages),
                           interpret=interpret_mode())


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How the caller's q, k, v, g, beta become the kernels' inputs, and gradients go back."""
  seq_len: int
  chunk_size: int
  key_dim: int
  value_dim: int
  scale: float

  @classmethod
  def of(cls, q, v, scale, chunk_size):
    key_dim = q.shape[3]
    return cls(seq_len=q.shape[1], chunk_size=chunk_size, key_dim=key_dim, value_dim=v.shape[3],
               scale=query_scale(scale, key_dim))

  @property
  def padded_k(self):
    return next_power_of_two(self.key_dim)

  @property
  def padded_v(self):
    return next_power_of_two(self.value_dim)

  @property
  def num_chunks(self):
    return -(-self.seq_len // self.chunk_size)

  @property
  def pad_t(self):
    return self.num_chunks * self.chunk_size - self.seq_len

  def padded(self, q, k, v):
    """q, k, v `[B,T,H,D]` zero-padded to `[B,Tp,H,Dp]` (copies only where needed)."""
    def pad(x, width):
      if self.pad_t == 0 and width == x.shape[-1]:
        return x
      return jnp.pad(x, [(0, 0), (0, self.pad_t), (0, 0), (0, width - x.shape[-1])])
    return pad(q, self.padded_k), pad(k, self.padded_k), pad(v, self.padded_v)

  def unpadded(self, dq, dk, dv):
    """The inverse of `padded`: `[B,Tp,H,Dp]` -> `[B,T,H,D]`."""
    return (dq[:, :self.seq_len, :, :self.key_dim], dk[:, :self.seq_len, :, :self.key_dim],
            dv[:, :self.seq_len, :, :self.value_dim])

  def token_major(self, x_BTH):
    """`[B,T,H]` -> float32 `[B,H,Tp]` (a (C,) block with stride H is not a Triton block)."""
    return jnp.pad(jnp.swapaxes(x_BTH.astype(jnp.float32), 1, 2),
                   [(0, 0), (0, 0), (0, self.pad_t)])

  def public(self, x_BHT, like_BTH):
    return jnp.swapaxes(x_BHT[:, :, :self.seq_len], 1, 2).astype(like_BTH.dtype)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, config):
  """The forward, and the residuals of the backward."""
  _check(chunk_size, scale)
  layout = _Layout.of(q, v, scale, chunk_size)
  # Padding tokens (g = beta = 0, zero q, k, v) leave the state unchanged, as in the reference.
  g_BHT = layout.token_major(g)
  w, u, kd, qg, p, x = _forward(
      *layout.padded(q, k, v), g_BHT, layout.token_major(beta), scale=layout.scale,
      use_qk_l2norm=bool(use_qk_l2norm), chunk_size=chunk_size,
      exact=uses_exact_matmuls(q, k, v), config=config or PrepareConfig())
  batch, heads = g_BHT.shape[:2]
  chunk_decay_BHN = jnp.exp(jnp.sum(g_BHT.reshape(batch, heads, layout.num_chunks, chunk_size),
                                    axis=-1))
  return (w, u, kd, qg, p, chunk_decay_BHN), (q, k, v, g, beta, x, chunk_decay_BHN)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm: bool, chunk_size: int,
                   config: PrepareConfig | None = None):
  """Step (a) by the kernels: (w, u, kd, qg, p `[B,H,Tp,*]` in the store dtype, chunk decay
  `[B,H,N]` f32); differentiable, by the backward kernels.

  q, k `[B,T,H,K]`, v `[B,T,H,V]`, g, beta `[B,T,H]` (float32 or bf16; the caller checks that the
  compute dtype is float32); scale None means K**-0.5. T is zero-padded to Tp = N * C and K, V to
  powers of two >= 16 (only when needed), as `prepare_scan_inputs` does.
  """
  return _prepare(q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, config)[0]


def _prepare_chunks_bwd(scale, use_qk_l2norm, chunk_size, config, residuals, cotangents):
  q, k, v, g, beta, x, chunk_decay_BHN = residuals
  dw, du, dkd, dqg, dp, dchunk_decay_BHN = cotangents
  layout = _Layout.of(q, v, scale, chunk_size)
  dq, dk, dv, dg_BHT, dbeta_BHT = _backward(
      *layout.padded(q, k, v), layout.token_major(g), layout.token_major(beta), x, dw, du, dkd,
      dqg, dp, scale=layout.scale, use_qk_l2norm=bool(use_qk_l2norm), chunk_size=chunk_size,
      exact=uses_exact_matmuls(q, k, v), config=config or PrepareConfig())
  # chunk decay = exp(sum of the chunk's g): each g of the chunk gets d(decay) * decay.
  dg_BHT = dg_BHT + jnp.repeat(dchunk_decay_BHN * chunk_decay_BHN, chunk_size, axis=-1)
  return (*layout.unpadded(dq, dk, dv), layout.public(dg_BHT, g),
          layout.public(dbeta_BHT, beta))


prepare_chunks.defvjp(_prepare, _prepare_chunks_bwd)


def _check(chunk_size, scale):
  if chunk_size < 16 or chunk_size & (chunk_size - 1):
    raise ValueError(f"prepare_chunks: chunk_size = {chunk_size}; needs a power of two >= 16")
  if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
    raise ValueError(f"prepare_chunks: scale must be a Python float or None (a constant of the"
                     f" kernels), got {type(scale).__name__}")
