"""`python -m lalte_jax.eval` end to end on a tiny checkpoint: JSON and markdown reports, one new
pair per run; every bad input is one line and exit 2."""

import json
import pathlib
import re

import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.eval import cli, report
from lalte_jax.inference import checkpoint
from lalte_jax.model import HybridLM
from tests.cli_testing import check_bad_input


@pytest.mark.slow
def test_eval_cli_writes_json_and_markdown(tmp_path):
  model = HybridLM(get_model_config("lalte-tiny").replace(dtype="float32"), rngs=nnx.Rngs(0))
  checkpoint.save_params(model, tmp_path / "ckpt")
  payload = cli.run(["--checkpoint", str(tmp_path / "ckpt"), "--tasks",
                     "mqar,mqar_long_gap,sniah1", "--lengths", "600",
                     "--num-examples", "2", "--batch-size", "2", "--sniah-max-new-tokens", "4",
                     "--mqar-num-kv-pairs", "4", "--output-dir", str(tmp_path / "out"),
                     "--no-progress"])
  stored = json.loads((tmp_path / "out" / "results.json").read_text())
  assert stored["model"] == "lalte-tiny"
  records = {r["task"]: r for r in stored["results"]}
  assert list(records) == ["mqar", "mqar_long_gap", "sniah1"]
  assert all(r["length"] == 600 and 0.0 <= r["value"] <= 100.0 for r in records.values())
  assert records["mqar_long_gap"]["min_gap"] == 24  # the tiny laLTE window
  assert records["mqar"]["num_queries"] == 8
  assert records["sniah1"]["max_prompt_tokens"] + 128 <= 600
  markdown = (tmp_path / "out" / "results.md").read_text()
  assert "| mqar_long_gap | accuracy |" in markdown and "| task | metric | 600 |" in markdown
  assert payload["results"] == stored["results"]
  run_json, run_markdown = map(pathlib.Path, payload["paths"])  # this run's own files
  assert run_json.parent == tmp_path / "out" and run_json.name.startswith("results-")
  assert json.loads(run_json.read_text()) == stored and run_markdown.read_text() == markdown


# arguments after --checkpoint <tmp>/export --tasks mqar (an option given again wins) ->
# what the one-line error must say; {tmp} is the test's directory.
EVAL_BAD_INPUTS = {
    "missing checkpoint": (["--checkpoint", "{tmp}/missing"], "{tmp}/missing is not a directory"),
    "not a params export": (["--checkpoint", "{tmp}"], "lacks model.json or params/"),
    "unknown task": (["--tasks", "mqar,nope"], "tasks: unknown ['nope']"),
    "lengths not ints": (["--lengths", "1k"], "argument --lengths: expected comma-separated ints"),
    "zero length": (["--lengths", "0"], "lengths: must be positive, got [0]"),
    "zero examples": (["--num-examples", "0"], "num_examples: must be positive, got 0"),
    "bad dtype": (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
    "bad param dtype": (["--param-dtype", "float16"],
                        "argument --param-dtype: invalid choice: 'float16'"),
    "missing tokenizer": (["--tokenizer", "{tmp}/tok.json"], "tokenizer file {tmp}/tok.json does"),
    "sniah2 without haystack": (["--tasks", "sniah2"], "haystack_dir: sniah2/sniah3 need"),
    "missing haystack": (["--tasks", "sniah3", "--haystack-dir", "{tmp}/missing"],
                         "haystack_dir: {tmp}/missing is not a directory"),
    "haystack without essays": (["--tasks", "sniah2", "--haystack-dir", "{tmp}/export"],
                                "haystack_dir: {tmp}/export holds no .txt file"),
    "missing ppl corpus": (["--tasks", "ppl", "--data-dir", "{tmp}/missing"],
                           "{tmp}/missing is not a prepared corpus"),
    "missing EVAPORATE file": (["--tasks", "mqar,fda", "--evaporate-dir", "{tmp}"],
                               "evaporate: {tmp}/fda.jsonl does not exist"),
    "output_dir is a file": (["--output-dir", "{tmp}/export/model.json"],
                             "output_dir: {tmp}/export/model.json exists and is not a directory"),
}


@pytest.mark.parametrize("case", EVAL_BAD_INPUTS)
def test_eval_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
  """Each is found before a model runs (no checkpoint is loaded: the export is a stand-in)."""
  (tmp_path / "export" / "params").mkdir(parents=True)
  (tmp_path / "export" / "model.json").write_text("{}")
  arguments, message = EVAL_BAD_INPUTS[case]
  check_bad_input(cli.main, ["--checkpoint", "{tmp}/export", "--tasks", "mqar", "--no-progress",
                             *arguments], message, capsys, tmp=tmp_path)
  assert not list(tmp_path.rglob("results*"))


def test_each_run_writes_new_reports_and_a_copy_of_the_newest(tmp_path):
  first = report.write_report(tmp_path, {"run": 1}, "first")
  second = report.write_report(tmp_path, {"run": 2}, "second")
  assert first != second and all(p.is_file() for p in first + second)
  assert re.fullmatch(r"results-\d{8}-\d{6}(-\d+)?\.json", first[0].name), first[0].name
  assert json.loads(first[0].read_text()) == {"run": 1}  # never replaced
  assert first[1].read_text() == "first\n"
  assert json.loads((tmp_path / "results.json").read_text()) == {"run": 2}
  assert (tmp_path / "results.md").read_text() == "second\n"
