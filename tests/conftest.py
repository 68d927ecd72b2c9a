"""Test session setup shared by every test module."""

import jax
import pytest

# Tests check semantics in full float32: GPUs would otherwise run float32 matmuls in TF32, which
# moves results by ~1e-3 relative and flips LTE keep/drop decisions that sit near the threshold.
# Production code keeps JAX's default; the kernel tolerance tables cover bf16 separately.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  del config
  if jax.default_backend() == "gpu":
    return
  skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
