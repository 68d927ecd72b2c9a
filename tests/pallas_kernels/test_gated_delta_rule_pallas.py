"""Gated delta rule, `implementation="pallas"`: the Pallas kernels against the float64 recurrence.

Off the GPU the kernels run in Pallas interpret mode, so these tests check the kernels' logic
(chunk loop, V-blocking, padding of T, K and V, the hand-written backward) on tiny shapes; the
`gpu`-marked test repeats the check compiled by Triton at a realistic shape. Inputs, loss and
comparisons are those of test_gated_delta_rule.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule import (
    ChunkConfig,
    RecurrentConfig,
    StatePassConfig,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from tests.kernel_testing import assert_close, float64
from tests.pallas_kernels.test_gated_delta_rule import (
    ARG_NAMES,
    compare,
    make_inputs,
    round_to,
    run,
    run_reference,
)

# Two V-blocks per head (block_v 16 < V = 32), so the grid's V axis and the per-block state slices
# are exercised, with the V-block axis first in the grid (the default) and last.
SPLIT_V = StatePassConfig(block_v=16, block_v_train=16, block_v_bwd=16)
SPLIT_V_LAST = dataclasses.replace(SPLIT_V, v_blocks_adjacent=False)


# T = 37 and 70 are not multiples of the chunk; K = 24 and V = 20 are not powers of two (padded);
# K != V catches transposed axes. Each row is one compile of forward + gradient (seconds).
@pytest.mark.slow
@pytest.mark.parametrize("seq_len,chunk_size,key_dim,value_dim,with_state,use_qk_l2norm,state", [
    (37, 16, 16, 32, True, False, SPLIT_V),
    (37, 16, 16, 32, False, True, SPLIT_V_LAST),
    (70, 32, 32, 16, False, True, None),
    (37, 16, 24, 20, True, True, StatePassConfig(num_stages=1, num_stages_bwd=3,
                                                 separate_output_train=False)),
], ids=["T37_C16_state_raw_splitV", "T37_C16_nostate_splitV_grid_last", "T70_C32_nostate_l2norm",
        "T37_C16_K24_V20_padded_o_in_pass"])
def test_chunk_pallas_float32_matches_float64_recurrence(seq_len, chunk_size, key_dim, value_dim,
                                                         with_state, use_qk_l2norm, state):
  inputs = round_to(make_inputs(100 + seq_len + key_dim, seq_len=seq_len, key_dim=key_dim,
                                value_dim=value_dim, normalized_keys=not use_qk_l2norm),
                    jnp.float32)
  kwargs = dict(use_qk_l2norm=use_qk_l2norm)
  actual = run(chunk_gated_delta_rule, inputs, jnp.float32, with_state=with_state,
               implementation="pallas", config=ChunkConfig(chunk_size, state_pass=state),
               **kwargs)
  expected = run_reference(inputs, with_state=with_state, **kwargs)
  compare(actual, expected, jnp.float32,
          f"pallas float32 T={seq_len} C={chunk_size} K={key_dim} V={value_dim}")


@pytest.mark.slow
def test_chunk_pallas_bf16_matches_float64_recurrence():
  # bf16 inputs: bf16 matmul operands and bf16 storage of w, u, v_new and the chunk states, float32
  # states and accumulation; the reference sees the same bf16-rounded inputs.
  inputs = round_to(make_inputs(121, seq_len=70, key_dim=32, value_dim=32, normalized_keys=False),
                    jnp.bfloat16)
  actual = run(chunk_gated_delta_rule, inputs, jnp.bfloat16, with_state=True,
               use_qk_l2norm=True, implementation="pallas",
               config=ChunkConfig(16, state_pass=SPLIT_V))
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.bfloat16, "pallas bf16 T=70 C=16")


def test_chunk_pallas_strong_decay_stays_finite():
  inputs = round_to(make_inputs(122, seq_len=40, decay_shift=-2.0, decay_spread=8.0),
                    jnp.float32)
  assert inputs["g"].min() < -20
  actual = run(chunk_gated_delta_rule, inputs, jnp.float32, with_state=True,
               implementation="pallas", config=ChunkConfig(16))
  expected = run_reference(inputs, with_state=True)
  compare(actual, expected, jnp.float32, "pallas float32 strong decay")


def test_chunk_pallas_correlated_keys_stay_exact():
  # Keys of a chunk nearly parallel and beta ~ 1, as after training on repetitive text: the
  # entries of A approach 1 and the doubling inverse of reference.unit_lower_inverse (powers of A
  # up to ~1e16 cancelling to O(1)) returns garbage in float32 (the "xla" path gives NaN here); the
  # kernel's forward substitution must stay at float32 accuracy.
  inputs = make_inputs(127, seq_len=70, key_dim=32, value_dim=32, normalized_keys=False,
                       decay_shift=6.0)
  shared_direction = np.random.default_rng(0).standard_normal((1, 1, 1, 32))
  inputs["k"] = shared_direction + 0.1 * inputs["k"]
  inputs["beta"] = 0.9 + 0.1 * inputs["beta"]
  inputs = round_to(inputs, jnp.float32)
  actual = run(chunk_gated_delta_rule, inputs, jnp.float32, with_state=True, use_qk_l2norm=True,
               implementation="pallas")
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.float32, "pallas float32 correlated keys")


def test_fused_recurrent_pallas_matches_float64_recurrence_and_decodes():
  inputs = round_to(make_inputs(123, seq_len=6, key_dim=16, value_dim=32, normalized_keys=False),
                    jnp.float32)
  kwargs = dict(use_qk_l2norm=True)
  entry = lambda *a, **kw: fused_recurrent_gated_delta_rule(
      *a, implementation="pallas", **kw)
  actual = run(entry, inputs, jnp.float32, with_state=True, **kwargs)
  expected = run_reference(inputs, with_state=True, **kwargs)
  compare(actual, expected, jnp.float32, "pallas fused_recurrent T=6")
  # One token at a time with the state passed along equals the multi-token call.
  args = {n: jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES}
  decode = jax.jit(lambda *a, initial_state: fused_recurrent_gated_delta_rule(
      *a, initial_state=initial_state, output_final_state=True, use_qk_l2norm=True,
      implementation="pallas"))
  state = args["initial_state"]
  outputs = []
  for t in range(3):
    o_t, state = decode(*[args[n][:, t:t + 1] for n in ARG_NAMES[:5]], initial_state=state)
    outputs.append(o_t)
  assert_close(jnp.concatenate(outputs, axis=1), expected[0][:, :3], jnp.float32, name="decoded o")


def with_kv_states(state_layout, *args, initial_state=None, **kwargs):
  """fused_recurrent_gated_delta_rule on states of `state_layout`, taking and returning them as
  [B, H, K, V] (so that `run` and `compare` apply to either layout, gradients included)."""
  as_layout = (lambda x: x) if state_layout == "kv" else (lambda x: jnp.swapaxes(x, -1, -2))
  o, state = fused_recurrent_gated_delta_rule(
      *args, initial_state=None if initial_state is None else as_layout(initial_state),
      state_layout=state_layout, **kwargs)
  return o, None if state is None else as_layout(state)


def test_fused_recurrent_pallas_on_a_transposed_state_matches_float64_recurrence():
  """The "vk" layout's output, final state and every gradient (through the custom_vjp), T = 6."""
  inputs = round_to(make_inputs(129, seq_len=6, key_dim=16, value_dim=32, normalized_keys=False),
                    jnp.float32)
  actual = run(functools.partial(with_kv_states, "vk"), inputs, jnp.float32, with_state=True,
               use_qk_l2norm=True, implementation="pallas")
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.float32, "pallas fused_recurrent T=6, vk layout")


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_fused_recurrent_steps_a_transposed_state(implementation):
  """state_layout="vk" takes and returns states stored as [..., V, K]: output and state equal the
  "kv" layout's on the transposed state, stacked (only the stepped group changes) and plain, with
  two V-blocks per head in the Pallas kernel and K != V (so a swapped axis shows)."""
  inputs = round_to(make_inputs(128, seq_len=2, key_dim=16, value_dim=32, normalized_keys=False),
                    jnp.float32)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES[:5]]
  state_BHKV = jnp.asarray(inputs["initial_state"], jnp.float32)
  stacked_GBHKV = jnp.stack([state_BHKV * 0.5, state_BHKV, state_BHKV * -2.0])
  # The "vk" default config (block_v 16) steps V = 32 as two blocks.
  step = lambda state, layout, group: fused_recurrent_gated_delta_rule(
      *args, initial_state=state, output_final_state=True, use_qk_l2norm=True, group=group,
      state_layout=layout, implementation=implementation)
  transposed = lambda x: jnp.swapaxes(x, -1, -2)
  group = jnp.asarray(1, jnp.int32)
  o_kv, stacked_kv = step(stacked_GBHKV, "kv", group)
  o_vk, stacked_vk = step(transposed(stacked_GBHKV), "vk", group)
  assert stacked_vk.shape == (3, *state_BHKV.shape[:2], 32, 16)
  assert_close(o_vk, o_kv, jnp.float32, name="o, vk layout")
  assert_close(transposed(stacked_vk), stacked_kv, jnp.float32, name="state, vk layout")
  np.testing.assert_array_equal(np.asarray(stacked_vk[0]), np.asarray(transposed(stacked_GBHKV[0])))
  o_plain, state_plain = step(transposed(state_BHKV), "vk", None)
  assert_close(o_plain, o_kv, jnp.float32, name="o, plain state, vk layout")
  assert_close(transposed(state_plain), stacked_kv[1], jnp.float32, name="plain state, vk layout")
  with pytest.raises(ValueError, match="state_layout"):
    step(state_BHKV, "hv", None)
  with pytest.raises(ValueError, match=r"initial_state must have shape \[B,H,V,K\] = \(2, 2, 32,"
                     r" 16\)"):
    step(state_BHKV, "vk", None)  # a [B, H, K, V] state where [B, H, V, K] is due


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_fused_recurrent_pallas_prepares_bf16_inputs_in_the_kernel(use_qk_l2norm):
  """bf16 q, k, v (as a decoding step passes them) upcast, l2-normalised and scaled inside the
  kernel: the float64 recurrence of the same bf16 values, with and without the normalisation
  and with an explicit scale."""
  inputs = round_to(make_inputs(127, seq_len=5, key_dim=32, value_dim=32,
                                normalized_keys=not use_qk_l2norm), jnp.bfloat16)
  kwargs = dict(use_qk_l2norm=use_qk_l2norm, scale=0.3)
  actual = run(lambda *a, **kw: fused_recurrent_gated_delta_rule(*a, implementation="pallas",
                                                                 **kw),
               inputs, jnp.bfloat16, with_state=True, **kwargs)
  expected = run_reference(inputs, with_state=True, **kwargs)
  compare(actual, expected, jnp.bfloat16, f"pallas fused_recurrent bf16 l2norm={use_qk_l2norm}")


