"""tools/bench_serving.py: the decode step's HBM bytes from the shapes, and a CPU run of tiny
presets with --json."""

import importlib.util
import json
import types

import jax
import numpy as np
import pytest
from flax import nnx
from tests.tools import load_tool

from lalte_jax import generate as gen
from lalte_jax.config import get_model_config
from lalte_jax.model import HybridLM

BATCH, CONTEXT, MAX_LENGTH = 4, 40, 100


def _abstract(preset: str, **changes):
  """The model and its cache as shapes only (nothing computed)."""
  config = get_model_config(preset).replace(dtype="bfloat16", **changes)
  model = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  cache = jax.eval_shape(lambda: gen.init_cache(model, BATCH, max_length=MAX_LENGTH))
  return config, model, cache


def _param_bytes(model) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_step_bytes_count_what_a_decode_step_moves():
  bench = load_tool("bench_serving")
  # gdn_attn-tiny: 2 groups of (GDN, full attention), tied embeddings (the table is the LM head).
  config, model, cache = _abstract("gdn_attn-tiny")
  gdn, attention = config.gdn, config.attention
  groups = config.num_layers // 2
  state = groups * BATCH * gdn.num_heads * gdn.head_dim * gdn.head_dim * 4  # float32
  conv = groups * BATCH * gdn.conv_size * 3 * gdn.num_heads * gdn.head_dim * 2  # q, k, v rings
  # Full attention reads its CONTEXT + 1 filled slots of MAX_LENGTH, keys and values.
  keys = groups * BATCH * (CONTEXT + 1) * attention.num_kv_heads * attention.head_dim * 2 * 2
  moved = bench.step_bytes(model, cache, BATCH, CONTEXT)
  assert moved["weights"] == _param_bytes(model)
  assert moved["cache"] == conv + 2 * state + keys
  assert moved["total"] == moved["weights"] + moved["cache"]
  # Untied, the embedding table is only gathered from: B rows of it.
  untied, model, cache = _abstract("gdn_swa-tiny", tie_embeddings=False)
  table = untied.vocab_size * untied.hidden_size * 4  # float32 parameters
  moved = bench.step_bytes(model, cache, BATCH, CONTEXT)
  assert moved["weights"] == _param_bytes(model) - table + BATCH * untied.hidden_size * 4
  # An SWA ring is read whole: the same bytes after any context.
  assert bench.step_bytes(model, cache, BATCH, 3)["cache"] == moved["cache"]


def test_step_bytes_of_nsa_read_the_selected_blocks_window_and_complete_means():
  bench = load_tool("bench_serving")
  config, model, cache = _abstract("lansa-tiny")
  nsa = config.nsa
  groups = config.num_layers // 2
  per_key = groups * BATCH * nsa.num_kv_heads * nsa.head_dim * 2 * 2  # keys and values, bf16
  read_keys = nsa.block_count * nsa.block_size + nsa.window_size
  complete_blocks = (CONTEXT + 1) // nsa.block_size
  means = per_key * complete_blocks  # block means of keys and values, in the cache's dtype
  nsa_bytes = bench.step_bytes(model, cache, BATCH, CONTEXT)["cache"] - bench._layer_cache_bytes(
      "gdn", config, cache.layers[0], CONTEXT)
  assert read_keys < MAX_LENGTH
  assert nsa_bytes == per_key * read_keys + means


@pytest.mark.slow
def test_tiny_presets_rows_json_and_table(tmp_path, capsys):
  bench = load_tool("bench_serving")
  output = tmp_path / "serving.json"
  assert bench.main(["--presets", "lalte-tiny", "gdn_attn-tiny", "--batches", "2",
                     "--prompts", "24", "40", "--steps", "2", "--warmup", "1",
                     "--prefill-iters", "1", "--copy-mib", "8", "--generate", "9", "16",
                     "--json", str(output)]) == 0
  report = json.loads(output.read_text())
  assert report["copy_gb_per_s"] > 0 and report["copy_gb_per_s_synchronous"] > 0
  assert "--xla_cpu_use_xnnpack=false" in report["xla_flags"]  # the flags the run had
  assert report["device_kind"]
  rows = report["rows"]
  assert [(r["model"], r["prompt"]) for r in rows] == [
      ("lalte-tiny", 24), ("lalte-tiny", 40), ("gdn_attn-tiny", 24), ("gdn_attn-tiny", 40)]
  for r in rows:
    assert r["status"] == "ok" and r["batch"] == 2
    assert r["prefill_tokens_per_s"] == pytest.approx(2 * r["prompt"] / r["prefill_s"])
    assert r["decode_tokens_per_s"] == pytest.approx(2 / r["decode_ms"] * 1e3)
    assert r["bound_ms"] == pytest.approx(
        r["step_bytes"]["total"] / (report["copy_gb_per_s"] * 1e9) * 1e3)
    assert r["of_bound"] == pytest.approx(r["bound_ms"] / r["decode_ms"])
    assert r["pipelined_of_bound"] == pytest.approx(r["bound_ms"] / r["decode_pipelined_ms"])
    assert r["prefill_memory"] > 0 and r["decode_memory"] > 0
    assert r["generate_memory"] > r["decode_memory"]  # the prefill runs in generate's program
    assert np.isfinite(r["generate_ms_per_token"])  # a difference of times: noisy on a CPU
    assert r["generate_of_bound"] == pytest.approx(r["bound_ms"] / r["generate_ms_per_token"])
  # laLTE's cache has a constant size; full attention reads more after a longer prompt.
  assert rows[0]["step_bytes"] == rows[1]["step_bytes"]
  assert rows[3]["step_bytes"]["cache"] > rows[2]["step_bytes"]["cache"]
  printed = capsys.readouterr().out
  assert printed.count("| lalte-tiny | 2 |") == 2 and "of bound" in printed
  assert "generate ms / token" in printed and "(prefill / decode / generate)" in printed


