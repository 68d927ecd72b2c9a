"""tools/repro.py and its helpers: the plan, skipping finished runs, the report's checks, packing
the state for another machine, and one smoke run that resumes a partly trained run."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest
from tests.tools import load_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fake_record(model, lr, seed=0, pairs=96, steps=2000, select=50.0, test=None, lte=False):
  """A records.json of tools/repro_run.py with the numbers the report reads."""
  test = dict(test or {"capped_accuracy": select, "uncapped_accuracy": select})
  if lte:
    test.setdefault("availability_capped", 95.0)
    test.setdefault("availability_uncapped", 97.0)
    test.update(value_retention=[[0.9, 0.8]], filler_retention=[[0.05, 0.03]],
                kept_count_max=[[100, 90]], free_slots=124, cap=128)
  return {"name": f"{model}_p{pairs}_lr{lr:g}_s{seed}", "model": model, "lr": lr, "seed": seed,
          "pairs": pairs, "steps": steps, "device": "test",
          "select": {"capped_accuracy": select, "uncapped_accuracy": select}, "test": test,
          "train": {"train_s": 1.0}}


def write_records(out: pathlib.Path, records) -> None:
  for record in records:
    directory = out / "runs" / record["name"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "records.json").write_text(json.dumps(record))


def test_plan_sweeps_then_runs_seeds_and_controls_at_the_chosen_lr(tmp_path):
  repro = load_tool("repro")
  args = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_attn,lalte_router_off",
                           "--lrs", "1e-3,3e-3", "--seeds", "0,1", "--steps", "2000",
                           "--control-steps", "1000"])
  assert [s.name for s in repro.plan(args, [])] == [
      "gdn_attn_p96_lr0.001_s0", "gdn_attn_p96_lr0.003_s0", "lalte_router_off_p96_lr0.001_s0",
      "lalte_router_off_p96_lr0.003_s0"]
  # One lr finished: nothing is chosen yet; both: the better held-out capped accuracy wins.
  records = [fake_record("gdn_attn", 1e-3, select=70.0)]
  assert len(repro.plan(args, records)) == 4
  records.append(fake_record("gdn_attn", 3e-3, select=60.0))
  names = [s.name for s in repro.plan(args, records)]
  assert names[4:] == ["gdn_attn_p96_lr0.001_s1", "gdn_attn_p8_lr0.001_s0"]
  # The scheduler leaves out finished runs and the runs that failed in this invocation.
  write_records(tmp_path, records)
  scheduler = repro.Scheduler(args, tmp_path)
  scheduler.failed.add("lalte_router_off_p96_lr0.001_s0")
  assert [s.name for s in scheduler.pending()] == [
      "lalte_router_off_p96_lr0.003_s0", "gdn_attn_p96_lr0.001_s1", "gdn_attn_p8_lr0.001_s0"]
  with pytest.raises(SystemExit):
    repro.parse_args(["--models", "mamba"])


def test_runs_start_on_the_least_busy_of_the_devices(tmp_path, monkeypatch):
  repro = load_tool("repro")
  args = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_attn,gdn_swa,lalte",
                           "--lrs", "5e-4", "--seeds", "0,1", "--devices", "0,1"])
  started = []

  class FakeProcess:  # records where each run would start; never finishes
    def __init__(self, command, stdout, stderr, env):
      del stdout, stderr
      started.append((pathlib.Path(command[-1]).name, env["CUDA_VISIBLE_DEVICES"]))

    def poll(self):
      return None

  monkeypatch.setattr(repro.subprocess, "Popen", FakeProcess)
  scheduler = repro.Scheduler(args, tmp_path)
  specs = repro.plan(args, [])
  for spec in specs[:3]:
    scheduler.launch(spec)
  del scheduler.running[specs[0].name]  # the first run on device 0 ends: 0 is the least busy
  scheduler.launch(specs[3])
  assert [device for _, device in started] == ["0", "1", "0", "0"]
  assert [name for name, _ in started] == [spec.name for spec in specs[:4]]
  assert repro.parse_args(["--out", str(tmp_path)]).devices == ()  # default: no assignment
  with pytest.raises(SystemExit):
    repro.parse_args(["--devices", "gpu0"])


def test_at_the_budget_a_run_that_evaluates_is_left_to_finish(tmp_path, monkeypatch, capsys):
  repro = load_tool("repro")
  args = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_attn", "--lrs", "5e-4",
                           "--seeds", "0,1,2", "--control-steps", "0", "--grace-s", "3"])
  terminated = []

  class FakeProcess:  # a run that exits once told to stop, or once its records exist
    def __init__(self, command, stdout, stderr, env):
      del stdout, stderr, env
      self.directory, self.returncode = pathlib.Path(command[-1]), None

    def poll(self):
      if self.returncode is None and (self.directory / "records.json").is_file():
        self.returncode = 0
      return self.returncode

    def terminate(self):
      terminated.append(self.directory.name)
      self.returncode = 0

    def kill(self):
      self.returncode = -9

    def wait(self):
      return self.returncode

  monkeypatch.setattr(repro.subprocess, "Popen", FakeProcess)
  scheduler = repro.Scheduler(args, tmp_path)
  training, evaluating, slow = repro.plan(args, [])
  for spec in (training, evaluating, slow):
    scheduler.launch(spec)
  for spec in (evaluating, slow):  # both trained their last step
    (repro.run_dir(tmp_path, spec) / "summary.json").write_text("{}")
  monkeypatch.setattr(repro.time, "sleep", lambda _: (  # evaluating's records come a second later
      repro.run_dir(tmp_path, evaluating) / "records.json").write_text("{}"))
  scheduler.stop_all()
  assert terminated == [training.name]  # neither evaluating run was told to stop
  out = capsys.readouterr().out
  assert f"{evaluating.name}: exit 0 (finished)" in out
  assert f"{slow.name}: killed after the grace period" in out  # its evaluation outlasted the grace


def test_plan_with_one_lr_starts_every_seed_at_once(tmp_path):
  repro = load_tool("repro")
  args = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_attn,lalte_router_off",
                           "--lrs", "5e-4", "--seeds", "0,1", "--control-steps", "0"])
  assert [s.name for s in repro.plan(args, [])] == [
      "gdn_attn_p96_lr0.0005_s0", "lalte_router_off_p96_lr0.0005_s0", "gdn_attn_p96_lr0.0005_s1",
      "lalte_router_off_p96_lr0.0005_s1"]


def test_a_run_directory_of_another_step_count_is_an_error(tmp_path, capsys):
  repro = load_tool("repro")
  write_records(tmp_path, [fake_record("gdn_attn", 5e-4, steps=2000)])
  args = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_attn", "--lrs", "5e-4",
                           "--seeds", "0", "--steps", "2000", "--control-steps", "0"])
  assert repro.is_finished(tmp_path, repro.plan(args, [])[0])
  longer = ["--out", str(tmp_path), "--models", "gdn_attn", "--lrs", "5e-4", "--seeds", "0",
            "--steps", "4000", "--control-steps", "0", "--report-only"]
  with pytest.raises(SystemExit) as exit_info:
    repro.main(longer)
  message = str(exit_info.value)
  assert "gdn_attn_p96_lr0.0005_s0 holds the run" in message and "steps=2000" in message
  assert "give this study its own --out" in message


def test_report_checks_pass_fail_and_missing():
  report = load_tool("repro_report")
  records = [fake_record("gdn_attn", lr, seed=s, select=92.0 + s) for lr in (1e-3, 3e-3)
             for s in (0, 1, 2)]
  records += [fake_record("gdn_swa", 1e-3, select=30.0), fake_record("gdn_swa", 3e-3, select=35.0)]
  records += [fake_record("lalte", lr, lte=True, select=88.0,
                          test={"capped_accuracy": 88.0, "uncapped_accuracy": 99.0})
              for lr in (1e-3, 3e-3)]
  records += [fake_record("lalte_router_off", 1e-3, select=80.0,
                          test={"uncapped_accuracy": 80.0})]
  payload = report.summarize(records, models=("gdn_attn", "gdn_swa", "lalte"),
                             lrs=(1e-3, 3e-3), seeds=(0, 1, 2), steps=2000, control_steps=1000)
  assert payload["chosen_lr"] == {"gdn_attn": 1e-3, "gdn_swa": 3e-3, "lalte": 1e-3}
  attn = payload["rows"]["gdn_attn"]
  assert attn["seeds"] == [0, 1, 2] and attn["capped"]["mean"] == pytest.approx(93.0)
  status = {c["check"]: c["status"] for c in payload["checks"]}
  assert status["GDN+Attn >= 90% (long-gap P=96)"] == "pass"
  assert status["GDN+SWA <= 40% at laLTE's cache budget"] == "pass"
  assert status["lalte within 10 points of GDN+Attn (capped)"] == "pass"
  assert status["lalte capped within 3 points of uncapped"] == "fail"
  assert status["lalte availability >= 90%"] == "pass"
  assert status["lalte filler retention <= 10%"] == "pass"  # 4% (mean of 5% and 3%)
  assert status["lalte_warmup availability >= 90%"] == "missing"
  assert status["P=8 control >= 90% for every model of the main table"] == "missing"
  router_off = ("router off (every token kept) equals GDN+Attn within 3 points"
                " (mean over common seeds)")
  assert status[router_off] == "fail"  # seed 0 alone: 80 vs 92
  assert status["lalte: no high availability (>= 95%) with capped far (> 10) below uncapped"] \
      == "fail"
  markdown = report.markdown(payload, "test device")
  assert "| gdn_attn | 0.001 | 0,1,2 | 93.0 ± 0.8 |" in markdown
  # Over seeds 0-2 the router-off mean (93.3) is within 3 points of gdn_attn's (93.0), though
  # seed 0 alone differs by 4; seeds only one of them has are left out.
  off = [fake_record("lalte_router_off", 1e-3, seed=s, test={"uncapped_accuracy": a})
         for s, a in ((0, 88.0), (1, 97.0), (2, 95.0), (3, 10.0))]
  payload = report.summarize([r for r in records if r["model"] != "lalte_router_off"] + off,
                             models=("gdn_attn",), lrs=(1e-3, 3e-3), seeds=(0, 1, 2),
                             steps=2000, control_steps=1000)
  check = next(c for c in payload["checks"] if c["check"] == router_off)
  assert check["status"] == "pass" and "seeds [0, 1, 2]: 93.3 vs 93.0" in check["detail"]


def test_warmup_checks_read_the_first_seeds_probes():
  """Each warm-up model gets its own router checks, from its lowest seed: dCE/dscore at the
  switch (the first probe after step 1) and retention at the last probe."""
  report = load_tool("repro_report")
  def probes(switch_value, end_value, end_filler):
    return {"1": {"dscore_value": [[0.1, 0.1]], "retained_value": [[1.0, 1.0]],
                  "dscore_filler": [[0.0, 0.0]], "retained_filler": [[1.0, 1.0]]},
            "1000": {"dscore_value": switch_value, "dscore_filler": [[1e-6, 1e-6]],
                     "retained_value": [[1.0, 1.0]], "retained_filler": [[1.0, 1.0]]},
            "2000": {"dscore_value": [[0.0, 0.0]], "dscore_filler": [[0.0, 0.0]],
                     "retained_value": end_value, "retained_filler": end_filler}}
  good = dict(fake_record("lalte_warmup_bounded", 1e-3, seed=0, lte=True),
              probes=probes([[-2e-3, -1e-4]], [[0.9, 0.8]], [[0.1, 0.2]]))
  other_seed = dict(fake_record("lalte_warmup_bounded", 1e-3, seed=1, lte=True),
                    probes=probes([[2e-3, 2e-3]], [[0.0, 0.0]], [[0.5, 0.5]]))
  bad = dict(fake_record("lalte_warmup", 1e-3, seed=0, lte=True),
             probes=probes([[-2e-3, 1e-3]], [[0.9, 0.0]], [[0.1, 0.0]]))
  payload = report.summarize([other_seed, good, bad], models=("lalte_warmup",
                             "lalte_warmup_bounded"), lrs=(1e-3,), seeds=(0, 1), steps=2000,
                             control_steps=0)
  status = {c["check"]: c["status"] for c in payload["checks"]}
  switch = ": after the warm-up, dCE/dscore < 0 on queried values (every head)"
  retained = ": queried values retained more than fillers (every head)"
  assert status["lalte_warmup_bounded" + switch] == "pass"
  assert status["lalte_warmup_bounded" + retained] == "pass"
  assert status["lalte_warmup" + switch] == "fail"  # head 1 is positive at the switch
  assert status["lalte_warmup" + retained] == "fail"  # head 1 keeps neither
  missing = report.summarize([good], models=("lalte_warmup",), lrs=(1e-3,), seeds=(0,),
                             steps=2000, control_steps=0)
  assert {c["check"]: c["status"] for c in missing["checks"]}["lalte_warmup" + switch] \
      == "missing"


def test_trajectory_keeps_every_thousandth_step_the_switch_and_the_last(tmp_path):
  report = load_tool("repro_report")
  run = tmp_path / "lalte_warmup_p96_lr0.0005_s0"
  run.mkdir()
  (run / "run.json").write_text(json.dumps({"model": "lalte_warmup", "lr": 5e-4, "seed": 0,
                                            "pairs": 96, "steps": 48000, "smoke": False}))
  steps = range(50, 30001, 50)  # logged every 50 steps; the warm-up ends at step 24000
  (run / "metrics.jsonl").write_text("".join(
      json.dumps({"step": k, "ce_loss": 1 / k, "lte_retained": [[k, 0]], "lte_lambda": [[0, 0]]})
      + "\n" for k in steps) + json.dumps({"step": 30000, "eval_loss": 1.0}) + "\n")
  rows = report.trajectory(run)
  kept = [r["step"] for r in rows]
  switch = [k for k in steps if 23900 <= k <= 27000]
  assert kept == sorted({k for k in steps if k % 1000 == 0} | set(switch) | {30000})
  assert rows[0] == {"step": 1000, "ce_loss": 0.001, "lte_retained": [[1000, 0]],
                     "lte_lambda": [[0, 0]]}
  (run / "run.json").write_text(json.dumps({"model": "gdn_attn", "lr": 5e-4, "seed": 0,
                                            "pairs": 96, "steps": 48000, "smoke": False}))
  assert [r["step"] for r in report.trajectory(run)] == [k for k in steps if k % 1000 == 0]
  assert report.trajectory(tmp_path / "absent") == []


def _random_file(path: pathlib.Path, size: int) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(np.random.default_rng(len(str(path))).bytes(size))


def test_state_counts_what_files_take_compressed(tmp_path):
  """A long metrics log that compresses well leaves room for a checkpoint that does not."""
  state = load_tool("repro_state")
  study, mib = tmp_path / "study", 1 << 20
  run = study / "runs" / "unfinished"
  (run / "metrics.jsonl").parent.mkdir(parents=True)
  (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n' * (3 * mib // 26))
  _random_file(run / "checkpoints" / "7" / "state" / "data", mib)
  files, left_out = state.select_files(study, 2 * mib)  # 4 MiB on disk
  assert left_out == [] and run / "checkpoints" / "7" / "state" / "data" in files
  assert state.select_files(study, mib)[1] == ["unfinished"]


def test_state_packs_small_parts_and_unpacks_what_a_later_invocation_needs(tmp_path):
  state = load_tool("repro_state")
  study, mib = tmp_path / "study", 1 << 20
  (study / "results.md").parent.mkdir(parents=True)
  (study / "results.md").write_text("tables")
  finished, ahead, behind = (study / "runs" / name for name in ("done", "ahead", "behind"))
  for run, step in ((finished, 20), (ahead, 12), (behind, 4)):
    (run / "metrics.jsonl").parent.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(f'{{"step": {step}}}\n')
    _random_file(run / "checkpoints" / str(step) / "state" / "data", int(1.5 * mib))
    _random_file(run / "export" / "params", mib)
  (finished / "records.json").write_text("{}")
  (ahead / "checkpoints" / "8.orbax-checkpoint-tmp-1").mkdir()  # an unfinished save
  parts = state.pack(study, tmp_path / "out" / "state.tar.gz", part_mib=0.5, max_parts=4)
  assert all(p.stat().st_size <= mib // 2 for p in parts) and 3 <= len(parts) <= 4
  assert [p.name for p in parts] == [f"state.tar.gz.{i:02d}of{len(parts):02d}"
                                     for i in range(len(parts))]
  (tmp_path / "out" / "state.tar.gz.00of09").write_bytes(b"stale")  # an incomplete other set
  restored = tmp_path / "restored"
  assert state.main(["unpack", str(tmp_path / "out" / "state.tar.gz"), str(restored)]) == 0
  files = {str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file()}
  # The finished run needs no checkpoint; only the more advanced unfinished run's fits 2 MiB.
  assert files == {"results.md", "runs/done/metrics.jsonl", "runs/done/records.json",
                   "runs/ahead/metrics.jsonl", "runs/ahead/checkpoints/12/state/data",
                   "runs/behind/metrics.jsonl"}
  original = ahead / "checkpoints" / "12" / "state" / "data"
  assert (restored / "runs/ahead/checkpoints/12/state/data").read_bytes() == \
      original.read_bytes()
  assert state.main(["unpack", str(tmp_path / "nothing"), str(restored)]) == 2


WARMUP, ATTN, UNFINISHED = ("lalte_warmup_p96_lr0.0005_s0", "gdn_attn_p96_lr0.0005_s0",
                            "lalte_warmup_p96_lr0.0005_s1")


def published_study(tmp_path: pathlib.Path) -> pathlib.Path:
  """A 48000-step study reported by tools/repro.py (`tmp_path/study`): WARMUP finished with a
  metrics log of every 50th step (its loss leaves the plateau at step 4950), ATTN finished
  without one, UNFINISHED has a log but no records; its published results.json and
  trajectories.json are copied to `tmp_path/published` (as in docs/data/)."""
  repro, repro_run = load_tool("repro"), load_tool("repro_run")
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  study = tmp_path / "study"
  write_records(study, [fake_record("lalte_warmup", 5e-4, steps=48000, lte=True),
                        fake_record("gdn_attn", 5e-4, steps=48000)])
  for model, seed in (("lalte_warmup", 0), ("gdn_attn", 0), ("lalte_warmup", 1)):
    spec = capacity.RunSpec(model, 5e-4, seed)
    repro_run.write_spec(study / "runs" / spec.name, spec, smoke=False)
  for name in (WARMUP, UNFINISHED):
    (study / "runs" / name / "metrics.jsonl").write_text("".join(
        json.dumps({"step": k, "ce_loss": 9.0 if k < 4950 else 8000 / k,
                    "lte_retained": [[k, 0]], "lte_lambda": [[k / 1e5, 0]]}) + "\n"
        for k in range(50, 48001, 50)) + json.dumps({"step": 48000, "eval_loss": 1.0}) + "\n")
  args = repro.parse_args(["--out", str(study), "--models", "gdn_attn,lalte_warmup", "--lrs",
                           "5e-4", "--seeds", "0", "--control-steps", "0", "--report-only"])
  repro.report(args, study)
  published = tmp_path / "published"
  published.mkdir()
  for name in ("results.json", "trajectories.json"):
    (published / name).write_text((study / name).read_text())
  return published


def test_state_restores_the_published_runs_with_their_milestones_and_curves(tmp_path, capsys):
  state, report = load_tool("repro_state"), load_tool("repro_report")
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  published = published_study(tmp_path)
  results = json.loads((published / "results.json").read_text())
  curves = json.loads((published / "trajectories.json").read_text())["runs"]
  assert len(curves[WARMUP]) > 48 + 1  # the rows every 1000 steps and around the switch
  study = tmp_path / "restored"
  capsys.readouterr()
  assert state.main(["restore", str(published), str(study)]) == 0
  out = capsys.readouterr().out
  assert f"{ATTN}: no published trajectory, so no metrics.jsonl" in out
  assert f"not restored, unfinished (not in results.json): {UNFINISHED}" in out
  runs = study / "runs"
  assert sorted(p.name for p in runs.iterdir()) == [ATTN, WARMUP]
  assert not (runs / ATTN / "metrics.jsonl").exists()
  assert report.read_spec(runs / WARMUP) == (capacity.RunSpec("lalte_warmup", 5e-4, 0), False)
  assert report.load_records(study) == [dict(r, restored=True) for r in results["runs"]]
  # The published milestones are kept: from the restored rows alone the plateau is left later.
  assert report.load_records(study)[1]["milestones"]["left_plateau_step"] == 4950
  assert report.training_milestones(runs / WARMUP)["left_plateau_step"] == 5000
  for name in (ATTN, WARMUP):
    assert report.trajectory(runs / name) == curves[name]


def test_state_restore_skips_the_same_runs_and_never_overwrites_others(tmp_path, capsys):
  state = load_tool("repro_state")
  published = published_study(tmp_path)
  # The study that was published holds the same runs (records without milestones): skipped.
  original = {p: p.read_bytes() for p in (tmp_path / "study").rglob("*") if p.is_file()}
  capsys.readouterr()
  assert state.main(["restore", str(published), str(tmp_path / "study")]) == 0
  out = capsys.readouterr().out
  assert f"skipped {WARMUP}: {tmp_path / 'study' / 'runs' / WARMUP} holds these records" in out
  assert "restored 0 of the 2 finished runs" in out
  assert {p: p.read_bytes() for p in (tmp_path / "study").rglob("*") if p.is_file()} == original
  study = tmp_path / "restored"
  assert state.main(["restore", str(published), str(study)]) == 0
  assert state.main(["restore", str(published), str(study)]) == 0
  assert "restored 0 of the 2 finished runs" in capsys.readouterr().out
  # Another run of the same name (other results): an error naming it, checked before anything
  # is written.
  records = json.loads((study / "runs" / WARMUP / "records.json").read_text())
  (study / "runs" / WARMUP / "records.json").write_text(json.dumps(
      dict(records, test={"capped_accuracy": 1.0, "uncapped_accuracy": 1.0})))
  shutil.rmtree(study / "runs" / ATTN)
  assert state.main(["restore", str(published), str(study)]) == 2
  error = capsys.readouterr().err
  assert str(study / "runs" / WARMUP) in error and ATTN not in error
  assert not (study / "runs" / ATTN).exists()
  # An unfinished run of the same name: an error too.
  (study / "runs" / WARMUP / "records.json").write_text(json.dumps(records))
  (study / "runs" / ATTN).mkdir()
  (study / "runs" / ATTN / "run.json").write_text("{}")
  assert state.main(["restore", str(published), str(study)]) == 2
  assert str(study / "runs" / ATTN) in capsys.readouterr().err


def test_state_restore_without_published_data_is_an_error(tmp_path, capsys):
  state = load_tool("repro_state")
  data = tmp_path / "data"
  data.mkdir()
  assert state.main(["restore", str(data), str(tmp_path / "study")]) == 2
  assert f"{data / 'results.json'} does not exist" in capsys.readouterr().err
  (data / "results.json").write_text(json.dumps({"runs": []}))
  assert state.main(["restore", str(data), str(tmp_path / "study")]) == 2
  assert f"{data / 'trajectories.json'} does not exist" in capsys.readouterr().err
  assert not (tmp_path / "study").exists()


@pytest.mark.slow
def test_smoke_study_resumes_a_partly_trained_run_then_skips_it(tmp_path, capsys):
  repro, repro_run = load_tool("repro"), load_tool("repro_run")
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  from lalte_jax.train import checkpointing  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel
  spec = capacity.RunSpec("lalte_warmup", 1e-3, 0)
  run_dir = tmp_path / "runs" / spec.name
  # A run cut after 2 of its 4 smoke steps: its checkpoint is all a later invocation gets.
  partial = capacity.study_config(spec, output_dir=str(run_dir), smoke=True).replace(steps=2)
  checkpoints = checkpointing.RunCheckpoints.for_run(partial)
  Trainer(partial, checkpoints=checkpoints).run()
  checkpoints.close()
  repro_run.write_spec(run_dir, spec, smoke=True)
  args = ["--smoke", "--out", str(tmp_path), "--models", "lalte_warmup", "--lrs", "1e-3",
          "--seeds", "0", "--control-steps", "0"]
  payload = repro.main(args)
  assert "resumed from" in (run_dir / "log.txt").read_text()
  steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text(
      ).splitlines()]
  assert steps == [1, 2, 3, 4]
  (record,) = payload["runs"]
  assert record["name"] == spec.name and record["trained_steps"] == 4
  assert 0 <= record["test"]["capped_accuracy"] <= 100
  assert len(record["test"]["value_retention"]) == 1  # one LTE layer
  assert payload["chosen_lr"] == {"lalte_warmup": 1e-3} and payload["pending"] == []
  assert "## Checks" in (tmp_path / "results.md").read_text()
  capsys.readouterr()
  again = repro.main(args)  # finished: nothing starts
  assert "start " not in capsys.readouterr().out and again["runs"] == payload["runs"]
  assert repro.main(args + ["--report-only"])["checks"] == payload["checks"]
  pytest.importorskip("matplotlib")
  written = load_tool("plot_results").main(["--results", str(tmp_path)])
  assert sorted(p.name for p in written) == [
      "accuracy_by_model.png", "availability.png", "lte_controller.png", "retention_heatmap.png",
      "router_switch.png", "training_loss.png"]
  # The switch figure's rows: every logged step, counted from the end of the 2-step warm-up.
  plot_results = load_tool("plot_results")
  trajectories = json.loads((tmp_path / "trajectories.json").read_text())["runs"]
  switches = plot_results.router_switches(payload, trajectories)
  assert [seed for seed, _ in switches["lalte_warmup"]] == [0]
  assert [r["since_switch"] for r in switches["lalte_warmup"][0][1]] == [-1, 0, 1, 2]
  assert all(p.stat().st_size > 1000 for p in written)


def test_a_stopped_run_reports_its_pace_and_the_time_the_rest_needs():
  pace = load_tool("repro_run")._pace  # pylint: disable=protected-access
  stopped = {"stopped_at": 30_000, "started_at": 24_000, "elapsed_s": 300.0}
  assert pace(stopped, 48_000) == "6,000 steps at 20.0 steps/s, 18,000 left (~900 s at that pace)"
  assert pace(dict(stopped, stopped_at=24_000), 48_000).endswith("24,000 left (unknown at that pace)")


def test_a_fork_is_planned_with_its_parent_and_made_from_its_checkpoint(tmp_path):
  repro = load_tool("repro")
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  args = repro.parse_args(["--out", str(tmp_path), "--models", "lalte_warmup_learn_frozen_fork",
                           "--seeds", "0,3", "--control-steps", "0"])
  fork = capacity.RunSpec("lalte_warmup_learn_frozen_fork", capacity.LEARNING_RATES[0], 3)
  parent = capacity.fork_parent(fork)
  assert [s.name for s in repro.plan(args, [])] == [
      s.name for s in (capacity.fork_parent(dataclasses.replace(fork, seed=0)), parent,
                       dataclasses.replace(fork, seed=0), fork)]
  assert capacity.study_config(parent).checkpoint_keep_every == capacity.fork_step(fork) == 24000
  both = repro.parse_args(["--out", str(tmp_path), "--models", "lalte_warmup_learn_frozen_fork,"
                           "lalte_warmup_learn_sparse_fork", "--seeds", "3", "--control-steps",
                           "0"])
  sparse = dataclasses.replace(fork, model="lalte_warmup_learn_sparse_fork")
  assert capacity.fork_parent(sparse) == parent  # two forks of one parent: trained once
  assert [s.name for s in repro.plan(both, [])] == [
      capacity.fork_parent(dataclasses.replace(fork, seed=0)).name, parent.name, fork.name,
      sparse.name]  # the parent's seed 0 (its lr's sweep run) comes first, as above
  # Controls: the main table's models only; a fork's control forks its parent's control.
  controlled = repro.parse_args(["--out", str(tmp_path), "--models", "gdn_swa,lalte_warmup,"
                                 "lalte_warmup_learn_threshold_fork", "--seeds", "0",
                                 "--control-steps", "1000"])
  lr = capacity.LEARNING_RATES[0]
  assert [s.name for s in repro.plan(controlled, []) if s.pairs == 8] == [
      f"gdn_swa_p8_lr{lr:g}_s0", f"lalte_warmup_learn_p8_lr{lr:g}_s0",
      f"lalte_warmup_learn_threshold_fork_p8_lr{lr:g}_s0"]
  assert not repro.make_fork(tmp_path, fork, smoke=False)  # the parent is not there yet
  source = tmp_path / "runs" / parent.name
  (source / "checkpoints" / "24000" / "state").mkdir(parents=True)
  (source / "checkpoints" / "24000" / "state" / "data").write_text("arrays")
  (source / "metrics.jsonl").write_text("".join(
      json.dumps({"step": step, "loss": 1.0}) + "\n" for step in (23950, 24000, 24050))
      + '{"step": 241')  # a line the running parent is still writing
  (source / "probe_step24000.json").write_text("{}")
  assert repro.make_fork(tmp_path, fork, smoke=False)
  child = tmp_path / "runs" / fork.name
  assert (child / "checkpoints" / "24000" / "state" / "data").read_text() == "arrays"
  assert [json.loads(line)["step"] for line in (child / "metrics.jsonl").read_text(
      ).splitlines()] == [23950, 24000]  # the parent's curve up to the fork
  assert (child / "probe_step24000.json").is_file() and repro.has_checkpoint(child)
  other = dataclasses.replace(fork, seed=5)  # its parent finished before keeping the fork point
  (tmp_path / "runs" / capacity.fork_parent(other).name).mkdir()
  (tmp_path / "runs" / capacity.fork_parent(other).name / "records.json").write_text("{}")
  with pytest.raises(repro.ForkUnavailable, match="finished without its step-24000 checkpoint"):
    repro.make_fork(tmp_path, other, smoke=False)


@pytest.mark.slow
def test_smoke_fork_continues_its_parent_from_the_end_of_the_warmup(tmp_path):
  repro = load_tool("repro")
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  payload = repro.main(["--smoke", "--out", str(tmp_path), "--models",
                        "lalte_warmup_learn_frozen_fork", "--lrs", "1e-3", "--seeds", "0",
                        "--control-steps", "0", "--parallel", "2"])
  fork = capacity.RunSpec("lalte_warmup_learn_frozen_fork", 1e-3, 0)
  parent, child = (tmp_path / "runs" / spec.name for spec in (capacity.fork_parent(fork), fork))
  assert "resumed from" in (child / "log.txt").read_text()
  curves = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (parent, child)]
  assert [r["step"] for r in curves[1]] == [1, 2, 3, 4]
  assert curves[1][:2] == curves[0][:2]  # the parent's first 2 steps, then its own
  assert sorted(p.name for p in (parent / "checkpoints").iterdir() if p.name.isdigit()) == [
      "2", "4"]  # the fork point stays beside the newest
  records = {r["model"]: r for r in payload["runs"]}
  assert records["lalte_warmup_learn_frozen_fork"]["trained_steps"] == 4
  assert "2" in records["lalte_warmup_learn_frozen_fork"]["probes"]  # the parent's, at the fork
  assert payload["chosen_lr"]["lalte_warmup_learn_frozen_fork"] == 1e-3


def test_study_settings_give_every_windowed_model_the_same_budget():
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  models = {m: capacity.study_config(capacity.RunSpec(m, 1e-3, 0)).model_config()
            for m in capacity.ALL_MODELS}
  for model in models.values():
    assert (model.hidden_size, model.vocab_size, model.layer_pattern[0]) == (128, 8192, "gdn")
    assert model.num_layers == 2 and model.gdn.num_heads * model.gdn.head_dim ** 2 == 16 * 8 * 8
  lte, swa, nsa = models["lalte"].lte, models["gdn_swa"].attention, models["lansa"].nsa
  assert lte.window_keys + lte.cap == swa.window_size == 192
  assert nsa.window_size + nsa.block_count * nsa.block_size == 192
  assert models["gdn_attn"].attention.window_size is None
  # Every long-gap pair is beyond every window, and the filler prefix covers the sinks.
  assert capacity.LONG_GAP >= max(swa.window_size - 1, lte.window, nsa.window_size - 1)
  assert capacity.PREFIX_LEN >= lte.num_sinks
  config = capacity.study_config(capacity.RunSpec("lalte_warmup", 3e-3, 2))
  assert (config.lr, config.seed, config.steps) == (3e-3, 44, capacity.STEPS)
  assert config.lte_routing_freeze_steps == capacity.FULL.router_warmup_steps == capacity.STEPS // 2
  assert capacity.study_config(capacity.RunSpec("lalte", 1e-3, 0)).lte_routing_freeze_steps == 0
  control = capacity.RunSpec("lalte_warmup", 1e-3, 0, pairs=capacity.CONTROL_KV_PAIRS,
                             steps=capacity.CONTROL_STEPS)
  assert capacity.study_config(control).lte_routing_freeze_steps == capacity.CONTROL_STEPS // 2
  bounds = {m: capacity.study_config(capacity.RunSpec(m, 1e-3, 0)).lte_lambda_max
            for m in capacity.ALL_MODELS}
  assert bounds.pop("lalte_bounded") == bounds.pop("lalte_warmup_bounded") \
      == bounds.pop("lalte_warmup_learn") == bounds.pop("lalte_warmup_anneal") \
      == bounds.pop("lalte_warmup_learn_frozen") == bounds.pop("lalte_warmup_learn_frozen_fork") \
      == bounds.pop("lalte_warmup_learn_sparse_fork") \
      == bounds.pop("lalte_warmup_learn_threshold_fork") == capacity.BOUNDED_LAMBDA_MAX < 1.0
  assert set(bounds.values()) == {1.0}
  assert models["lalte_bounded"] == models["lalte_warmup_bounded"] == models["lalte"] \
      == models["lalte_warmup_learn"] == models["lalte_warmup_anneal"] \
      == models["lalte_warmup_learn_frozen"] == models["lalte_warmup_learn_frozen_fork"] \
      == models["lalte_warmup_learn_sparse_fork"] == models["lalte_warmup_learn_threshold_fork"]
  frozen = ("lalte_warmup_learn_frozen", "lalte_warmup_learn_frozen_fork",
            "lalte_warmup_learn_threshold_fork")
  sparse = ("lalte_warmup_learn_sparse_fork",)
  for model in ("lalte_warmup_bounded", "lalte_warmup_learn", "lalte_warmup_anneal") + frozen \
      + sparse:
    config = capacity.study_config(capacity.RunSpec(model, 5e-4, 0))
    assert config.lte_routing_freeze_steps == capacity.FULL.router_warmup_steps
    assert config.lte_routing_freeze_learns == (model != "lalte_warmup_bounded")
    assert config.lte_routing_freeze_anneal == (model == "lalte_warmup_anneal")
    assert config.lte_router_frozen_after_warmup == (model in frozen)
    assert config.lte_router_sparsity_only_after_warmup == (model in sparse)
    # Only a fork's parent keeps the end of its warm-up beside its newest checkpoint.
    assert config.checkpoint_keep_every == (config.lte_routing_freeze_steps
                                            if model == "lalte_warmup_learn" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("model",
                         ["gdn_swa", "lansa", "lalte_router_off", "lalte_warmup_anneal"])
def test_study_settings_train_and_checkpoint_a_few_steps(tmp_path, model):
  from lalte_jax.configs.repro import capacity  # pylint: disable=import-outside-toplevel
  from lalte_jax.train import checkpointing  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel
  config = capacity.study_config(capacity.RunSpec(model, 1e-3, 0, steps=2),
                                 output_dir=str(tmp_path), smoke=True)
  checkpoints = checkpointing.RunCheckpoints.for_run(config)
  summary = Trainer(config, checkpoints=checkpoints).run()
  checkpoints.close()
  assert np.isfinite(summary["final_loss"]) and checkpoints.latest_step() == 2


def test_training_milestones_from_hand_made_metrics(tmp_path):
  report = load_tool("repro_report")
  run = tmp_path / "lalte_p96_lr0.0005_s0"
  run.mkdir()
  (run / "run.json").write_text(json.dumps({"model": "lalte", "lr": 5e-4, "seed": 0, "pairs": 96,
                                            "steps": 4, "smoke": False}))
  plateau = np.log(4096)  # vocabulary 8192: the values are its upper half
  losses = [9.0, plateau, plateau - 0.2, plateau - 0.5, 6.0, 7.0]
  lambdas = [[[1e-9, 1e-9]], [[1e-3, 2e-9]], [[0.5, 0.0]], [[1e-2, 0.0]], [[0.0, 0.0]], None]
  (run / "metrics.jsonl").write_text("".join(
      json.dumps({"step": 10 * (i + 1), "ce_loss": float(loss),
                  **({"lte_lambda": lam} if lam else {})}) + "\n"
      for i, (loss, lam) in enumerate(zip(losses, lambdas))) + json.dumps({"step": 60}) + "\n")
  milestones = report.training_milestones(run)
  assert milestones["plateau"] == pytest.approx(plateau)
  assert milestones["left_plateau_step"] == 40  # the first loss more than 0.3 below the plateau
  assert (milestones["min_ce_loss"], milestones["final_ce_loss"]) == (6.0, 7.0)
  assert milestones["max_lambda"] == 0.5
  (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "ce_loss": float(plateau)}) + "\n")
  assert report.training_milestones(run)["left_plateau_step"] is None
  assert report.training_milestones(run)["max_lambda"] is None
  assert report.training_milestones(tmp_path / "missing") == {}
