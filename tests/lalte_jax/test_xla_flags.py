"""lalte_jax.xla_flags: flags are added once, a user's setting wins unless replaced."""

import os
import subprocess
import sys

from lalte_jax import xla_flags


def _python(code: str, xla_flags_value: str | None, cwd) -> subprocess.CompletedProcess:
  """`python -c code` in a fresh process whose XLA_FLAGS is this value (None: unset)."""
  environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  if xla_flags_value is not None:
    environ["XLA_FLAGS"] = xla_flags_value
  return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                        text=True, timeout=120, cwd=cwd, check=False)


def test_flags_are_added_once_and_keep_the_users_value():
  text = "--xla_cpu_use_xnnpack=true --xla_dump_to=/tmp/x"
  assert xla_flags.with_flags(text, "--xla_cpu_use_xnnpack=false", "--a=1") == text + " --a=1"
  assert xla_flags.with_flags("", "--a=1", "--a=2") == "--a=1 --a=2"  # as given when absent
  assert xla_flags.with_flags(text, "--xla_cpu_use_xnnpack=false", replace=True) == (
      "--xla_dump_to=/tmp/x --xla_cpu_use_xnnpack=false")


def test_without_flags_drops_every_setting_of_the_named_flags():
  text = "--a=1 --b=2 --a=3 --c"
  assert xla_flags.without_flags(text, "--a=0", "--c") == "--b=2"


def test_apply_and_workarounds_write_the_given_environment():
  environ = {"XLA_FLAGS": "--xla_cpu_use_xnnpack=true"}
  xla_flags.apply_workarounds(environ)
  assert environ == {"XLA_FLAGS": "--xla_cpu_use_xnnpack=true"}
  environ = {}
  xla_flags.apply_workarounds(environ)
  xla_flags.apply("--xla_force_host_platform_device_count=2", environ=environ)
  assert environ["XLA_FLAGS"] == ("--xla_cpu_use_xnnpack=false"
                                  " --xla_force_host_platform_device_count=2")


def test_missing_names_the_unset_settings_and_apply_can_replace():
  environ = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
  assert xla_flags.missing(*xla_flags.REPRODUCIBLE_GPU, environ=environ) == list(
      xla_flags.REPRODUCIBLE_GPU)
  xla_flags.apply(*xla_flags.REPRODUCIBLE_GPU, environ=environ)  # the user's value stays
  assert xla_flags.missing(*xla_flags.REPRODUCIBLE_GPU, environ=environ) == [
      "--xla_gpu_deterministic_ops=true"]
  xla_flags.apply(*xla_flags.REPRODUCIBLE_GPU, environ=environ, replace=True)
  assert xla_flags.missing(*xla_flags.REPRODUCIBLE_GPU, environ=environ) == []
  assert "--xla_gpu_deterministic_ops=false" not in environ["XLA_FLAGS"].split()


def test_apply_serving_adds_the_serving_flags_and_keeps_a_users_setting():
  environ = {}
  xla_flags.apply_serving(environ)
  assert environ["XLA_FLAGS"].split() == [*xla_flags.CPU_WORKAROUNDS, *xla_flags.SERVING_GPU]
  environ = {"XLA_FLAGS": "--xla_gpu_graph_enable_concurrent_region=false"}  # an A/B's off run
  xla_flags.apply_serving(environ)
  assert "--xla_gpu_graph_enable_concurrent_region=false" in environ["XLA_FLAGS"].split()
  assert xla_flags.missing(*xla_flags.SERVING_GPU, environ=environ) == list(xla_flags.SERVING_GPU)


def test_a_backend_starts_with_the_serving_flags(tmp_path):
  """XLA aborts on a flag it does not know: the serving flags must parse on every platform."""
  result = _python("import jax, jax.numpy as jnp; print(int(jnp.ones(3).sum()))",
                   " ".join(xla_flags.SERVING_GPU), tmp_path)
  assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr


def test_the_generation_cli_sets_the_serving_flags_before_jax_starts(tmp_path):
  result = _python("import os, lalte_jax.inference.cli, jax; jax.devices();"
                   " print(os.environ['XLA_FLAGS'])", None, tmp_path)
  assert result.returncode == 0, result.stderr
  assert set(xla_flags.SERVING_GPU) <= set(result.stdout.split())