def test_profile_generate_gives_the_per_token_difference_by_class(monkeypatch):
  """The SHORT call's class times are subtracted from the LONG call's and divided by the tokens
  between them (fake breakdowns; a class only the longer call has counts from zero)."""
  bench = load_tool("bench_serving")

  def breakdown(wall, busy, kernel, classes):
    return {"source": "GPU kernels", "wall_ms": wall, "busy_ms": busy, "idle_ms": wall - busy,
            "kernel_ms": kernel,
            "classes": [{"class": name, "ms": ms, "launches": launches, "top": []}
                        for name, ms, launches in classes]}

  calls = iter([breakdown(10.0, 8.0, 9.0, [("matmul", 4.0, 100), ("copy / transpose", 1.0, 10)]),
                breakdown(30.0, 20.0, 23.0, [("matmul", 12.0, 300), ("copy / transpose", 7.0, 30),
                                             ("XLA: reduction", 2.0, 40)])])
  monkeypatch.setattr(bench.step_profile, "profile_step",
                      lambda run, carry, text, *, steps, warmup: (next(calls), None))
  compiled = types.SimpleNamespace(as_text=lambda: "")
  monkeypatch.setattr(bench.gen, "lower_generate",
                      lambda *args, **kwargs: types.SimpleNamespace(compile=lambda: compiled))
  profile = bench.profile_generate(None, None, (10, 20))
  assert (profile["wall_ms"], profile["busy_ms"], profile["idle_ms"], profile["kernel_ms"]) == \
      pytest.approx((2.0, 1.2, 0.8, 1.4))
  assert [(c["class"], c["ms"], c["launches"]) for c in profile["classes"]] == [
      ("matmul", pytest.approx(0.8), pytest.approx(20.0)),
      ("copy / transpose", pytest.approx(0.6), pytest.approx(2.0)),
      ("XLA: reduction", pytest.approx(0.2), pytest.approx(4.0))]


@pytest.mark.slow
def test_tiny_preset_generate_profile(tmp_path, capsys):
  bench = load_tool("bench_serving")
  output = tmp_path / "serving.json"
  assert bench.main(["--presets", "lalte-tiny", "--batches", "2", "--prompts", "24",
                     "--steps", "2", "--warmup", "1", "--prefill-iters", "1", "--copy-mib", "8",
                     "--generate", "9", "16", "--profile-generate", "--json", str(output)]) == 0
  profile = json.loads(output.read_text())["rows"][0]["generate_profile"]
  assert profile["new_tokens"] == [9, 16] and profile["classes"]
  assert all(np.isfinite(c["ms"]) for c in profile["classes"])
  assert "#### `generate` per token: lalte-tiny, batch 2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--presets", "lalte-huge"], "--presets: "),
    (["--batches", "0"], "must be >= 1"),
    (["--warmup", "-1"], "--warmup >= 0"),
    (["--generate", "100", "300"], "one bucket"),
    (["--generate", "16", "9"], "SHORT < LONG"),
    (["--profile-generate"], "needs --generate"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    load_tool("bench_serving").main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_compare_fla_without_its_packages_says_what_is_missing(capsys):
  missing = [name for name in load_tool("fla_models").FLA_PACKAGES
             if importlib.util.find_spec(name) is None]
  if not missing:
    pytest.skip("PyTorch, transformers and FLA are installed here")
  with pytest.raises(SystemExit) as exit_info:
    load_tool("bench_serving").main(["--compare-fla", "--presets", "gdn_swa-tiny"])
  assert exit_info.value.code == 2
  assert f"not importable here: {', '.join(missing)}" in capsys.readouterr().err
