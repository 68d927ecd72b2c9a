"""tools/layer_parity.py: our own hidden states give zero error at every layer; a change to one
layer's output is found at that layer and position; NSA selection margins are reported."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.model import HybridLM
from tests.tools import load_tool

layer_parity = load_tool("layer_parity")


def test_layer_errors_locate_a_changed_layer():
  config = get_model_config("lansa-tiny")
  model = HybridLM(config, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, 80)), jnp.int32)
  h = model.embed(tokens)
  hidden = [np.asarray(h)]
  for block in layer_parity.blocks_in_depth_order(model):
    h = block(h, None)[0]
    hidden.append(np.asarray(h))
  hidden[-1] = np.asarray(model.final_norm(h))
  hidden = np.stack(hidden)
  np.testing.assert_allclose(np.asarray(model.logits_from_hidden(h)), np.asarray(model(tokens)),
                             rtol=1e-5, atol=1e-5)  # the blocks in this order are the model

  records = layer_parity.layer_errors(model, hidden)
  assert [r["kind"] for r in records] == list(config.layer_pattern)
  assert all(r["update_rel"] < 1e-5 and r["positions_over_1e-4"] == 0 for r in records)
  nsa = [r for r in records if r["kind"] == "nsa"]
  assert nsa and all(r["margin_min"] is not None and r["margin_min"] >= 0 for r in nsa)

  changed = hidden.copy()
  changed[2, 0, 37] += 0.5  # layer 1's output (= layer 2's input) at position 37
  records = layer_parity.layer_errors(model, changed)
  assert records[1]["update_rel"] > 1e-2 and records[1]["worst_positions"][0][:2] == [0, 37]
  assert records[0]["update_rel"] < 1e-5
