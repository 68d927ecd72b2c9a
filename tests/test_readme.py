"""The README's quickstart commands are what CI runs and what the package provides."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
  return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_exactly_two_quickstart_commands():
  commands = readme_commands()
  assert len(commands) == 2, commands
  setup = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev]' && "
  assert all(c.startswith(setup) for c in commands)
  assert commands[0].endswith("lalte-train --config readme_demo")
  assert (ROOT / "lalte_jax" / "configs" / "readme_demo.py").is_file()
  assert "-m pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
  assert readme_commands()[1] in (ROOT / ".ci" / "run").read_text()
