"""The training CLI end to end: custom model overrides, resume guards, and the README's demo run;
every bad input of the train and export CLIs is one line and exit 2; --help and --list-fields."""

import dataclasses
import os
import pathlib
import re
import sys

import jax.numpy as jnp
import pytest

from lalte_jax import xla_flags
from lalte_jax.inference import checkpoint as params_checkpoint
from lalte_jax.train import checkpointing, export
from lalte_jax.train.cli import main
from lalte_jax.train.config import TrainConfig, apply_overrides, load_config, shipped_configs
from tests.cli_testing import check_bad_input
from tests.child_processes import TEST_COMPILE_FLAGS, child_env

REPO = pathlib.Path(__file__).resolve().parents[3]
CONFIGS = REPO / "lalte_jax" / "configs"
# lalte_jax/configs/readme_demo.py must reach this held-out MQAR recall (chance: 1 in 128 values, < 1%);
# README.md states the same number.
DEMO_MIN_RECALL = 0.8


def test_model_overrides_from_the_command_line_and_config_files():
  config = apply_overrides(TrainConfig(), [
      "model.hidden_size=128", "model.gdn.head_dim=64", "model.intermediate_size=384",
      "model.lte.window=32", "model.lte.router_dilations=(1, 1, 1)"])
  model = config.model_config()
  assert (model.hidden_size, model.gdn.head_dim, model.lte.window) == (128, 64, 32)
  assert model.lte.router_dilations == (1, 1, 1) and model.name == "lalte-tiny"
  assert config == TrainConfig(model_overrides={
      "lte.window": 32, "lte.router_dilations": [1, 1, 1], "hidden_size": 128,
      "gdn.head_dim": 64, "intermediate_size": 384})
  hash(config)  # stays hashable
  # A later --set of the same field wins; the file's overrides are kept.
  assert apply_overrides(config, ["model.lte.window=40"]).model_config().lte.window == 40


