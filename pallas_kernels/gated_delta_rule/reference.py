"""Plain-jnp gated delta rule: the per-token recurrence (ground truth) and the chunked WY/UT form.

Semantics (per batch row and head; K = key dim, V = value dim; states are K x V):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

with g the natural-log decay (g <= 0), beta in (0, 1), scale = K**-0.5 by default, and q, k
optionally l2-normalised per head first (x / sqrt(sum x^2 + 1e-6)).

Both functions take q, k `[B,T,H,K]`, v `[B,T,H,V]`, g, beta `[B,T,H]`, initial_state
`[B,H,K,V]` (or None for zeros) and return `(o [B,T,H,V] in v's dtype, final_state [B,H,K,V] or
None)`. They compute in float32 (float64 when any input is float64, so that a float64 run is a
true float64 reference); every matmul asks for HIGHEST precision so that GPUs do not silently use
TF32. Inputs are assumed validated by the public entry in `__init__.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6

# HIGHEST so a GPU run keeps full float32 products (XLA's default there is TF32), which the
# float32 tolerance of the tests assumes.
_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def compute_dtype(*arrays) -> jnp.dtype:
  """float64 if any given array is float64 (only possible under x64), else float32."""
  dtype = jnp.dtype(jnp.float32)
  for array in arrays:
    if array is not None:
      dtype = jnp.promote_types(dtype, jnp.asarray(array).dtype)
  return dtype


def query_scale(scale: float | None, key_dim: int) -> float:
  """The factor folded into q: `scale`, or 1 / sqrt(key_dim) when it is None."""
  return float(key_dim ** -0.5 if scale is None else scale)


def l2_normalize(x_BTHD: jax.Array) -> jax.Array:
  """x / sqrt(sum x^2 + 1e-6) over the last (head) axis; the eps keeps zero vectors finite."""
  sum_sq_BTH1 = jnp.sum(jnp.square(x_BTHD), axis=-1, keepdims=True)
  return x_BTHD * jax.lax.rsqrt(sum_sq_BTH1 + L2NORM_EPS)


SUBSTITUTION_BLOCK = 16  # blocks up to this size are inverted row by row


@jax.custom_vjp
def unit_lower_inverse(a_NCC: jax.Array) -> jax.Array:
  """(I + A)^{-1} for strictly lower-triangular A [..., C, C], any C; differentiable.

  The gradient is the closed form dA = -X^T dX X^T on the strictly lower triangle (X the
  inverse), two matmuls, instead of the transpose of the substitution's ~C small steps (which
  cost ~16 of the 57 ms of a CPU GDN fwd+bwd at B64 T64).
  """
  return _substitution_inverse(a_NCC)


def _inverse_fwd(a_NCC):
  x_NCC = _substitution_inverse(a_NCC)
  return x_NCC, x_NCC


def _inverse_bwd(x_NCC, dx_NCC):
  x_t_NCC = jnp.swapaxes(x_NCC, -1, -2)
  da_NCC = -_einsum("...ij,...jk->...ik", _einsum("...ij,...jk->...ik", x_t_NCC, dx_NCC),
                    x_t_NCC)
  return (jnp.tril(da_NCC, k=-1),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def _substitution_inverse(a_NCC: jax.Array) -> jax.Array:
  """(I + A)^{-1} for strictly lower-triangular A [..., C, C], any C.

  Blockwise: diagonal blocks of <= 16 rows by forward substitution, then merged pairwise,
      [[X11, 0], [-X22 A21 X11, X22]] inverts [[I + A11, 0], [A21, I + A22]],
  so every intermediate is a principal block of the true inverse. Not by the power series
  sum_m (-A)^m (doubling): its partial powers grow combinatorially when a chunk's keys are
  correlated, as trained keys are, and overflow or cancel to NaN in float32.
  Not `lax.linalg.triangular_solve`: on jaxlib 0.10.2's CPU backend the compile of its gradient
  nested in the model's layer scan was seen to hang; matmuls also suit the GPU better.
  """
  size = a_NCC.shape[-1]
  if size <= SUBSTITUTION_BLOCK:
    return _forward_substitution(a_NCC)
  half = size // 2
  x11 = _substitution_inverse(a_NCC[..., :half, :half])
  x22 = _substitution_inverse(a_NCC[..., half:, half:])
  x21 = -_einsum("...ij,...jk->...ik", x22,
                 _einsum("...ij,...jk->...ik", a_NCC[..., half:, :half], x11))
  top = jnp.concatenate([x11, jnp.zeros(x11.shape[:-1] + (size - half,), a_NCC.dtype)], axis=-1)
  return jnp.concatenate([top, jnp.concatenate([x21, x22], axis=-1)], axis=-2)


def _forward_substitution(a_NCC: jax.Array) -> jax.Array:
  """(I + A)^{-1} row by row: X_i = e_i - A_i X, where the rows of X not yet computed are still
  identity rows that A_i (strictly lower) never reaches. A loop, not C unrolled steps: unrolled,
  this one function took ~2.7 s of XLA:CPU compile time per GDN layer program."""
  size = a_NCC.shape[-1]
  eye_CC = jnp.eye(size, dtype=a_NCC.dtype)

  def substitute_row(i, x_NCC):
    a_row_N1C = jax.lax.dynamic_slice_in_dim(a_NCC, i, 1, axis=-2)
    eye_row_1C = jax.lax.dynamic_slice_in_dim(eye_CC, i, 1, axis=0)
    row_N1C = eye_row_1C - _einsum("...ij,...jk->...ik", a_row_N1C, x_NCC)
    return jax.lax.dynamic_update_slice_in_dim(x_NCC, row_N1C, i, axis=-2)

  return jax.lax.fori_loop(1, size, substitute_row, jnp.broadcast_to(eye_CC, a_NCC.shape))


def _prepare_inputs(q, k, v, g, beta, initial_state, scale, use_qk_l2norm):
  """Upcasts to the compute dtype, normalises q and k if asked and folds `scale` into q."""
  dtype = compute_dtype(q, k, v, g, beta, initial_state)
  batch, _, heads, key_dim = q.shape
  value_dim = v.shape[-1]
  q_BTHK = q.astype(dtype)
  k_BTHK = k.astype(dtype)
  if use_qk_l2norm:
    q_BTHK = l2_normalize(q_BTHK)
    k_BTHK = l2_normalize(k_BTHK)
  q_BTHK = q_BTHK * jnp.asarray(query_scale(scale, key_dim), dtype)
  if initial_state is None:
    state_BHKV = jnp.zeros((batch, heads, key_dim, value_dim), dtype)
  else:
    state_BHKV = initial_state.astype(dtype)
  return q_BTHK, k_BTHK, v.astype(dtype), g.astype(dtype), beta.astype(dtype), state_BHKV


def as_key_value(state: jax.Array | None, state_layout: str) -> jax.Array | None:
  """A state of `state_layout` ("kv": [..., K, V]; "vk": [..., V, K]) as [..., K, V]; for "vk" a
  transposition, its own inverse (so it also turns a [..., K, V] state back into "vk")."""
  if state is None or state_layout == "kv":
    return state
  return jnp.swapaxes(state, -1, -2)


def delta_rule_update(state_BHKV: jax.Array, k_BHK: jax.Array, v_BHV: jax.Array, g_BH: jax.Array,
                      beta_BH: jax.Array) -> jax.Array:
  """The state after one token, in the delta-rule form S = a S;  u = beta (v - S^T k);
  S = S + k u^T, which equals the definition a (I - beta k k^T) S + beta k v^T without forming a
  K x K matrix."""
  state_BHKV = jnp.exp(g_BH)[:, :, None, None] * state_BHKV
  # What the decayed state already predicts for k; the delta rule writes only the error.
  predicted_BHV = _einsum("bhk,bhkv->bhv", k_BHK, state_BHKV)
  update_BHV = beta_BH[:, :, None] * (v_BHV - predicted_BHV)
  return state_BHKV + _einsum("bhk,bhv->bhkv", k_BHK, update_BHV)


def delta_rule_output(state_BHKV: jax.Array, q_BHK: jax.Array) -> jax.Array:
  """o = S^T q of the state after the token (q already scaled)."""
  return _einsum("bhk,bhkv->bhv", q_BHK, state_BHKV)


def naive_recurrent_gated_delta_rule(
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
) -> tuple[jax.Array, jax.Array | None]:
  """The recurrence token by token (`lax.scan` over T of `delta_rule_update` and
  `delta_rule_output`): the ground truth, and the decoding path. Shapes as in the module
  docstring."""
  q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV = _prepare_inputs(
      q, k, v, g, beta, initial_state, scale, use_qk_l2norm)

  def step(state_BHKV, inputs):
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH = inputs
    state_BHKV = delta_rule_update(state_BHKV, k_BHK, v_BHV, g_BH, beta_BH)
    return state_BHKV, delta_rule_output(state_BHKV, q_BHK)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  final_state_BHKV, o_TBHV = jax.lax.scan(
      step, state_BHKV,
      (time_major(q_BTHK), time_major(k_BTHK), time_major(v_BTHV), time_major(g_BTH),
       time_major(beta_BTH)))
  o_BTHV = jnp.moveaxis(o_TBHV, 0, 1).astype(v.dtype)
  return o_BTHV, (final_state_BHKV if output_final_state else None)


def chunk_gated_delta_rule_reference(
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
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
  """The chunked WY/UT form (§2), exactly equal to the recurrence in exact math.

  Shapes as in the module docstring; any T (padded internally to a multiple of `chunk_size`).
  Within a chunk of C tokens with start state S0 and cumulative log-decay G_i = sum_{m<=i} g_m:

    A[i,j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i      (strictly lower triangular)
    T      = (I + A)^{-1} diag(beta)                          (unit-lower-triangular inverse)
    W      = T diag(exp(G)) K,   U = T V - W S0                (U: the "pseudo values")
    O      = diag(exp(G)) Q S0 + (Q K^T ⊙ M) U,   M[i,j] = exp(G_i - G_j) for j <= i
    S_next = exp(G_C) S0 + (diag(exp(G_C - G)) K)^T U

  Everything that does not depend on S0 is computed for all chunks at once; only the state pass
  (U, S_next) is a `lax.scan` over chunks, and O is assembled afterwards, batched again.
  """
  q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, state_BHKV = _prepare_inputs(
      q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
  batch, seq_len, heads, _ = q_BTHK.shape
  value_dim = v_BTHV.shape[-1]
  dtype = q_BTHK.dtype
  num_chunks = -(-seq_len // chunk_size)
  pad = num_chunks * chunk_size - seq_len

  # Padding tokens have g = 0 (no decay), beta = 0 (no write) and k = 0, so they leave the state
  # exactly unchanged; they sit after every real token, so real outputs never see them.
  def to_chunks(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((batch, num_chunks, chunk_size) + x.shape[2:])

  q_BNCHK = to_chunks(q_BTHK)
  k_BNCHK = to_chunks(k_BTHK)
  v_BNCHV = to_chunks(v_BTHV)
  g_BNCH = to_chunks(g_BTH)
  beta_BNCH = to_chunks(beta_BTH)

  # Log-decays as segment sums, never as differences of cumulative sums: with strong decay the
  # cumulative sum G reaches -1000 within a chunk, and G_i - G_j would lose float32 digits (and the
  # gradient of g would be a sum of large cancelling terms). Since every g <= 0, a segment sum
  # adds terms of one sign, so its relative error stays at a few ulps.
  #   log_ratio[i, j] = sum_{j < m <= i} g_m = log(gamma_i / gamma_j) for j <= i, 0 for j >= i,
  # built as a cumulative sum over m of g_m [m > j]. Above the diagonal it is 0, not a positive
  # number that exp could overflow, so masking after exp can never produce inf * 0 = NaN.
  row_C1 = jnp.arange(chunk_size)[:, None]
  col_1C = jnp.arange(chunk_size)[None, :]
  strictly_lower_CC = col_1C < row_C1
  lower_CC = col_1C <= row_C1
  g_BNHC = jnp.swapaxes(g_BNCH, 2, 3)
  g_after_col_BNHCC = jnp.where(strictly_lower_CC, g_BNHC[..., :, None], 0.0)
  log_ratio_BNHCC = jnp.cumsum(g_after_col_BNHCC, axis=-2)
  decay_BNHCC = jnp.where(lower_CC, jnp.exp(log_ratio_BNHCC), 0.0)
  strict_decay_BNHCC = jnp.where(strictly_lower_CC, decay_BNHCC, 0.0)
  # log gamma_i = sum_{m <= i} g_m (from the chunk start) and log(gamma_C / gamma_i), the decay
  # from token i to the chunk's end: the last row of log_ratio.
  log_gamma_BNCH = jnp.cumsum(g_BNCH, axis=2)
  log_gamma_last_BNH = log_gamma_BNCH[:, :, -1, :]
  log_decay_to_end_BNHC = log_ratio_BNHCC[..., -1, :]
  beta_BNHC = jnp.swapaxes(beta_BNCH, 2, 3)

  # A = strictly lower part of diag(beta) (Gamma K K^T Gamma^{-1}); T = (I + A)^{-1} diag(beta).
  kk_BNHCC = _einsum("bnihk,bnjhk->bnhij", k_BNCHK, k_BNCHK)
  a_BNHCC = beta_BNHC[..., :, None] * strict_decay_BNHCC * kk_BNHCC
  t_BNHCC = _einsum("bnhij,bnhj->bnhij", unit_lower_inverse(a_BNHCC), beta_BNHC)

  gamma_BNCH = jnp.exp(log_gamma_BNCH)
  w_BNHCK = _einsum("bnhij,bnjhk->bnhik", t_BNHCC, gamma_BNCH[..., None] * k_BNCHK)
  t_v_BNHCV = _einsum("bnhij,bnjhv->bnhiv", t_BNHCC, v_BNCHV)
  k_to_end_BNCHK = jnp.swapaxes(jnp.exp(log_decay_to_end_BNHC), 2, 3)[..., None] * k_BNCHK
  gamma_last_BNH = jnp.exp(log_gamma_last_BNH)

  def chunk_step(state_BHKV, chunk):
    w_BHCK, t_v_BHCV, k_to_end_BCHK, gamma_last_BH = chunk
    u_BHCV = t_v_BHCV - _einsum("bhik,bhkv->bhiv", w_BHCK, state_BHKV)
    next_state_BHKV = (gamma_last_BH[:, :, None, None] * state_BHKV
                       + _einsum("bihk,bhiv->bhkv", k_to_end_BCHK, u_BHCV))
    return next_state_BHKV, (state_BHKV, u_BHCV)

  chunk_major = lambda x: jnp.moveaxis(x, 1, 0)
  final_state_BHKV, (start_state_NBHKV, u_NBHCV) = jax.lax.scan(
      chunk_step, state_BHKV,
      (chunk_major(w_BNHCK), chunk_major(t_v_BNHCV), chunk_major(k_to_end_BNCHK),
       chunk_major(gamma_last_BNH)))
  start_state_BNHKV = jnp.moveaxis(start_state_NBHKV, 0, 1)
  u_BNHCV = jnp.moveaxis(u_NBHCV, 0, 1)

  # Output: what the (decayed) start state gives, plus causal attention within the chunk over U.
  qk_masked_BNHCC = _einsum("bnihk,bnjhk->bnhij", q_BNCHK, k_BNCHK) * decay_BNHCC
  o_BNCHV = (_einsum("bnihk,bnhkv->bnihv", gamma_BNCH[..., None] * q_BNCHK, start_state_BNHKV)
             + _einsum("bnhij,bnhjv->bnihv", qk_masked_BNHCC, u_BNHCV))
  o_BTHV = o_BNCHV.reshape(batch, num_chunks * chunk_size, heads, value_dim)[:, :seq_len]
  return o_BTHV.astype(v.dtype), (final_state_BHKV if output_final_state else None)
