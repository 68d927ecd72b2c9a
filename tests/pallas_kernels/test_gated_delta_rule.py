"""Gated delta rule: the chunked form and the decoding entry against the float64 recurrence.

The ground truth is `naive_recurrent_gated_delta_rule` run in float64 on the very values the tested
version sees (inputs rounded to the tested dtype first), so errors measure computation only.
Gradients are those of a random linear functional sum(o * w_o) + sum(final_state * w_s), which
exercises every output element's cotangent at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule import (
    ChunkConfig,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from pallas_kernels.gated_delta_rule import reference
from pallas_kernels.gated_delta_rule.reference import naive_recurrent_gated_delta_rule
from tests.kernel_testing import (GROUP, assert_close, assert_other_groups_untouched, float64,
                                  relative_error, stacked_in_poison, tolerance)

ARG_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(seed, *, seq_len, batch=2, heads=2, key_dim=16, value_dim=16,
                normalized_keys=True, decay_shift=3.0, decay_spread=1.5):
  """Float64 numpy inputs shaped like Gated DeltaNet's, plus the weights of the loss.

  g = log sigmoid(x) with x ~ N(decay_shift, decay_spread^2): mostly slow decay, so the state
  carries across several chunks (fast decay would let the cross-chunk pass go untested), with
  some fast-decaying tokens. beta = sigmoid(N(0, 1)). Keys are unit vectors when the kernel will
  not normalise them: the delta rule is a contraction only for beta ||k||^2 < 2.
  """
  rng = np.random.default_rng(seed)
  shape_q = (batch, seq_len, heads, key_dim)
  k = rng.standard_normal(shape_q)
  if normalized_keys:
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  decay_logits = decay_shift + decay_spread * rng.standard_normal((batch, seq_len, heads))
  return {
      "q": rng.standard_normal(shape_q),
      "k": k,
      "v": rng.standard_normal((batch, seq_len, heads, value_dim)),
      "g": -np.logaddexp(0.0, -decay_logits),  # log sigmoid, computed without overflow
      "beta": 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, seq_len, heads)))),
      "initial_state": rng.standard_normal((batch, heads, key_dim, value_dim)),
      "w_o": rng.standard_normal((batch, seq_len, heads, value_dim)),
      "w_s": rng.standard_normal((batch, heads, key_dim, value_dim)),
  }


def round_to(inputs, dtype):
  """The inputs as `dtype` would hold them, back in float64 (states and weights stay float32)."""
  rounded = {}
  for name, x in inputs.items():
    x_dtype = jnp.float32 if name in ("initial_state", "w_o", "w_s") else dtype
    rounded[name] = np.asarray(jnp.asarray(x, x_dtype)).astype(np.float64)
  return rounded


def run(fn, inputs, dtype, *, with_state, **kwargs):
  """o, final_state and the gradients {name: grad} of the loss, all as numpy arrays.

  Float inputs in `dtype` (float64 needs the `float64()` context); the state is float32 except
  for a float64 run. Jitted, one compile per call.
  """
  state_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
  names = ARG_NAMES if with_state else ARG_NAMES[:-1]
  args = [jnp.asarray(inputs[n], state_dtype if n == "initial_state" else dtype) for n in names]
  w_o = jnp.asarray(inputs["w_o"], state_dtype)
  w_s = jnp.asarray(inputs["w_s"], state_dtype)

  def loss(*args):
    o, final_state = fn(*args[:5], initial_state=args[5] if with_state else None,
                        output_final_state=True, **kwargs)
    value = jnp.sum(o.astype(state_dtype) * w_o) + jnp.sum(final_state * w_s)
    return value, (o, final_state)

  grads, (o, final_state) = jax.jit(
      jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True))(*args)
  assert o.dtype == jnp.dtype(dtype) and final_state.dtype == jnp.dtype(state_dtype)
  return np.asarray(o), np.asarray(final_state), {n: np.asarray(x) for n, x in zip(names, grads)}


def run_reference(inputs, *, with_state, **kwargs):
  with float64():
    return run(naive_recurrent_gated_delta_rule, inputs, jnp.float64, with_state=with_state,
               **kwargs)


def compare(actual, expected, dtype, label):
  """assert_close on o, final_state and every gradient; prints the errors for the record."""
  o, final_state, grads = actual
  o_ref, final_state_ref, grads_ref = expected
  errors = {"o": relative_error(o, o_ref), "final_state": relative_error(final_state,
                                                                         final_state_ref)}
  errors.update({f"d{n}": relative_error(grads[n], grads_ref[n]) for n in grads})
  print(f"\n{label}: max relative error {max(errors.values()):.2e} "
        + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
  assert_close(o, o_ref, dtype, name=f"{label} o")
  assert_close(final_state, final_state_ref, dtype, name=f"{label} final_state")
  for n in grads:
    assert_close(grads[n], grads_ref[n], dtype, name=f"{label} d{n}")


# T not a multiple of the chunk (100 = 3 * 32 + 4; 37 < 64) and K != V, to catch transposed axes.
# The four cases cover every pair of values of (length, initial state, l2norm): each compile of a
# gradient costs seconds on CPU, so the full 2 x 2 x 2 grid would add little but time.
@pytest.mark.parametrize("seq_len,chunk_size,key_dim,value_dim,with_state,use_qk_l2norm", [
    (100, 32, 16, 32, True, False),
    (100, 32, 16, 32, False, True),
    (37, 64, 32, 16, False, False),
    (37, 64, 32, 16, True, True),
], ids=["T100_C32_state_raw", "T100_C32_nostate_l2norm", "T37_C64_nostate_raw",
        "T37_C64_state_l2norm"])
def test_chunk_matches_float64_recurrence(seq_len, chunk_size, key_dim, value_dim, with_state,
                                          use_qk_l2norm):
  inputs = make_inputs(seq_len + 7 * chunk_size + with_state + 2 * use_qk_l2norm,
                       seq_len=seq_len, key_dim=key_dim, value_dim=value_dim,
                       normalized_keys=not use_qk_l2norm)
  inputs = round_to(inputs, jnp.float32)
  kwargs = dict(use_qk_l2norm=use_qk_l2norm)
  actual = run(chunk_gated_delta_rule, inputs, jnp.float32, with_state=with_state,
               implementation="xla", config=ChunkConfig(chunk_size), **kwargs)
  expected = run_reference(inputs, with_state=with_state, **kwargs)
  compare(actual, expected, jnp.float32,
          f"float32 T={seq_len} C={chunk_size} state={with_state} l2norm={use_qk_l2norm}")


def test_bf16_inputs_match_float64_recurrence():
  # Tolerance 2e-2 (the table's bfloat16 entry): the computation is float32 inside, so the error
  # is mostly o and the gradients being rounded to bf16 (8-bit mantissa, ~4e-3 per element);
  # the reference sees the same bf16-rounded inputs.
  inputs = round_to(make_inputs(11, seq_len=100, key_dim=32, value_dim=32, normalized_keys=False),
                    jnp.bfloat16)
  actual = run(chunk_gated_delta_rule, inputs, jnp.bfloat16, with_state=True, use_qk_l2norm=True)
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.bfloat16, "bf16 T=100 C=64")


def test_strong_decay_stays_finite_and_exact():
  # Decays down to exp(-30) per token: in-chunk cumulative log-decay reaches about -1000, where
  # exp(G_i) and exp(-G_j) would under/overflow; the log-space ratios must keep o and the
  # gradients finite and exact.
  inputs = round_to(make_inputs(12, seq_len=70, decay_shift=-2.0, decay_spread=8.0),
                    jnp.float32)
  assert inputs["g"].min() < -20
  actual = run(chunk_gated_delta_rule, inputs, jnp.float32, with_state=True)
  expected = run_reference(inputs, with_state=True)
  compare(actual, expected, jnp.float32, "float32 strong decay T=70 C=64")


@pytest.mark.parametrize("chunk_size", [1, 7, 128])
def test_any_chunk_size_gives_the_same_forward(chunk_size):
  # 1: no intra-chunk work at all; 7: many padded chunks; 128 > T: one chunk, mostly padding.
  inputs = round_to(make_inputs(13, seq_len=37), jnp.float32)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES]
  o, final_state = jax.jit(lambda *a: chunk_gated_delta_rule(
      *a[:5], initial_state=a[5], output_final_state=True, config=ChunkConfig(chunk_size)))(*args)
  with float64():
    o_ref, final_state_ref = naive_recurrent_gated_delta_rule(
        *[jnp.asarray(inputs[n], jnp.float64) for n in ARG_NAMES[:5]],
        initial_state=jnp.asarray(inputs["initial_state"], jnp.float64), output_final_state=True)
    o_ref, final_state_ref = np.asarray(o_ref), np.asarray(final_state_ref)
  assert_close(o, o_ref, jnp.float32, name="o")
  assert_close(final_state, final_state_ref, jnp.float32, name="final_state")


def test_chunk_in_float64_is_exact():
  # In float64 the chunked form must agree with the recurrence to ~1e-10: it is the same function,
  # not an approximation, so any larger gap is a bug in the algebra, not rounding.
  inputs = make_inputs(20, seq_len=45, key_dim=8, value_dim=16, normalized_keys=False)
  with float64():
    args = [jnp.asarray(inputs[n], jnp.float64) for n in ARG_NAMES]
    kwargs = dict(output_final_state=True, use_qk_l2norm=True)
    o, final_state = jax.jit(lambda *a: chunk_gated_delta_rule(
        *a[:5], initial_state=a[5], config=ChunkConfig(16), **kwargs))(*args)
    o_ref, final_state_ref = naive_recurrent_gated_delta_rule(
        *args[:5], initial_state=args[5], **kwargs)
    assert o.dtype == jnp.float64 and final_state.dtype == jnp.float64
    assert_close(o, o_ref, jnp.float64, name="o")
    assert_close(final_state, final_state_ref, jnp.float64, name="final_state")


def test_naive_recurrence_matches_the_definition():
  # The ground truth itself, against the matrix form of the definition written out in numpy:
  # S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).
  inputs = make_inputs(14, seq_len=6, key_dim=8, value_dim=4, normalized_keys=False)
  scale = 0.3
  q = inputs["q"] / np.sqrt(np.sum(inputs["q"] ** 2, -1, keepdims=True) + 1e-6)
  k = inputs["k"] / np.sqrt(np.sum(inputs["k"] ** 2, -1, keepdims=True) + 1e-6)
  v, g, beta = inputs["v"], inputs["g"], inputs["beta"]
  state = inputs["initial_state"].copy()
  o_expected = np.zeros_like(v)
  eye = np.eye(k.shape[-1])
  for b in range(k.shape[0]):
    for h in range(k.shape[2]):
      s = state[b, h]
      for t in range(k.shape[1]):
        kt, bt = k[b, t, h], beta[b, t, h]
        s = np.exp(g[b, t, h]) * (eye - bt * np.outer(kt, kt)) @ s + bt * np.outer(kt, v[b, t, h])
        o_expected[b, t, h] = s.T @ (scale * q[b, t, h])
      state[b, h] = s
  with float64():
    o, final_state = naive_recurrent_gated_delta_rule(
        *[jnp.asarray(inputs[n]) for n in ARG_NAMES[:5]], scale=scale,
        initial_state=jnp.asarray(inputs["initial_state"]), output_final_state=True,
        use_qk_l2norm=True)
    assert o.dtype == jnp.float64
    assert_close(o, o_expected, jnp.float64, name="o")
    assert_close(final_state, state, jnp.float64, name="final_state")


def test_fused_recurrent_decoding_equals_chunked_prefill():
  # Decoding token by token (T = 1 per call, state passed along) must reproduce one chunked pass,
  # and a multi-token fused call must equal the float64 recurrence.
  inputs = round_to(make_inputs(15, seq_len=20, normalized_keys=False), jnp.float32)
  args = {n: jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES}
  o_full, state_full = jax.jit(lambda *a: chunk_gated_delta_rule(
      *a[:5], initial_state=a[5], output_final_state=True, use_qk_l2norm=True,
      config=ChunkConfig(8)))(*[args[n] for n in ARG_NAMES])

  decode = jax.jit(lambda *a, initial_state: fused_recurrent_gated_delta_rule(
      *a, initial_state=initial_state, output_final_state=True, use_qk_l2norm=True))
  state = args["initial_state"]
  outputs = []
  for t in range(20):
    o_t, state = decode(*[args[n][:, t:t + 1] for n in ARG_NAMES[:5]], initial_state=state)
    assert o_t.shape == (2, 1, 2, 16) and state.dtype == jnp.float32
    outputs.append(o_t)
  assert_close(jnp.concatenate(outputs, axis=1), o_full, jnp.float32, name="decoded o")
  assert_close(state, state_full, jnp.float32, name="decoded state")

  actual = run(fused_recurrent_gated_delta_rule, inputs, jnp.float32, with_state=True,
               use_qk_l2norm=True, implementation="xla")
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.float32, "fused_recurrent T=20")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_fused_recurrent_steps_one_layer_group_of_a_stacked_state(implementation):
  """`group=`: the group's state of a stack (the others NaN) steps as a plain state does (three
  tokens at once), and the other groups are left as they were."""
  inputs = round_to(make_inputs(17, seq_len=3, key_dim=16, value_dim=32, normalized_keys=False),
                    jnp.float32)
  args = {n: jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES}
  step = lambda state, **kw: fused_recurrent_gated_delta_rule(
      *[args[n] for n in ARG_NAMES[:5]], initial_state=state, output_final_state=True,
      use_qk_l2norm=True, implementation=implementation, **kw)
  o_plain, state_plain = step(args["initial_state"])
  o, stacked = step(stacked_in_poison(args["initial_state"]), group=jnp.int32(GROUP))
  assert_close(o, o_plain, jnp.float32, name="o")
  assert_close(stacked[GROUP], state_plain, jnp.float32, name="state")
  assert_other_groups_untouched(stacked)
  with pytest.raises(ValueError, match="output_final_state=True"):
    fused_recurrent_gated_delta_rule(*[args[n] for n in ARG_NAMES[:5]], initial_state=stacked,
                                     group=jnp.int32(GROUP))


def test_chunk_single_token():
  inputs = round_to(make_inputs(16, seq_len=1), jnp.float32)
  o, final_state = jax.jit(lambda *a: chunk_gated_delta_rule(
      *a[:5], initial_state=a[5], output_final_state=True))(
          *[jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES])
  with float64():
    o_ref, final_state_ref = naive_recurrent_gated_delta_rule(
        *[jnp.asarray(inputs[n], jnp.float64) for n in ARG_NAMES[:5]],
        initial_state=jnp.asarray(inputs["initial_state"], jnp.float64), output_final_state=True)
    o_ref, final_state_ref = np.asarray(o_ref), np.asarray(final_state_ref)
  assert o.shape == (2, 1, 2, 16)
  assert_close(o, o_ref, jnp.float32, name="o")
  assert_close(final_state, final_state_ref, jnp.float32, name="final_state")


def test_chunk_continuation_equals_one_run():
  # Prefill in two pieces whose boundary is not a chunk boundary, passing the state between them.
  # Halves of 50 tokens (one compile for both) with chunks of 32: the boundary is mid-chunk.
  inputs = round_to(make_inputs(17, seq_len=100), jnp.float32)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES[:5]]
  prefill = jax.jit(lambda *a, initial_state: chunk_gated_delta_rule(
      *a, initial_state=initial_state, output_final_state=True, config=ChunkConfig(32)))
  state = jnp.asarray(inputs["initial_state"], jnp.float32)
  o_full, state_full = prefill(*args, initial_state=state)
  o_first, state_mid = prefill(*[x[:, :50] for x in args], initial_state=state)
  o_second, state_end = prefill(*[x[:, 50:] for x in args], initial_state=state_mid)
  assert_close(jnp.concatenate([o_first, o_second], axis=1), o_full, jnp.float32, name="o")
  assert_close(state_end, state_full, jnp.float32, name="final_state")


def test_final_state_only_when_asked():
  # Shapes and dtypes only, so trace without compiling.
  inputs = make_inputs(18, seq_len=5)
  args = [jnp.asarray(inputs[n], jnp.bfloat16) for n in ARG_NAMES[:5]]
  for entry in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
    o, final_state = jax.eval_shape(entry, *args)
    assert final_state is None and o.shape == (2, 5, 2, 16) and o.dtype == jnp.bfloat16
    o, final_state = jax.eval_shape(
        lambda *a: entry(*a, output_final_state=True), *args)  # pylint: disable=cell-var-from-loop
    assert final_state.shape == (2, 2, 16, 16) and final_state.dtype == jnp.float32


@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "fused_recurrent"])
def test_implementation_names(entry):
  inputs = make_inputs(19, seq_len=3)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES[:5]]
  o_xla, _ = jax.jit(lambda *a: entry(*a, implementation="xla"))(*args)
  o_default, _ = jax.jit(entry)(*args)
  np.testing.assert_array_equal(o_xla, o_default)
  with pytest.raises(NotImplementedError, match="cudnn"):
    entry(*args, implementation="cudnn")
  for name in ("triton", "bogus"):
    with pytest.raises(ValueError, match=name):
      entry(*args, implementation=name)


def _shapes(**changes):
  shapes = {"q": (2, 5, 2, 8), "k": (2, 5, 2, 8), "v": (2, 5, 2, 4), "g": (2, 5, 2),
            "beta": (2, 5, 2), "initial_state": (2, 2, 8, 4)}
  shapes.update(changes)
  return shapes


@pytest.mark.parametrize("shapes,bad_arg", [
    (_shapes(q=(5, 2, 8)), "q"),
    (_shapes(k=(2, 5, 2, 7)), "k"),
    (_shapes(k=(2, 6, 2, 8)), "k"),
    (_shapes(v=(2, 5, 3, 4)), "v"),
    (_shapes(v=(2, 5, 2)), "v"),
    (_shapes(g=(2, 5, 2, 1)), "g"),
    (_shapes(g=(2, 4, 2)), "g"),
    (_shapes(beta=(2, 5)), "beta"),
    (_shapes(beta=(1, 5, 2)), "beta"),
    (_shapes(initial_state=(2, 2, 4, 8)), "initial_state"),
    (_shapes(initial_state=(2, 8, 4)), "initial_state"),
    (_shapes(q=(2, 0, 2, 8), k=(2, 0, 2, 8), v=(2, 0, 2, 4), g=(2, 0, 2), beta=(2, 0, 2)), "q"),
])
@pytest.mark.parametrize("entry", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule],
                         ids=["chunk", "fused_recurrent"])
def test_bad_shapes_raise_value_error_naming_the_argument(entry, shapes, bad_arg):
  arrays = {n: jnp.zeros(s, jnp.float32) for n, s in shapes.items()}
  with pytest.raises(ValueError, match=rf"\b{bad_arg}\b"):
    entry(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"],
          initial_state=arrays["initial_state"])


def test_integer_inputs_and_bad_config_raise_value_error():
  shapes = _shapes()
  arrays = {n: jnp.zeros(s, jnp.float32) for n, s in shapes.items()}
  with pytest.raises(ValueError, match="beta"):
    chunk_gated_delta_rule(arrays["q"], arrays["k"], arrays["v"], arrays["g"],
                           jnp.zeros(shapes["beta"], jnp.int32))
  with pytest.raises(ValueError, match="chunk_size"):
    ChunkConfig(0)


def test_tolerance_table_has_the_dtypes_used_here():
  assert tolerance(jnp.float32) == 1e-5 and tolerance(jnp.bfloat16) == 2e-2


def test_unit_lower_inverse_stays_exact_for_correlated_keys():
  """Nearly parallel keys (as training makes them) made the former power-series inverse overflow
  to NaN in float32; the blockwise inverse stays at float32 rounding, for any chunk size."""
  rng = np.random.default_rng(7)
  for size in (37, 64):
    k_CD = np.repeat(rng.normal(size=(1, 16)), size, 0) + 1e-3 * rng.normal(size=(size, 16))
    k_CD /= np.linalg.norm(k_CD, axis=-1, keepdims=True)
    a_CC = np.tril(0.9 * k_CD @ k_CD.T, -1)
    exact_CC = np.linalg.inv(np.eye(size) + a_CC)
    inverse_CC = np.asarray(reference.unit_lower_inverse(jnp.asarray(a_CC, jnp.float32)[None]))[0]
    assert np.abs(inverse_CC - exact_CC).max() <= 1e-5 * np.abs(exact_CC).max()