@pytest.mark.parametrize("assignment,match", [
    ("model.hidden_sise=3", "'hidden_sise' is not a ModelConfig field"),
    ("model.lte.windo=3", "'lte.windo' is not a ModelConfig field"),
    ("model.lte.window=big", "lte.window='big' is not a <class 'int'>"),
    ("model.dtype=float32", "set by TrainConfig.model_dtype"),
    ("model.gdn.head_dim=64", "must equal hidden_size=64"),  # checked by ModelConfig
    ("model.nsa.block_size=8", "lalte-tiny has no 'nsa' config"),
    ("model_overrides=x", "unknown config key 'model_overrides'"),
])
def test_bad_model_overrides_raise_naming_the_field(assignment, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    apply_overrides(TrainConfig(), [assignment])


def test_checkpoint_fields_are_validated():
  for assignment, match in (("checkpoint_every=-1", "checkpoint_every"),
                            ("checkpoint_keep=0", "checkpoint_keep"),
                            ("export_dtype=int8", "export_dtype")):
    with pytest.raises(ValueError, match=match):
      apply_overrides(TrainConfig(), [assignment])


def _checkpoints_of_step_3(run_dir: pathlib.Path) -> pathlib.Path:
  """A run directory whose checkpoints/ holds one (tiny, not a train state) checkpoint, step 3."""
  checkpoints = checkpointing.RunCheckpoints(run_dir / "checkpoints", keep=1)
  checkpoints.save(3, {"step": jnp.zeros((), jnp.int32)}, wait=True)
  checkpoints.close()
  return run_dir


# (arguments after --config tiny_mqar --set output_dir=<tmp>/run, or a whole argv when it starts
# with --; {tmp} is the test's directory) -> what the one-line error must say.
TRAIN_BAD_INPUTS = {
    "missing config": (["--config", "nonexistent"], "'nonexistent' is neither a file nor a"),
    "config syntax error": (["--config", "{tmp}/syntax.py"], "syntax.py': invalid syntax (line 1)"),
    "config without get_config": (["--config", "{tmp}/empty.py"], "has no get_config() function"),
    "bad config argument": (["--config", "repro/capacity:nope"], "'nope' is not one of"),
    "no --config": (["--set", "steps=2"], "the following arguments are required: --config"),
    "unknown flag": (["--config", "tiny_mqar", "--stpes", "3"], "unrecognized arguments: --stpes"),
    "unknown key": (["--set", "stpes=3"], "unknown config key 'stpes'"),
    "value of the wrong type": (["--set", "steps=many"], "--set steps=many: expected int"),
    "no value": (["--set", "steps"], "--set 'steps': expected key=value"),
    "invalid value": (["--set", "warmup_steps=500"], "TrainConfig.warmup_steps: 500 must be below"),
    "unknown model field": (["--set", "model.hidden_sise=3"], "'hidden_sise' is not a ModelConfig"),
    "pretokenized without data_dir": (["--set", "data=pretokenized"], "TrainConfig.data_dir"),
    "missing data_dir": (["--set", "data=pretokenized", "--set", "data_dir={tmp}/missing"],
                         "{tmp}/missing is not a prepared corpus"),
    "output_dir is a file": (["--set", "output_dir={tmp}/syntax.py"],
                             "{tmp}/syntax.py exists and is not a directory"),
    "mesh larger than the devices": (["--set", "mesh_fsdp=3"], "does not divide the 1 devices"),
    "process id missing": (["--coordinator_address", "localhost:1", "--num_processes", "2"],
                           "process id None must be given"),
    "checkpoints but resume=false": (["--set", "output_dir={tmp}/done", "--set", "resume=false"],
                                     "holds checkpoints (steps [3]) but resume=False"),
    "checkpoints but save_checkpoints=false": (
        ["--set", "output_dir={tmp}/done", "--set", "save_checkpoints=false"],
        "TrainConfig.save_checkpoints: False, but {tmp}/done holds a run's checkpoints"),
    "negative eval_batches": (["--set", "eval_batches=-1"], "TrainConfig.eval_batches"),
}


@pytest.mark.parametrize("case", TRAIN_BAD_INPUTS)
def test_train_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
  (tmp_path / "syntax.py").write_text("def get_config(:\n")
  (tmp_path / "empty.py").write_text("x = 1\n")
  _checkpoints_of_step_3(tmp_path / "done")
  arguments, message = TRAIN_BAD_INPUTS[case]
  if "--config" not in arguments and case != "no --config":
    arguments = ["--config", "tiny_mqar", "--set", "output_dir={tmp}/run", *arguments]
  check_bad_input(main, arguments + ["--set", "progress_bar=false"], message, capsys,
                  tmp=tmp_path)


EXPORT_BAD_INPUTS = {
    "missing run_dir": (["--run_dir", "{tmp}/missing", "--out", "{tmp}/out"],
                        "run_dir {tmp}/missing has no checkpoints/ directory"),
    "run_dir is a checkpoint": (["--run_dir", "{tmp}/run/checkpoints/3", "--out", "{tmp}/out"],
                                "has no checkpoints/ directory (expected the output_dir"),
    "no complete checkpoint": (["--run_dir", "{tmp}/empty_run", "--out", "{tmp}/out"],
                               "holds no complete checkpoint"),
    "missing step": (["--run_dir", "{tmp}/run", "--step", "7", "--out", "{tmp}/out"],
                     "--step 7: {tmp}/run/checkpoints holds no complete checkpoint of that step"
                     " (steps [3])"),
    "out exists": (["--run_dir", "{tmp}/run", "--out", "{tmp}/run"],
                   "--out {tmp}/run already exists"),
    "out is not an export": (["--run_dir", "{tmp}/run", "--out", "{tmp}/run", "--overwrite"],
                             "--out {tmp}/run exists and is not a params export"),
    "bad dtype": (["--run_dir", "{tmp}/run", "--out", "{tmp}/out", "--dtype", "int8"],
                  "argument --dtype: invalid choice: 'int8'"),
    "no --out": (["--run_dir", "{tmp}/run"], "the following arguments are required: --out"),
}


@pytest.mark.parametrize("case", EXPORT_BAD_INPUTS)
def test_export_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
  _checkpoints_of_step_3(tmp_path / "run")
  (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
  check_bad_input(export.main, *EXPORT_BAD_INPUTS[case], capsys, tmp=tmp_path)
  assert not (tmp_path / "out").exists()


def test_help_names_the_configs_fields_exit_codes_and_an_example(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  text = " ".join(capsys.readouterr().out.split())
  for name in shipped_configs():
    assert name in text
  assert "--list-fields prints them all" in text and "--set model.NAME=VALUE" in text
  for code in ("0 done", "2 bad input", "3 too many non-finite steps", "4 no step finished",
               "5 the step does not fit"):
    assert code in text


def test_list_fields_prints_every_field_with_type_default_and_comment(capsys):
  assert main(["--list-fields"]) == 0
  lines = capsys.readouterr().out.splitlines()
  for field in dataclasses.fields(TrainConfig):
    assert any(line.startswith(f"  {field.name}: ") for line in lines), field.name
  assert "  steps: int = 200" in lines
  assert "  output_dir: str = ''  # \"\" = runs/<variant>-<size>" in lines
  assert "# Optimisation (§8.1)." in lines  # the comment heading a group of fields
  assert "  lte.window: int" in lines and "  gdn.head_dim: int  # d_k" in lines
  assert not any(line.startswith("  dtype:") for line in lines)  # set through model_dtype


def _saved_run(tmp_path, steps=(1, 2)) -> pathlib.Path:
  """Checkpoints of a tiny_mqar run in tmp_path (a stand-in state: the checks below fail before
  the state is read); returns the checkpoint directory."""
  config = load_config(CONFIGS / "tiny_mqar.py", [f"output_dir={tmp_path}"])
  checkpoints = checkpointing.RunCheckpoints.for_run(config)
  for step in steps:
    checkpoints.save(step, {"step": jnp.asarray(step, jnp.int32)}, wait=True)
  checkpoints.close()
  return checkpoints.directory


def _train(tmp_path, *settings: str) -> int:
  arguments = ["--config", str(CONFIGS / "tiny_mqar.py")]
  for setting in (f"output_dir={tmp_path}", "progress_bar=false", *settings):
    arguments += ["--set", setting]
  return main(arguments)


def test_no_intact_checkpoint_exits_2_in_one_line_after_a_warning_each(tmp_path, capsys):
  directory = _saved_run(tmp_path)
  for step in (1, 2):
    (directory / str(step) / "state" / "_METADATA").unlink()
  assert _train(tmp_path) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  lines = err.splitlines()
  assert len(lines) == 3, err
  for line, step in zip(lines, (2, 1)):
    assert line.startswith(f"warning: checkpoint {step} in {directory} is damaged (state/_METADATA"
                           " is missing)"), line
  assert lines[2] == (f"error: checkpoints: no intact checkpoint in {directory} (damaged: steps"
                      " [1, 2]; nothing was moved); to start afresh move that directory away, or"
                      " choose another output_dir")
  assert checkpointing.RunCheckpoints(directory, keep=1, read_only=True).all_steps() == [1, 2]


def test_another_model_exits_2_naming_the_field(tmp_path, capsys):
  directory = _saved_run(tmp_path, steps=(1,))
  assert _train(tmp_path, "model.intermediate_size=256", "model_dtype=float32") == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(
      f"error: TrainConfig: the checkpoints in {directory} were saved with another model"
      " (model.intermediate_size: 192 -> 256); resuming needs the same model: undo the change,"
      " or train the changed model in a new output_dir"), err


def test_readme_demo_config_is_small():
  config = load_config(CONFIGS / "readme_demo.py")
  assert config.data == "mqar" and config.steps * config.tokens_per_step <= 600 * 64 * 64


@pytest.mark.slow
def test_readme_demo_reaches_high_recall_and_exports(tmp_path, children):
  """The README's main command (output redirected): trains, prints held-out recall, saves."""
  env = child_env()  # the command as users run it: without the tests' compile flags
  env["XLA_FLAGS"] = xla_flags.without_flags(env["XLA_FLAGS"], *TEST_COMPILE_FLAGS)
  result = children.run(
      [sys.executable, "-m", "lalte_jax.train", "--config", str(CONFIGS / "readme_demo.py"),
       "--set", f"output_dir={tmp_path}", "--set", "progress_bar=false"],
      cwd=REPO, env=env, timeout=1200)
  assert result.returncode == 0, result.stdout + result.stderr
  recall = float(re.search(r"held-out recall accuracy ([0-9.]+)", result.stdout).group(1))
  assert recall >= DEMO_MIN_RECALL, result.stdout
  assert f"exported parameters: {tmp_path / 'export'}" in result.stdout
  model = params_checkpoint.load_model(tmp_path / "export")
  assert model.config == load_config(CONFIGS / "readme_demo.py").model_config()


def test_reproducible_sets_the_xla_flags_before_jax_starts(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
  # The mesh error comes after the flags are set and stops the run before anything compiles.
  check_bad_input(main, ["--config", "tiny_mqar", "--set", f"output_dir={tmp_path}/run",
                         "--set", "reproducible=true", "--set", "mesh_fsdp=3"],
                  "does not divide the 1 devices", capsys, tmp=tmp_path)
  assert xla_flags.missing(*xla_flags.REPRODUCIBLE_GPU) == []
  assert "--xla_gpu_deterministic_ops=false" not in os.environ["XLA_FLAGS"].split()


def test_a_reproducible_trainer_on_a_gpu_refuses_to_start_without_the_flags(monkeypatch):
  from lalte_jax.train import trainer  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(trainer.jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="TrainConfig.reproducible: XLA_FLAGS lacks"
                     " --xla_gpu_deterministic_ops=true"):
    trainer.Trainer(TrainConfig(reproducible=True))


@pytest.mark.slow  # init of a tiny model
def test_a_step_out_of_memory_exits_5_with_one_line_of_advice(tmp_path, monkeypatch, capsys):
  from lalte_jax.train import trainer  # pylint: disable=import-outside-toplevel

  def out_of_memory(self, local_batch):
    raise trainer.StepOutOfMemory("train step: out of memory on the device at 8 sequences")

  monkeypatch.setattr(trainer.Trainer, "train_step", out_of_memory)
  assert main(["--config", "tiny_mqar", "--set", f"output_dir={tmp_path}/run",
               "--set", "progress_bar=false", "--set", "save_checkpoints=false"]) == 5
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      "error: train step: out of memory on the device at 8 sequences")
