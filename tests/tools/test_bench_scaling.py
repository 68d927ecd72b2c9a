"""tools/bench_scaling.py: 1 and 2 "GPUs" emulated by CPU devices (2 processes of one device
against one process of two), the resume of a 2-process checkpoint on 1 process, and the planning
and comparisons that the GPU run relies on."""

import json
import pathlib
import sys

import pytest
from tests.tools import load_tool
from tests.child_processes import DISTRIBUTED_ENV, child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "bench_scaling.py"


@pytest.mark.slow
def test_two_processes_match_one_and_a_checkpoint_resumes_on_fewer(tmp_path, children):
  output = tmp_path / "scaling.json"
  # gdn-tiny compiles fastest; float32 makes 1e-6 meaningful; --peak-tflops gives CPU an MFU.
  done = children.run(
      [sys.executable, str(SCRIPT), "--platform", "cpu", "--presets", "gdn-tiny",
       "--gpus", "1,2", "--seq-len", "32", "--batch-per-gpu", "2", "--steps", "3",
       "--warmup", "1", "--dtype", "float32", "--peak-tflops", "1", "--out", str(tmp_path / "runs"),
       "--json", str(output), "--reshard", "gdn-tiny", "--reshard-steps", "2,1",
       "--reshard-from", "2", "--reshard-to", "1"],
      cwd=REPO, env=child_env(**DISTRIBUTED_ENV), timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  report = json.loads(output.read_text())
  cases = {(c["mode"], c["gpus"]): c for c in report["cases"]}
  assert sorted(cases) == [("multi", 2), ("single", 1), ("single", 2)]
  for (mode, gpus), case in cases.items():
    assert case["status"] == "ok", case
    assert case["steps_logged"] == [1, 2, 3] and len(case["step_times_s"]) == 2
    assert case["global_batch"] == 2 * gpus
    assert case["tokens_per_s"] == pytest.approx(2 * gpus * 32 / case["step_time_s"])
    assert case["tokens_per_s_per_gpu"] == pytest.approx(case["tokens_per_s"] / gpus)
    assert 0 < case["mfu"] < 1 and case["scaling_efficiency"] > 0
    assert case["peak_memory_gib"] is None  # CPU keeps no memory statistics
    assert ("--process_id" in case["command"]) == (mode == "multi")
  assert cases[("single", 1)]["scaling_efficiency"] == 1.0
  multi, single = cases[("multi", 2)], cases[("single", 2)]
  assert multi["losses_match_single"] and multi["loss_max_abs_diff_vs_single"] <= 1e-6
  assert max(abs(a - b) for a, b in zip(multi["losses"], single["losses"])) <= 1e-6
  assert len(set(single["losses"])) == 3  # the model trains: the comparison can fail
  reshard = report["reshard"]
  assert reshard["status"] == "ok" and reshard["loss_max_abs_diff"] <= 1e-5, reshard
  assert [run["name"] for run in reshard["runs"]] == ["2_processes", "resumed_on_1"]
  assert sorted(reshard["runs"][1]["losses"]) == ["3"]  # resumed after step 2
  assert "| gdn-tiny | multi | 2 | ok |" in done.stdout
  # save_checkpoints=false: the cases write nothing but their metrics and logs.
  assert sorted(path.name for path in (tmp_path / "runs" / "gdn-tiny_multi_2").iterdir()) == [
      "metrics.jsonl", "process0.log", "process1.log", "summary.json"]


@pytest.mark.slow
def test_a_checkpoint_resumes_on_the_same_devices_in_fewer_processes(tmp_path, children):
  output = tmp_path / "reshard.json"
  done = children.run(
      [sys.executable, str(SCRIPT), "--platform", "cpu", "--presets", "", "--seq-len", "32",
       "--batch-per-gpu", "1", "--out", str(tmp_path / "runs"), "--json", str(output),
       "--reshard", "gdn-tiny", "--reshard-steps", "2,2", "--reshard-from", "2",
       "--reshard-to", "1", "--reshard-same-gpus", "--mesh", "fsdp", "--deterministic"],
      cwd=REPO, env=child_env(**DISTRIBUTED_ENV), timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  reshard = json.loads(output.read_text())["reshard"]
  assert reshard["status"] == "ok" and reshard["loss_max_abs_diff"] <= 1e-5, reshard
  reference, resumed = reshard["runs"]
  assert (reference["processes"], reference["gpus"]) == (2, 2)
  assert "reproducible=true" in reference["command"]  # the GPU flags are accepted on a CPU too
  assert (resumed["processes"], resumed["gpus"]) == (1, 2)  # both devices, one process
  assert sorted(resumed["losses"]) == ["3", "4"]
  assert "2 devices on 1 process(es)" in (tmp_path / "runs" / "reshard_gdn-tiny" /
                                           "resumed_on_1" / "process0.log").read_text()


def test_mesh_and_determinism_reach_the_children(tmp_path):
  runs = load_tool("trainer_runs")
  assert runs.mesh_settings("data", 4) == ["mesh_data=4", "mesh_fsdp=1"]
  assert runs.mesh_settings("fsdp", 4) == ["mesh_data=1", "mesh_fsdp=4"]
  env = runs.child_env("gpu", ["0", "1"], 60, extra_xla_flags=("--xla_gpu_autotune_level=0",))
  assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
  assert "--xla_gpu_autotune_level=0" in env["XLA_FLAGS"].split()
  assert "--xla_gpu_autotune_level" not in runs.child_env("gpu", ["0"], 60).get(
      "XLA_FLAGS", "")
  bench = load_tool("bench_scaling")
  args = bench.parse_args(["--presets", "a-tiny", "--deterministic",
                           "--xla-flag=--xla_gpu_autotune_level=0"])
  assert args.xla_flags == ("--xla_gpu_autotune_level=0",)
  settings = bench.trainer_settings(args, "a-tiny", gpus=1, global_batch=4, seq_len=64, steps=2,
                                    run_dir=tmp_path)
  assert "reproducible=true" in settings  # the trainer's CLI sets REPRODUCIBLE_GPU itself
  plain = bench.parse_args(["--presets", "a-tiny"])
  assert "reproducible=true" not in bench.trainer_settings(
      plain, "a-tiny", gpus=1, global_batch=4, seq_len=64, steps=2, run_dir=tmp_path)
  with pytest.raises(SystemExit):
    bench.parse_args(["--presets", "a-tiny", "--xla-flag", "autotune=0"])
  cpu = runs.child_env("cpu", ["0", "1", "2"], 60)
  assert cpu["JAX_PLATFORMS"] == "cpu"
  assert "--xla_force_host_platform_device_count=3" in cpu["XLA_FLAGS"].split()


def test_plan_skips_missing_gpus_and_always_has_the_baseline():
  bench = load_tool("bench_scaling")
  args = bench.parse_args(["--presets", "a-tiny,b-tiny", "--gpus", "1,2,4", "--modes", "multi"])
  assert bench.case_plan(args, visible=2) == [
      ("a-tiny", "single", 1), ("b-tiny", "single", 1), ("a-tiny", "multi", 2),
      ("b-tiny", "multi", 2)]
  args = bench.parse_args(["--presets", "a-tiny", "--gpus", "4,1,2,8"])
  assert [gpus for _, _, gpus in bench.case_plan(args, visible=4)] == [1, 4, 4, 2, 2]


def test_reshard_alone_runs_no_cases():
  bench = load_tool("bench_scaling")
  assert bench.case_plan(bench.parse_args(["--presets", "", "--reshard", "a-tiny"]), 4) == []
  with pytest.raises(SystemExit):
    bench.parse_args(["--presets", ""])


def test_reshard_counts_must_split_the_global_batch_and_may_exceed_the_writers():
  bench = load_tool("bench_scaling")
  reshard = ["--presets", "", "--reshard", "a-tiny", "--reshard-from", "4"]
  assert bench.parse_args(reshard + ["--batch-per-gpu", "2", "--reshard-to", "8,2"]).reshard_to \
      == [8, 2]  # 8 rows over 8 processes: a larger mesh than the checkpoint's
  with pytest.raises(SystemExit):  # 4 rows cannot split over 8 processes
    bench.parse_args(reshard + ["--batch-per-gpu", "1", "--reshard-to", "8"])
  with pytest.raises(SystemExit):  # the same 4 GPUs cannot split over 8 processes
    bench.parse_args(reshard + ["--batch-per-gpu", "2", "--reshard-to", "8",
                                "--reshard-same-gpus"])


def test_budget_skips_a_case_that_cannot_finish():
  bench = load_tool("bench_scaling")
  budget = bench.Budget(total_s=100.0, case_timeout_s=600.0)
  assert budget.timeout_s("a-tiny") == pytest.approx(100.0, abs=1.0)  # nothing known: it may run
  budget.record("a-tiny", 250.0)
  assert budget.timeout_s("a-tiny") is None and budget.timeout_s("b-tiny") is None
  unlimited = bench.Budget(total_s=0.0, case_timeout_s=600.0)
  unlimited.record("a-tiny", 250.0)
  assert unlimited.timeout_s("a-tiny") == 600.0


def test_comparisons_flag_differing_losses():
  bench = load_tool("bench_scaling")
  cases = [{"preset": "p", "mode": "single", "gpus": 1, "tokens_per_s": 100.0, "losses": [2.0]},
           {"preset": "p", "mode": "single", "gpus": 2, "tokens_per_s": 180.0,
            "losses": [1.0, 0.5]},
           {"preset": "p", "mode": "multi", "gpus": 2, "tokens_per_s": 150.0,
            "losses": [1.0, 0.5 + 1e-3]}]
  bench.add_comparisons(cases, tolerance=1e-6)
  assert cases[1]["scaling_efficiency"] == pytest.approx(0.9)
  assert cases[2]["scaling_efficiency"] == pytest.approx(0.75)
  assert cases[2]["loss_max_abs_diff_vs_single"] == pytest.approx(1e-3)
  assert cases[2]["losses_match_single"] is False
  del cases[0]  # 1 GPU out of memory: 2 GPUs are the base
  bench.add_comparisons(cases, tolerance=1e-6)
  assert cases[0]["efficiency_base_gpus"] == 2 and cases[0]["scaling_efficiency"] == 1.0
