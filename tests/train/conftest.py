"""Trainer tests: keep XLA:CPU off its XNNPACK path before the backend starts.

jaxlib 0.10.2's XLA:CPU can deadlock (all threads idle, block_until_ready never returns) running
the tiny laLTE train step with XNNPACK fusions on a 2-core machine. The flag must be set before
JAX creates its CPU backend; the root conftest is the better home (it then covers every test),
this keeps `pytest tests/train` safe on its own. It only affects the CPU backend.
"""

import os

if "xla_cpu_use_xnnpack" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=false"
                             ).strip()
