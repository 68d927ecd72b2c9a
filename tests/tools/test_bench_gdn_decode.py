"""tools/bench_gdn_decode.py: a CPU run at a tiny preset times every swept config, and its looped
steps compute what the layer-by-layer recurrence does."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.tools import load_tool

from pallas_kernels.gated_delta_rule import fused_recurrent_gated_delta_rule


def test_tiny_preset_sweep_rows_and_json(tmp_path, capsys):
  bench = load_tool("bench_gdn_decode")
  output = tmp_path / "gdn.json"
  assert bench.main(["--presets", "lalte-tiny", "--batch", "2", "--rounds", "1", "--repeats", "1",
                     "--copy-mib", "4", "--sweep", "--json", str(output)]) == 0
  report = json.loads(output.read_text())
  configs = [(r["state_layout"], r["block_v"], r["num_warps"]) for r in report["rows"]]
  assert configs[:2] == [("vk", 16, 1), ("kv", 32, 2)]
  assert len(set(configs)) == len(configs) == 25
  assert sum(layout == "vk" for layout, _, _ in configs) == 9
  layers, heads, key_dim, value_dim = bench.gdn_shapes("lalte-tiny")
  assert (layers, heads, key_dim, value_dim) == (2, 2, 32, 32)
  assert all(r["bytes"] > 2 * 2 * heads * key_dim * value_dim * 4 and r["ratio"] > 0
             for r in report["rows"])
  assert "| lalte-tiny | kv | 32 | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_looped_steps_step_each_layer_in_turn(layout):
  bench = load_tool("bench_gdn_decode")
  token, state, _ = bench.step_inputs("lalte-tiny", 2, jax.random.key(0))
  timed = bench.looped_steps(token, state + 0, bench.DEFAULT_CONFIGS[layout], rounds=2,
                             state_layout=layout)
  o = timed.fn(*timed.input_sets[0])
  q, k, v, g, beta = token
  want_state, want_o = state, jnp.zeros(v.shape)
  for step in range(2 * state.shape[0]):
    group = step % state.shape[0]
    want_o, layer_state = fused_recurrent_gated_delta_rule(
        q + 0 * want_o, k, v, g, beta, scale=q.shape[-1] ** -0.5,
        initial_state=want_state[group], output_final_state=True, use_qk_l2norm=True,
        implementation="xla")
    want_state = want_state.at[group].set(layer_state)
  np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5)
