"""The GDN layer's decode step with its six input projections as one GEMM
(`GatedDeltaNet.decode_input_kernel`, stored by `fuse_decode_projections`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.inference import caches
from lalte_jax.inference.caches import StepContext
from lalte_jax.inference.group_slot import plain_of_view, view_of_plain
from lalte_jax.mixers.gdn import INPUT_PROJECTIONS, GatedDeltaNet


def tiny_layer():
  return GatedDeltaNet(get_model_config("gdn-tiny").replace(init_std=0.2), rngs=nnx.Rngs(0))


def prepared_copy(layer):
  """A copy of `layer` prepared for decoding (the original keeps its projections)."""
  prepared = nnx.merge(*nnx.split(layer))
  prepared.fuse_decode_projections()
  return prepared


# Prefill and decode steps run jitted, as in generation (op by op, each small op of the layer
# would lower and compile on its own).
@nnx.jit
def prefill(layer, x_BTD, valid_BT, cache):
  """(h - x, cache) of the layer's prefill of a left-padded prompt."""
  return layer.prefill(x_BTD, lambda h: h, cache, StepContext.for_prompt(valid_BT))


def prefilled_cache(layer, x_BTD, valid_BT):
  """The layer's cache after a left-padded prompt."""
  empty = caches._gdn_cache(layer.config, x_BTD.shape[0])  # pylint: disable=protected-access
  return prefill(layer, x_BTD, valid_BT, empty)[1]


@nnx.jit
def decode_step(layer, x_B1D, cache, pad_count_B, position):
  ctx = StepContext(valid_BT=jnp.ones((x_B1D.shape[0], 1), bool), pad_count_B=pad_count_B,
                    position=position)
  out_B1D, view = layer.decode(x_B1D, view_of_plain(cache), ctx)
  return out_B1D, plain_of_view(view)


def decode_tokens(layer, x_BND, cache, pad_count_B, prompt_length):
  """Outputs [B, N, D] and the cache after decoding x's N tokens one at a time."""
  outputs = []
  for n in range(x_BND.shape[1]):
    out_B1D, cache = decode_step(layer, x_BND[:, n:n + 1], cache, pad_count_B,
                                 jnp.asarray(prompt_length + n, jnp.int32))
    outputs.append(out_B1D)
  return jnp.concatenate(outputs, axis=1), cache


def assert_trees_close(got, want, tolerance):
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), rtol=tolerance,
                               atol=tolerance)


# Prompts of 6 tokens (row 1 with 2 left pads), then 7 decode steps.
PROMPT, STEPS = 6, 7


def prompt_and_tokens(hidden):
  x_BTD = jax.random.normal(jax.random.key(1), (2, PROMPT, hidden))
  x_BND = jax.random.normal(jax.random.key(2), (2, STEPS, hidden))
  valid_BT = jnp.asarray([[True] * PROMPT, [False] * 2 + [True] * (PROMPT - 2)])
  return x_BTD, x_BND, valid_BT


def test_fused_layer_decodes_as_the_unprepared_one():
  """Outputs and caches of the prepared layer (one GEMM) and of the unprepared one (six)."""
  layer = tiny_layer()
  x_BTD, x_BND, valid_BT = prompt_and_tokens(layer.config.hidden_size)
  cache = prefilled_cache(layer, x_BTD, valid_BT)
  pad_count_B = StepContext.for_prompt(valid_BT).pad_count_B
  want = decode_tokens(layer, x_BND, cache, pad_count_B, PROMPT)
  got = decode_tokens(prepared_copy(layer), x_BND, cache, pad_count_B, PROMPT)
  assert float(jnp.abs(want[0]).max()) > 0.1  # the outputs carry signal
  assert_trees_close(got, want, 1e-5)


def test_fused_decode_gives_the_prefill_of_the_whole_sequence():
  """The prepared layer's steps against a prefill of prompt and tokens together: the same
  outputs, conv rings and state (up to the chunked rule's rounding)."""
  layer = tiny_layer()
  x_BTD, x_BND, valid_BT = prompt_and_tokens(layer.config.hidden_size)
  cache = prefilled_cache(layer, x_BTD, valid_BT)
  pad_count_B = StepContext.for_prompt(valid_BT).pad_count_B
  out_BND, decoded = decode_tokens(prepared_copy(layer), x_BND, cache, pad_count_B, PROMPT)
  x_BSD = jnp.concatenate([x_BTD, x_BND], axis=1)
  valid_BS = jnp.concatenate([valid_BT, jnp.ones((2, STEPS), bool)], axis=1)
  empty = caches._gdn_cache(layer.config, 2)  # pylint: disable=protected-access
  h_BSD, whole = prefill(layer, x_BSD, valid_BS, empty)
  assert_trees_close((out_BND, decoded), ((h_BSD - x_BSD)[:, PROMPT:], whole), 1e-5)


def test_fusing_stores_one_kernel_in_place_of_the_six():
  layer = tiny_layer()
  kernels = [np.asarray(getattr(layer, name).kernel[...]) for name in INPUT_PROJECTIONS]
  layer.fuse_decode_projections()
  assert layer.decode_only
  state = nnx.state(layer, nnx.Param)
  assert not any(name in state for name in INPUT_PROJECTIONS)
  np.testing.assert_array_equal(np.asarray(state["decode_in_kernel"][...]),
                                np.concatenate(kernels, axis=1))
  assert layer.decode_in_kernel.shape[1] == sum(layer.input_widths())


def test_a_fresh_layer_has_no_fused_kernel():
  """Fusing happens only when asked: the parameters of a new layer (and so checkpoints) are the
  six projections."""
  state = nnx.state(tiny_layer(), nnx.Param)
  assert "decode_in_kernel" not in state
  assert all(name in state for name in INPUT_PROJECTIONS)


def test_prepared_layer_refuses_to_run_a_prompt():
  layer = tiny_layer()
  prepared = prepared_copy(layer)
  x_BTD = jnp.ones((1, 3, layer.config.hidden_size))
  with pytest.raises(RuntimeError, match="fuse_decode_projections.*only decodes"):
    prepared(x_BTD)
  with pytest.raises(RuntimeError, match="fuse_decode_projections.*only decodes"):
    prefilled_cache(prepared, x_BTD, jnp.ones((1, 3), bool))
