"""Test session setup shared by every test module."""

import os

# jaxlib 0.10.2's XLA:CPU can deadlock (all threads idle, block_until_ready never returns) when
# XNNPACK fusions run on a small thread pool, as on 2-core CI machines; seen with the tiny laLTE
# train step. The flag must be set before JAX creates its CPU backend and only affects that backend.
if "xla_cpu_use_xnnpack" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=false"
                             ).strip()

import jax  # pylint: disable=wrong-import-position
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
