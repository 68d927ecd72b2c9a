"""lalte_jax.cli_boundary: bad input -> one line and exit 2; anything else keeps its traceback;
and the mistakes every CLI shares (a bad flag, `python -m` itself) behave that way."""

import importlib
import pathlib
import sys

import pytest

from lalte_jax import cli_boundary
from tests.cli_testing import assert_bad_input
from tests.child_processes import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]


@cli_boundary.reports_bad_input
def _tool(argv):
  parser = cli_boundary.ArgumentParser(prog="tool")
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("run").add_argument("--n", type=int, required=True)
  args = parser.parse_args(argv)
  if args.n < 0:
    raise ValueError(f"--n: must be >= 0,\n  got {args.n}")
  if args.n == 1:
    raise FileNotFoundError(f"file{args.n}.txt does not exist")
  if args.n == 2:
    raise KeyError("a bug")
  return 0


@pytest.mark.parametrize("argv,message", [
    (["run", "--n", "-1"], "error: --n: must be >= 0, got -1"),  # one line however it was written
    (["run", "--n", "1"], "file1.txt does not exist"),
    (["run", "--n", "x"], "argument --n: invalid int value: 'x' (see tool run --help)"),
    (["run"], "the following arguments are required: --n"),
    (["walk"], "invalid choice: 'walk'"),
    ([], "the following arguments are required: command"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
  monkeypatch.delenv(cli_boundary.ENV_TRACEBACK, raising=False)
  assert_bad_input(_tool(argv), capsys.readouterr().err, message)


def test_bugs_keep_their_traceback_and_the_switch_shows_one_for_bad_input(capsys, monkeypatch):
  with pytest.raises(KeyError):
    _tool(["run", "--n", "2"])
  assert _tool(["run", "--n", "3"]) == 0
  monkeypatch.setenv(cli_boundary.ENV_TRACEBACK, "1")
  assert _tool(["run", "--n", "-1"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" in err and err.splitlines()[-1] == "error: --n: must be >= 0, got -1"


@pytest.mark.parametrize("module,argv,message", [
    ("lalte_jax.train", ["--config", "tiny_mqar", "--no-such-flag"], "unrecognized arguments"),
    ("lalte_jax.train.export", ["--run_dir", "x", "--out", "y", "--no-such-flag"],
     "unrecognized arguments"),
    ("lalte_jax.eval", ["--checkpoint", "x", "--tasks", "nope"], "tasks: unknown ['nope']"),
    ("lalte_jax.convert", ["bogus"], "invalid choice: 'bogus'"),
])
def test_python_m_exits_2_with_one_line(module, argv, message, children):
  """The modules' entry points pass main()'s status on."""
  env = child_env()
  env.pop(cli_boundary.ENV_TRACEBACK, None)
  done = children.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, timeout=300)
  assert_bad_input(done.returncode, done.stderr, message)


@pytest.mark.parametrize("module", ["lalte_jax.train.cli", "lalte_jax.train.export",
                                    "lalte_jax.eval.cli", "lalte_jax.convert.cli",
                                    "lalte_jax.inference.cli", "lalte_jax.data.prepare"])
def test_help_ends_with_exit_codes_and_one_example(module, capsys):
  main = importlib.import_module(module).main
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  assert "exit codes: 0 " in text and "2 bad input" in text
  assert text.count("example: python -m lalte_jax.") == 1
