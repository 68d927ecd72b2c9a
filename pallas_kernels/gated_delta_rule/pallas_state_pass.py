"""Pallas (Triton backend) kernels for the sequential part of the chunked gated delta rule.

The chunked form (reference.py) splits into work that is parallel over chunks (the per-chunk WY
transform, the intra-chunk attention matrix) and one sequential pass over chunks that carries the
K x V state. Per batch row and head, for chunk n of C tokens:

    v_new_n = u_n - w_n h_n                                  [C, V]
    o_n     = qg_n h_n + p_n v_new_n                         [C, V]
    h_{n+1} = a_n h_n + kd_n^T v_new_n                       [K, V]

with w_n, kd_n, qg_n [C, K], u_n [C, V], p_n [C, C] (the decayed causal q k^T) and a_n the chunk's
total decay. XLA would run this as a lax.scan with several small kernels per chunk and write every
h_n to memory; here each program of the grid (B, H, V-blocks) keeps its [K, block_v] slice of the
state on chip for the whole sequence and writes only o (plus, when a gradient will be taken, h_n
and v_new for the backward).

`chunk_scan` is a `jax.custom_vjp`. Its backward runs the pass in reverse for dh (kernel below,
storing the gradient w.r.t. each chunk's end state) and then forms the gradients of w, kd, qg, p
and a with batched matmuls that are parallel over chunks (XLA).

Layouts: w, kd, qg `[B,H,Tp,K]`, u `[B,H,Tp,V]`, p `[B,H,Tp,C]` with Tp = N * C, decay `[B,H,N]`
float32, states `[B,H,K,V]` float32; o is `[B,Tp,H,V]` (the public layout, so no transpose after).
K, V, C and block_v must be powers of two >= 16 (the caller pads K and V).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta_rule.xla_prepare import xla_matmul
from pallas_kernels.pallas_common import interpret_mode, kernel_dot, triton_compiler_params

__all__ = ["StatePassConfig", "chunk_scan", "default_state_config"]


@dataclasses.dataclass(frozen=True)
class StatePassConfig:
  """Launch parameters of the chunk-scan kernels.

  block_v: state columns per program (the grid is B x H x V/block_v).
  num_warps, num_stages: Triton launch parameters.
  Fields without suffix are for the plain forward (inference), *_train for the forward under
  differentiation (it also writes every chunk's state and v_new for the backward, which needs more
  registers and shared memory), *_bwd for the backward.
  v_blocks_adjacent: launch the V-blocks of one head next to each other (see `_grid_and_specs`).
    Measured on one H100 (2026-11-22, K = V = 128, default blocks otherwise), adjacent / not:
    B4 T4096 H64 forward 0.94 / 1.13 ms, forward + backward 4.04 / 4.51 ms (several waves of
    programs, so the heads' shared reads stay in L2); B8 T4096 H8 0.352 / 0.351 and 1.28 / 1.23
    ms (one wave: within noise).
  separate_output_train: under differentiation, the sequential pass only carries the state (it
    writes every chunk's state and v_new for the backward in any case) and the outputs
    o = qg h + p v_new follow in parallel over chunks (XLA batched matmuls); this halves the
    matmuls on the sequential path. The plain forward always computes o inside the pass (it would
    have to write the chunk states only for this). Measured on one H100 (2026-11-22, docs/
    benchmarks.md), forward + backward ms inside / after the pass: B8 T4096 H8 K=V=256 8.05 /
    7.64, K=V=128 3.97 / 3.80, B4 T4096 H64 K=V=128 14.60 / 13.91; B1 T16384 H8 3.42 / 3.27 and
    3.37 / 3.45 in two runs (within noise). The plain forward was slower with the outputs after
    the pass at all shapes tried (1.16 / 1.32, 1.27 / 1.52, 4.38 / 5.54 ms).
  """
  block_v: int = 64
  num_warps: int = 4
  num_stages: int = 2
  block_v_train: int = 64
  num_warps_train: int = 4
  num_stages_train: int = 2
  block_v_bwd: int = 64
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2
  v_blocks_adjacent: bool = True
  separate_output_train: bool = True

  def __post_init__(self):
    for name in ("v_blocks_adjacent", "separate_output_train"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"StatePassConfig.{name} must be a bool, got {getattr(self, name)!r}")
    for field in dataclasses.fields(self):
      if field.name in ("v_blocks_adjacent", "separate_output_train"):
        continue
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"StatePassConfig.{field.name} must be a positive int, got {value!r}")
    for name in ("block_v", "block_v_train", "block_v_bwd"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"StatePassConfig.{name} must be a power of two >= 16, got {value}")


def default_state_config(padded_key_dim: int) -> StatePassConfig:
  """Launch parameters by (padded) head size K.

  K = 256 with two pipeline stages asks for 256-264 KiB of shared memory (measured on an H200,
  which has 227 KiB), so K = 256 runs without load pipelining.
  """
  if padded_key_dim <= 128:
    return StatePassConfig()
  # Sweep at B8 T4096 H8 K=V=256 (H200; docs/benchmarks.md): plain forward 0.84 ms at
  # (64, 4 warps, 1 stage, adjacent) vs 1.12 ms at (32, 4, 1, not adjacent); forward + backward
  # 3.7 ms for every config that fits, so the training kernels keep the tested (32, 4, 1).
  return StatePassConfig(block_v=64, num_warps=4, num_stages=1, block_v_train=32,
                         num_warps_train=4, num_stages_train=1, block_v_bwd=32, num_warps_bwd=4,
                         num_stages_bwd=1)


def _forward_kernel(w_ref, u_ref, kd_ref, qg_ref, p_ref, decay_ref, h0_ref, *out_refs,
                    num_chunks, chunk_size, key_dim, exact, store_residuals, with_output):
  # Outputs: [o] (with_output), h_final, then [h_chunks, v_new] (store_residuals).
  o_ref = out_refs[0] if with_output else None
  h_final_ref = out_refs[1 if with_output else 0]
  if store_residuals:
    h_chunks_ref, v_new_ref = out_refs[-2:]
  store_dtype = (o_ref if with_output else v_new_ref).dtype

  def body(n, h_KV):
    rows = pl.ds(n * chunk_size, chunk_size)
    # The state enters the matmuls rounded as the backward will reload it, so both directions
    # differentiate the same function.
    h_used_KV = h_KV.astype(store_dtype)
    if store_residuals:
      h_chunks_ref[pl.ds(n * key_dim, key_dim), :] = h_used_KV
    v_new_CV = (u_ref[rows, :].astype(jnp.float32)
                - kernel_dot(w_ref[rows, :], h_used_KV, exact=exact)).astype(store_dtype)
    if store_residuals:
      v_new_ref[rows, :] = v_new_CV
    if with_output:
      o_CV = (kernel_dot(qg_ref[rows, :], h_used_KV, exact=exact)
              + kernel_dot(p_ref[rows, :], v_new_CV, exact=exact))
      o_ref[rows, :] = o_CV.astype(o_ref.dtype)
    return decay_ref[n] * h_KV + kernel_dot(kd_ref[rows, :], v_new_CV, exact=exact, trans_a=True)

  h_final_ref[...] = jax.lax.fori_loop(0, num_chunks, body, h0_ref[...].astype(jnp.float32))


def _backward_kernel(w_ref, kd_ref, qg_ref, p_ref, decay_ref, do_ref, dh_final_ref,
                     dv_ref, dh_end_ref, dh0_ref, *, num_chunks, chunk_size, key_dim, exact):
  def body(i, dh_KV):
    n = num_chunks - 1 - i
    rows = pl.ds(n * chunk_size, chunk_size)
    # dh_KV is the gradient w.r.t. h_{n+1}, the state after chunk n.
    dh_end_ref[pl.ds(n * key_dim, key_dim), :] = dh_KV.astype(dh_end_ref.dtype)
    do_CV = do_ref[rows, :]
    # v_new_n feeds o_n (through p_n) and h_{n+1} (through kd_n).
    dv_CV = (kernel_dot(p_ref[rows, :], do_CV, exact=exact, trans_a=True)
             + kernel_dot(kd_ref[rows, :], dh_KV, exact=exact))
    dv_ref[rows, :] = dv_CV.astype(dv_ref.dtype)
    # h_n feeds h_{n+1} (a_n), o_n (qg_n) and v_new_n (-w_n).
    return (decay_ref[n] * dh_KV + kernel_dot(qg_ref[rows, :], do_CV, exact=exact, trans_a=True)
            - kernel_dot(w_ref[rows, :], dv_CV, exact=exact, trans_a=True))

  dh0_ref[...] = jax.lax.fori_loop(0, num_chunks, body, dh_final_ref[...].astype(jnp.float32))


def _check(w, u, chunk_size, config):
  key_dim = w.shape[-1]
  value_dim = u.shape[-1]
  for name, size in (("K", key_dim), ("V", value_dim), ("chunk_size", chunk_size)):
    if size < 16 or size & (size - 1):
      raise NotImplementedError(
          f"chunk_scan: {name} = {size}; the Triton kernels need powers of two >= 16 (pad first)")
  if key_dim > 256:
    # K = 256 already needs one pipeline stage to fit an H200's 227 KiB of shared memory.
    raise NotImplementedError(
        f"chunk_scan: K = {key_dim} > 256; the state slice and K-wide operands would not fit in"
        " shared memory (use implementation='xla')")
  del config


def _grid_and_specs(batch, heads, padded_len, key_dim, value_dim, chunk_size, block_v,
                    v_blocks_adjacent):
  """The grid and BlockSpecs: whole sequences per program, one block of V columns.

  v_blocks_adjacent puts the V-block axis first in the grid, so the programs of one head run side
  by side and share their reads of w, kd, qg and p in L2 (the first grid axis varies fastest in
  launch order); otherwise the grid is (B, H, V-blocks).
  """
  num_chunks = padded_len // chunk_size
  num_v_blocks = value_dim // block_v
  if v_blocks_adjacent:
    grid = (num_v_blocks, batch, heads)
    spec = lambda shape, index: pl.BlockSpec(shape, lambda j, b, h: index(b, h, j))
  else:
    grid = (batch, heads, num_v_blocks)
    spec = pl.BlockSpec
  specs = {
      "seq_k": spec((None, None, padded_len, key_dim), lambda b, h, j: (b, h, 0, 0)),
      "seq_c": spec((None, None, padded_len, chunk_size), lambda b, h, j: (b, h, 0, 0)),
      "seq_v": spec((None, None, padded_len, block_v), lambda b, h, j: (b, h, 0, j)),
      "public_v": spec((None, padded_len, None, block_v), lambda b, h, j: (b, 0, h, j)),
      "chunks_kv": spec((None, None, num_chunks * key_dim, block_v), lambda b, h, j: (b, h, 0, j)),
      "state": spec((None, None, key_dim, block_v), lambda b, h, j: (b, h, 0, j)),
      "decay": spec((None, None, num_chunks), lambda b, h, j: (b, h, 0)),
  }
  return grid, specs


def _forward(w, u, kd, qg, p, decay, h0, *, chunk_size, store_dtype, exact, config,
             store_residuals):
  """(o, h_final, [h_chunks, v_new] if store_residuals); o by the kernel, or after it from the
  stored chunk states (config.separate_output_train, under differentiation)."""
  if not (store_residuals and config.separate_output_train):
    return _forward_call(w, u, kd, qg, p, decay, h0, chunk_size=chunk_size,
                         store_dtype=store_dtype, exact=exact, config=config,
                         store_residuals=store_residuals, with_output=True)
  h_final, h_chunks, v_new = _forward_call(
      w, u, kd, qg, p, decay, h0, chunk_size=chunk_size, store_dtype=store_dtype, exact=exact,
      config=config, store_residuals=True, with_output=False)
  o = _outputs_from_states(qg, p, h_chunks, v_new, chunk_size=chunk_size, exact=exact)
  return o, h_final, h_chunks, v_new


def _outputs_from_states(qg, p, h_chunks, v_new, *, chunk_size, exact):
  """o_n = qg_n h_n + p_n v_new_n for all chunks at once, in the public layout [B,Tp,H,V]."""
  batch, heads, padded_len, key_dim = qg.shape
  value_dim = v_new.shape[-1]
  num_chunks = padded_len // chunk_size
  by_chunk = lambda x: x.reshape(batch, heads, num_chunks, -1, x.shape[-1])
  mm = xla_matmul(exact)
  o_BHNCV = (mm("bhnck,bhnkv->bhncv", by_chunk(qg), by_chunk(h_chunks))
             + mm("bhncj,bhnjv->bhncv", by_chunk(p), by_chunk(v_new)))
  o_BTHV = jnp.transpose(o_BHNCV.reshape(batch, heads, padded_len, value_dim), (0, 2, 1, 3))
  return o_BTHV.astype(v_new.dtype)


def _forward_call(w, u, kd, qg, p, decay, h0, *, chunk_size, store_dtype, exact, config,
                  store_residuals, with_output):
  batch, heads, padded_len, key_dim = w.shape
  value_dim = u.shape[-1]
  num_chunks = padded_len // chunk_size
  if store_residuals:
    block_v, num_warps, num_stages = (config.block_v_train, config.num_warps_train,
                                      config.num_stages_train)
  else:
    block_v, num_warps, num_stages = config.block_v, config.num_warps, config.num_stages
  block_v = min(block_v, value_dim)
  grid, specs = _grid_and_specs(batch, heads, padded_len, key_dim, value_dim, chunk_size, block_v,
                                config.v_blocks_adjacent)
  out_specs = [specs["state"]]
  out_shape = [jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32)]
  if with_output:
    out_specs.insert(0, specs["public_v"])
    out_shape.insert(0, jax.ShapeDtypeStruct((batch, padded_len, heads, value_dim), store_dtype))
  if store_residuals:
    out_specs += [specs["chunks_kv"], specs["seq_v"]]
    out_shape += [
        jax.ShapeDtypeStruct((batch, heads, num_chunks * key_dim, value_dim), store_dtype),
        jax.ShapeDtypeStruct((batch, heads, padded_len, value_dim), store_dtype)]
  kernel = functools.partial(_forward_kernel, num_chunks=num_chunks, chunk_size=chunk_size,
                             key_dim=key_dim, exact=exact, store_residuals=store_residuals,
                             with_output=with_output)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[specs["seq_k"], specs["seq_v"], specs["seq_k"], specs["seq_k"], specs["seq_c"],
                specs["decay"], specs["state"]],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=triton_compiler_params(num_warps, num_stages),
      interpret=interpret_mode(),
      name="gdn_chunk_scan_fwd",
  )(w, u, kd, qg, p, decay, h0)


def _backward_pass(w, kd, qg, p, decay, do, dh_final, *, chunk_size, store_dtype, exact, config):
  batch, heads, padded_len, key_dim = w.shape
  value_dim = do.shape[-1]
  num_chunks = padded_len // chunk_size
  block_v = min(config.block_v_bwd, value_dim)
  grid, specs = _grid_and_specs(batch, heads, padded_len, key_dim, value_dim, chunk_size, block_v,
                                config.v_blocks_adjacent)
  kernel = functools.partial(_backward_kernel, num_chunks=num_chunks, chunk_size=chunk_size,
                             key_dim=key_dim, exact=exact)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[specs["seq_k"], specs["seq_k"], specs["seq_k"], specs["seq_c"], specs["decay"],
                specs["public_v"], specs["state"]],
      out_specs=[specs["seq_v"], specs["chunks_kv"], specs["state"]],
      out_shape=[
          jax.ShapeDtypeStruct((batch, heads, padded_len, value_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, heads, num_chunks * key_dim, value_dim), store_dtype),
          jax.ShapeDtypeStruct((batch, heads, key_dim, value_dim), jnp.float32)],
      compiler_params=triton_compiler_params(config.num_warps_bwd, config.num_stages_bwd),
      interpret=interpret_mode(),
      name="gdn_chunk_scan_bwd",
  )(w, kd, qg, p, decay, do, dh_final)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def chunk_scan(w, u, kd, qg, p, decay, h0, chunk_size: int, store_dtype: str, exact: bool,
               config: StatePassConfig):
  """(o `[B,Tp,H,V]` in store_dtype, h_final `[B,H,K,V]` float32); see the module docstring.

  store_dtype: name of the dtype of o and of the saved h_n, v_new (a string: custom_vjp's static
    arguments must be hashable Python values). exact: full-precision float32 matmuls.
  """
  _check(w, u, chunk_size, config)
  return tuple(_forward(w, u, kd, qg, p, decay, h0, chunk_size=chunk_size,
                        store_dtype=jnp.dtype(store_dtype), exact=exact, config=config,
                        store_residuals=False))


def _chunk_scan_fwd(w, u, kd, qg, p, decay, h0, chunk_size, store_dtype, exact, config):
  _check(w, u, chunk_size, config)
  o, h_final, h_chunks, v_new = _forward(
      w, u, kd, qg, p, decay, h0, chunk_size=chunk_size, store_dtype=jnp.dtype(store_dtype),
      exact=exact, config=config, store_residuals=True)
  return (o, h_final), (w, kd, qg, p, decay, h_chunks, v_new)


def _chunk_scan_bwd(chunk_size, store_dtype, exact, config, residuals, cotangents):
  w, kd, qg, p, decay, h_chunks, v_new = residuals
  do_BTHV, dh_final_BHKV = cotangents
  store_dtype = jnp.dtype(store_dtype)
  dv_BHTV, dh_end_BHXV, dh0_BHKV = _backward_pass(
      w, kd, qg, p, decay, do_BTHV.astype(store_dtype), dh_final_BHKV, chunk_size=chunk_size,
      store_dtype=store_dtype, exact=exact, config=config)

  # The rest is parallel over chunks: batched [C, V] x [V, K|C] matmuls.
  batch, heads, padded_len, key_dim = w.shape
  value_dim = v_new.shape[-1]
  num_chunks = padded_len // chunk_size
  by_chunk = lambda x: x.reshape(batch, heads, num_chunks, -1, x.shape[-1])
  h_BHNKV = by_chunk(h_chunks)
  dh_end_BHNKV = by_chunk(dh_end_BHXV)
  v_new_BHNCV = by_chunk(v_new)
  dv_BHNCV = by_chunk(dv_BHTV)
  do_BHNCV = by_chunk(jnp.swapaxes(do_BTHV, 1, 2))
  mm = xla_matmul(exact)
  dw = -mm("bhncv,bhnkv->bhnck", dv_BHNCV, h_BHNKV)
  dkd = mm("bhncv,bhnkv->bhnck", v_new_BHNCV, dh_end_BHNKV)
  dqg = mm("bhncv,bhnkv->bhnck", do_BHNCV, h_BHNKV)
  dp = mm("bhniv,bhnjv->bhnij", do_BHNCV, v_new_BHNCV)
  # A reduction, not an einsum: XLA would lower the einsum to a TF32 matmul on GPU.
  ddecay = jnp.sum(h_BHNKV.astype(jnp.float32) * dh_end_BHNKV.astype(jnp.float32), axis=(-2, -1))
  flat = lambda x, like: x.reshape(like.shape).astype(like.dtype)
  return (flat(dw, w), dv_BHTV.astype(store_dtype), flat(dkd, kd), flat(dqg, qg), flat(dp, p),
          ddecay.astype(decay.dtype), dh0_BHKV)


chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)