def test_unsupported_inputs_raise():
  inputs = make_inputs(124, seq_len=5)
  args = [jnp.asarray(inputs[n], jnp.float32) for n in ARG_NAMES[:5]]
  with pytest.raises(NotImplementedError, match="chunk_size"):
    chunk_gated_delta_rule(*args, implementation="pallas", config=ChunkConfig(24))
  wide = make_inputs(124, seq_len=5, key_dim=300)
  with pytest.raises(NotImplementedError, match="K = 512"):
    chunk_gated_delta_rule(*[jnp.asarray(wide[n], jnp.float32) for n in ARG_NAMES[:5]],
                           implementation="pallas")
  with float64():
    args64 = [jnp.asarray(inputs[n], jnp.float64) for n in ARG_NAMES[:5]]
    for entry in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule):
      with pytest.raises(NotImplementedError, match="float64"):
        entry(*args64, implementation="pallas")
  with pytest.raises(ValueError, match="block_v"):
    StatePassConfig(block_v=48)
  with pytest.raises(ValueError, match="num_warps"):
    RecurrentConfig(num_warps=0)
  with pytest.raises(ValueError, match="state_pass"):
    ChunkConfig(64, state_pass=(32, 4, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bf16"])
def test_chunk_pallas_on_gpu_matches_float64_recurrence(dtype):
  # Compiled by Triton at a realistic head size; T = 1000 is not a multiple of the chunk.
  inputs = round_to(make_inputs(125, seq_len=1000, batch=2, heads=4, key_dim=128, value_dim=128,
                                normalized_keys=False), dtype)
  actual = run(chunk_gated_delta_rule, inputs, dtype, with_state=True, use_qk_l2norm=True,
               implementation="pallas")
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, dtype, f"pallas GPU {jnp.dtype(dtype).name} B2 T1000 H4 K=V=128")


@pytest.mark.gpu
@pytest.mark.parametrize("state_layout", ["kv", "vk"])
def test_fused_recurrent_pallas_on_gpu_matches_float64_recurrence(state_layout):
  inputs = round_to(make_inputs(126, seq_len=64, batch=2, heads=4, key_dim=128, value_dim=128,
                                normalized_keys=False), jnp.float32)
  actual = run(functools.partial(with_kv_states, state_layout), inputs, jnp.float32,
               with_state=True, use_qk_l2norm=True, implementation="pallas")
  expected = run_reference(inputs, with_state=True, use_qk_l2norm=True)
  compare(actual, expected, jnp.float32, f"pallas GPU fused_recurrent T=64 {state_layout}")

