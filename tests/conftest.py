"""Test session setup shared by every test module."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == "gpu":
    return
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
