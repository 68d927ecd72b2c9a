"""tools/bench_router.py: a CPU run at a tiny preset gives every row, and its conv forms compute
the router's convolution."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from tests.tools import load_tool



def test_tiny_preset_rows_and_json(tmp_path, capsys):
  bench = load_tool("bench_router")
  output = tmp_path / "router.json"
  assert bench.main(["--presets", "lalte-tiny", "--batch", "1", "--seq_len", "32",
                     "--repeats", "1", "--json", str(output)]) == 0
  rows = json.loads(output.read_text())
  assert [r["row"] for r in rows] == [
      "router fwd+bwd, dropout, XLA", "router fwd+bwd, dropout, XLA, nothing kept",
      "router fwd+bwd, no dropout, XLA", "masks, hashed (ours)",
      "masks, threefry (jax.random.bernoulli)", "conv layers fwd+bwd, batched einsum (ours)",
      "conv layers fwd+bwd, shifted inputs in one matmul",
      "conv layers fwd+bwd, batched einsum, float32 taps",
      "conv layers fwd+bwd, grouped lax.conv, token-major"]
  assert all(r["ms"] > 0 and r["vs_first"] > 0 and r["preset"] == "lalte-tiny" for r in rows)
  # Each group's first row is its anchor.
  assert [r["vs_first"] for r in rows if r["vs_first"] == 1.0] == [1.0, 1.0, 1.0]
  assert [rows[i]["vs_first"] for i in (0, 3, 5)] == [1.0, 1.0, 1.0]
  assert "| lalte-tiny | 1 x 32 | masks, hashed (ours) |" in capsys.readouterr().out


def test_profile_breaks_the_training_steps_router_down_by_kernel(tmp_path, capsys):
  """At a tiny preset (no Pallas rows) the group's first row is traced: the CPU's XLA thunks."""
  bench = load_tool("bench_router")
  output = tmp_path / "router.json"
  assert bench.main(["--presets", "lalte-tiny", "--batch", "1", "--seq_len", "32",
                     "--repeats", "1", "--profile", "--profile_steps", "2",
                     "--json", str(output)]) == 0
  rows = json.loads(output.read_text())
  profiled = [r for r in rows if "profile" in r]
  assert [r["row"] for r in profiled] == ["router fwd+bwd, dropout, XLA"]
  profile = profiled[0]["profile"]
  assert profile["steps"] == 2 and profile["kernel_ms"] > 0
  assert {"matmul"} <= {row["class"] for row in profile["classes"]}
  assert "#### lalte-tiny router fwd+bwd, dropout, XLA: B 1, T 32" in capsys.readouterr().out


def test_the_compared_conv_forms_equal_the_router_conv():
  bench = load_tool("bench_router")
  h_KBTC = jax.random.normal(jax.random.key(0), (3, 2, 40, 16))
  weight_KICO = jax.random.normal(jax.random.key(1), (3, 3, 16, 8))
  want = np.asarray(bench.grouped_conv_same(h_KBTC, weight_KICO, 2))
  np.testing.assert_allclose(np.asarray(bench.float32_taps_conv(h_KBTC, weight_KICO, 2)), want,
                             atol=1e-4)
  token_major = bench.lax_grouped_conv(jnp.transpose(h_KBTC, (1, 2, 0, 3)), weight_KICO, 2)
  np.testing.assert_allclose(np.asarray(jnp.transpose(token_major, (2, 0, 1, 3))), want,
                             atol=1e-4)


def test_the_shifted_inputs_form_and_its_backward_equal_the_router_conv():
  bench = load_tool("bench_router")
  h_KBTC = jax.random.normal(jax.random.key(0), (3, 2, 37, 16))
  weight_KICO = jax.random.normal(jax.random.key(1), (3, 3, 16, 8))
  cotangent = jax.random.normal(jax.random.key(2), (3, 2, 37, 8))
  grads = lambda conv: jax.grad(lambda h, w: jnp.sum(conv(h, w, 2) * cotangent), (0, 1))(
      h_KBTC, weight_KICO)
  np.testing.assert_allclose(np.asarray(bench.shifted_inputs_conv(h_KBTC, weight_KICO, 2)),
                             np.asarray(bench.grouped_conv_same(h_KBTC, weight_KICO, 2)),
                             atol=1e-4)
  for got, want in zip(grads(bench.shifted_inputs_conv), grads(bench.grouped_conv_same)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-3)
