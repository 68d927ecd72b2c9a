"""tools/bench_train.py: a CPU smoke run of a tiny preset through the default child-process path
(with --profile), and the out-of-memory classification and command-line plumbing it relies on."""

import argparse
import json
import pathlib
import sys

import pytest
from tests.tools import load_tool
from tests.child_processes import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench_train.py"


@pytest.mark.slow
def test_tiny_preset_runs_and_reports(tmp_path, children):
  output = tmp_path / "bench.json"
  env = child_env()
  done = children.run(
      [sys.executable, str(SCRIPT), "--presets", "lalte-tiny", "--seq_len", "64", "--steps", "2",
       "--warmup", "1", "--batch", "2", "--grad_accum", "2", "--remat", "block",
       "--scan_layers", "false", "--lte_kept_fraction", "0.5", "--profile", "--profile_steps", "1",
       "--json", str(output)],
      cwd=tmp_path, env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  (result,) = json.loads(output.read_text())
  assert result["status"] == "ok", result
  assert result["preset"] == "lalte-tiny" and result["global_batch"] == 4  # 2 x 1 device x 2
  assert result["scan_layers"] is False
  assert len(result["step_times_s"]) == 2 and result["step_time_s"] > 0
  assert result["tokens_per_s"] == pytest.approx(4 * 64 / result["step_time_s"])
  assert result["compile_s"] > 0 and result["flops_per_token"] > 0
  assert result["mfu"] is None  # CPU: no datasheet peak
  assert 0 < result["final_loss"] < 10  # random tokens over a 256-token vocabulary: ~ln 256
  # The routers recalibrated before each step: the last timed step kept the share asked for
  # (256 tokens a head under another dropout draw: within a few hundredths).
  assert result["lte_kept_fraction"] == pytest.approx(0.5, abs=0.08)
  assert "| lalte-tiny | ok | 64 | 2 x 2 | block |" in done.stdout
  profile = result["profile"]  # the same step traced on the CPU: its XLA thunks by class
  assert profile["source"] == "CPU thunks" and profile["module"] == "jit_train_step"
  classes = {row["class"] for row in profile["classes"]}
  assert {"matmul", "XLA: optimizer update", "XLA: remat recompute"} <= classes
  assert "#### lalte-tiny train step: T 64, batch 4, bfloat16, remat block, cpu" in done.stdout


def test_out_of_memory_is_recognised_and_reported(monkeypatch):
  bench = load_tool("bench_train")
  assert bench.is_out_of_memory(RuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 81.2GiB."))
  assert not bench.is_out_of_memory(ValueError("TrainConfig.size: 'huge' is not one of ..."))

  def out_of_memory(preset, args):
    raise RuntimeError(f"RESOURCE_EXHAUSTED: Out of memory allocating the state of {preset}")
  monkeypatch.setattr(bench, "bench_preset", out_of_memory)
  args = bench.parse_args(["--presets", "lalte-1.4b", "--batch", "8"])
  result = bench.run_one("lalte-1.4b", argparse.Namespace(**{**vars(args), "batch": 8}))
  assert result["status"] == "oom" and "RESOURCE_EXHAUSTED" in result["error"]
  assert "| lalte-1.4b | oom |" in bench.markdown_table([result])


def test_children_get_the_flags_but_one_preset_and_one_batch():
  bench = load_tool("bench_train")
  argv = ["--presets", "a-tiny", "b-tiny", "--batch", "2", "4", "--json", "x.json",
          "--remat=dots", "--in_process", "--batch=8"]
  assert bench._argv_without_presets(argv) == ["--remat=dots"]  # pylint: disable=protected-access


def test_xla_flags_reach_the_environment_and_the_results(monkeypatch):
  """--xla_flags replaces a setting of the same flag in XLA_FLAGS before any backend starts (the
  children inherit it), and every result records the flags its step ran with."""
  bench = load_tool("bench_train")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=false --xla_other=1")
  seen = {}

  def fake_bench(preset, args):
    seen["flags"] = bench.os.environ["XLA_FLAGS"]
    return {"preset": preset, "status": "ok", "batch_per_device": args.batch, "grad_accum": 1,
            "remat": args.remat, "seq_len": args.seq_len, "tokens_per_s": 1.0,
            "scan_layers": args.scan_layers == "true"}
  monkeypatch.setattr(bench, "bench_preset", fake_bench)
  assert bench.main(["--presets", "x-tiny", "--in_process", "--scan_layers", "false",
                     "--xla_flags=--xla_gpu_enable_dynamic_slice_fusion=true"]) == 0
  assert seen["flags"].split() == ["--xla_other=1", "--xla_gpu_enable_dynamic_slice_fusion=true"]


def test_batch_sweep_stops_at_the_first_out_of_memory_and_marks_the_fastest(monkeypatch, capsys,
                                                                             tmp_path):
  """Batches run smallest first; the first out-of-memory batch ends the preset's sweep (a larger
  one needs more memory still) and the fastest batch that ran is marked."""
  bench = load_tool("bench_train")
  tokens_per_s = {1: 100.0, 2: 180.0, 4: 170.0}

  def fake_bench(preset, args):
    if args.batch >= 8:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    return {"preset": preset, "status": "ok", "batch_per_device": args.batch, "grad_accum": 1,
            "remat": args.remat, "seq_len": args.seq_len, "tokens_per_s": tokens_per_s[args.batch]}
  monkeypatch.setattr(bench, "bench_preset", fake_bench)
  output = tmp_path / "sweep.json"
  assert bench.main(["--presets", "x-tiny", "--batch", "8", "2", "1", "4", "16",
                     "--in_process", "--json", str(output)]) == 0
  results = json.loads(output.read_text())
  assert "| x-tiny | ok | 4096 | 2 (fastest) x 1 |" in capsys.readouterr().out
  assert [(r["batch_per_device"], r["status"]) for r in results] == [
      (1, "ok"), (2, "ok"), (4, "ok"), (8, "oom")]
  assert [r.get("fastest") for r in results] == [False, True, False, None]
  one = [{"status": "ok", "tokens_per_s": 5.0}]
  bench.mark_fastest(one)
  assert "fastest" not in one[0]  # one batch: nothing to choose between


def test_ratios_to_gdn_swa_of_the_same_size_at_each_fastest_batch_and_at_common_batches():
  bench = load_tool("bench_train")
  row = lambda preset, batch, tokens: {"preset": preset, "status": "ok",
                                       "batch_per_device": batch, "tokens_per_s": tokens}
  results = [row("gdn_swa-0.4b", 8, 170.0), row("gdn_swa-0.4b", 12, 174.0),
             row("lalte-0.4b", 8, 153.0), row("lalte-0.4b", 12, 160.0),
             {"preset": "lalte-0.4b", "status": "oom", "batch_per_device": 16},
             row("lalte-1.4b", 4, 48.0),  # no gdn_swa-1.4b here: no ratio
             row("gdn-0.4b", 8, 150.0)]
  rows = {r["preset"]: r for r in bench.ratios_to_reference(results)}
  assert sorted(rows) == ["gdn-0.4b", "lalte-0.4b"]
  lalte = rows["lalte-0.4b"]
  assert (lalte["batch"], lalte["reference_batch"]) == (12, 12)
  assert lalte["at_fastest"] == pytest.approx(160 / 174)
  assert lalte["same_batch"] == {8: pytest.approx(0.9), 12: pytest.approx(160 / 174)}
  assert rows["gdn-0.4b"]["at_fastest"] == pytest.approx(150 / 174)
  table = bench.ratio_table(list(rows.values()))
  assert "| lalte-0.4b | gdn_swa-0.4b | 0.920 (12 / 12) | 0.900 at 8, 0.920 at 12 |" in table


@pytest.mark.parametrize("batch", [["0"], ["2", "2"]])
def test_bad_batches_are_refused(batch, capsys):
  with pytest.raises(SystemExit):
    load_tool("bench_train").parse_args(["--batch", *batch])
  assert "--batch must be distinct positive values" in capsys.readouterr().err


def test_calibrated_router_biases_keep_the_asked_share_of_tokens_per_layer_and_head():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from lalte_jax.config import get_model_config  # pylint: disable=import-outside-toplevel
  from lalte_jax.model import HybridLM  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.step import model_graphdef  # pylint: disable=import-outside-toplevel
  bench = load_tool("bench_train")
  config = get_model_config("lalte-tiny")
  params = nnx.to_pure_dict(nnx.state(HybridLM(config, rngs=nnx.Rngs(0)), nnx.Param))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (4, 256)),
                       jnp.int32)
  # Compiled once for the three parameter sets (run eagerly, each call took ~1.5 s). The share
  # is counted as the training step counts it, router dropout on (other draws than the
  # calibration's: 4 of them, averaged; a draw moves a head's share of these 1,024 tokens by
  # ~0.02). Calibrated without dropout, the share under dropout is ~0.2 for 0.125.
  kept_fn = jax.jit(lambda p, t, key: jnp.mean(nnx.merge(model_graphdef(config), p)(
      t, dropout_key=key, return_aux=True)[1].lte_scores > 0, axis=(1, 2)))
  kept = lambda p: np.mean([np.asarray(kept_fn(p, tokens, jax.random.key(seed)))
                            for seed in range(10, 14)], axis=0)
  assert kept(params).min() > 0.9  # as initialised (output bias +0.5) nearly every token is kept
  for fraction in (0.125, 0.5):
    calibrate = bench.lte_calibrator(config, tokens, fraction)
    np.testing.assert_allclose(kept(calibrate(params)), fraction, atol=0.04)
  with pytest.raises(ValueError, match="--lte_kept_fraction"):
    bench.lte_calibrator(config, tokens, 0.0)
