"""tools/bench_decode_matmul.py: a CPU run at a tiny preset times every swept config, and its
chained layers compute the model's MLP residual blocks."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from tests.tools import load_tool

from lalte_jax.config import get_model_config
from lalte_jax.layers.norms import rms_norm


def test_tiny_preset_sweep_rows_and_json(tmp_path, capsys):
  bench = load_tool("bench_decode_matmul")
  output = tmp_path / "matmul.json"
  assert bench.main(["--preset", "lalte-tiny", "--rows", "3", "--repeats", "1",
                     "--copy-mib", "4", "--sweep", "--json", str(output)]) == 0
  report = json.loads(output.read_text())
  assert [r["rows"] for r in report["rows"]] == [3] * 13
  assert all(r["fused_ms"] > 0 and r["xla_ms"] > 0 and r["fused_of_copy"] > 0
             for r in report["rows"])
  config = get_model_config("lalte-tiny")
  assert report["weight_bytes"] == (config.num_layers * 3 * config.hidden_size
                                    * config.intermediate_size * 2 + config.num_layers
                                    * config.hidden_size * 2)
  assert "| 3 | 64 | 256 | 4 | 3 |" in capsys.readouterr().out


def test_chain_is_the_models_mlp_residual_blocks():
  bench = load_tool("bench_decode_matmul")
  config = get_model_config("lalte-tiny")
  layers, _ = bench.mlp_weights("lalte-tiny", jax.random.key(1), jnp.float32)
  h, delta = (jax.random.normal(key, (2, config.hidden_size)) for key in jax.random.split(
      jax.random.key(2), 2))
  got = bench.mlp_chain("pallas", bench.DecodeMatmulConfig(), config.norm_eps)(h, delta, layers)
  want = h
  for norm, w_gate_up, w_down in layers:
    want = want + delta
    gate, up = jnp.split(rms_norm(want, norm, config.norm_eps) @ w_gate_up, 2, axis=-1)
    delta = (jax.nn.silu(gate) * up) @ w_down
  np.testing.assert_allclose(np.asarray(got), np.asarray(want + delta), rtol=2e-5, atol=2e-5)
