"""Tests of the scripts in tools/ (run from a checkout, not installed)."""

import importlib.util
import pathlib
import sys

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
  """tools/<name>.py as a fresh module, registered under its name (the tools import each other
  by name, so tools/ goes on sys.path; dataclasses look their module up in sys.modules)."""
  if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
  spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
