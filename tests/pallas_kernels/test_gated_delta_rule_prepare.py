"""The per-chunk preparation kernels (pallas_prepare.py) against the XLA `prepare_scan_inputs`.

Interpret mode off the GPU: the kernels' logic (l2norm, decays, A, the inverse, w and u, and the
two backward kernels) on tiny shapes. The forward outputs must match the XLA preparation's and
the VJP (all five input gradients, random cotangents for all six outputs) must equal jax.vjp of
the XLA preparation. Interpret mode fills output buffers with NaN before the kernel runs and the
comparisons reject non-finite values, so every output element must be written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta_rule.xla_prepare import prepare_scan_inputs
from pallas_kernels.gated_delta_rule.pallas_prepare import PrepareConfig, prepare_chunks
from tests.kernel_testing import assert_close
from tests.pallas_kernels.test_gated_delta_rule import make_inputs, round_to

OUTPUT_NAMES = ("w", "u", "kd", "qg", "p", "chunk_decay")
INPUT_NAMES = ("q", "k", "v", "g", "beta")


def _inputs(seed, dtype, *, seq_len, key_dim, value_dim, use_qk_l2norm):
  raw = round_to(make_inputs(seed, seq_len=seq_len, key_dim=key_dim, value_dim=value_dim,
                             normalized_keys=not use_qk_l2norm), dtype)
  return [jnp.asarray(raw[n], dtype) for n in INPUT_NAMES]


def _reference(q, k, v, g, beta, *, use_qk_l2norm, chunk_size):
  return prepare_scan_inputs(q, k, v, g, beta, scale=None, initial_state=None,
                             use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)[:6]


def _compare(dtype, *, seq_len, chunk_size, key_dim, value_dim, use_qk_l2norm, seed,
             config=PrepareConfig()):
  args = _inputs(seed, dtype, seq_len=seq_len, key_dim=key_dim, value_dim=value_dim,
                 use_qk_l2norm=use_qk_l2norm)
  kwargs = dict(use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
  kernels = lambda *x: prepare_chunks(*x, None, kwargs["use_qk_l2norm"], kwargs["chunk_size"],
                                      config)
  # Both the plain call and the custom_vjp's forward (under jax.vjp) are checked.
  actual = jax.jit(kernels)(*args)
  actual_from_vjp, actual_vjp = jax.jit(lambda *a: jax.vjp(kernels, *a))(*args)
  expected, expected_vjp = jax.jit(lambda *a: jax.vjp(lambda *x: _reference(*x, **kwargs),
                                                      *a))(*args)
  for name, a, a_vjp, e in zip(OUTPUT_NAMES, actual, actual_from_vjp, expected):
    assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
    assert_close(a, e, dtype, name=name)
    assert_close(a_vjp, e, dtype, name=f"{name} (under jax.vjp)")
  rng = np.random.default_rng(seed + 1)
  cotangents = [jnp.asarray(rng.standard_normal(e.shape), e.dtype) for e in expected]
  for name, a, e in zip(INPUT_NAMES, actual_vjp(tuple(cotangents)),
                        expected_vjp(tuple(cotangents))):
    assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, e.shape, a.dtype, e.dtype)
    assert_close(a, e, dtype, name=f"d{name}")


# T = 37 is not a multiple of C; K = 24 and V = 20 are not powers of two; K != V catches swaps.
# Each row compiles the kernels and the reference, forward and backward (~10 s on CPU).
@pytest.mark.slow
@pytest.mark.parametrize("seq_len,chunk_size,key_dim,value_dim,use_qk_l2norm", [
    (37, 16, 24, 20, True),
    (32, 16, 16, 32, False),
], ids=["T37_C16_K24_V20_l2norm", "T32_C16_K16_V32_raw"])
def test_prepare_chunks_float32_matches_xla(seq_len, chunk_size, key_dim, value_dim,
                                            use_qk_l2norm):
  _compare(jnp.float32, seq_len=seq_len, chunk_size=chunk_size, key_dim=key_dim,
           value_dim=value_dim, use_qk_l2norm=use_qk_l2norm, seed=10 + seq_len)


def test_prepare_chunks_bf16_matches_xla():
  # The fast check of every term (a dropped gradient term errs by O(1), far above 2e-2).
  _compare(jnp.bfloat16, seq_len=40, chunk_size=16, key_dim=32, value_dim=16, use_qk_l2norm=True,
           seed=21)


def test_prepare_chunks_config_validates():
  with pytest.raises(ValueError, match="num_warps"):
    PrepareConfig(num_warps=0)
  with pytest.raises(ValueError, match="wy_backward_num_warps"):
    PrepareConfig(wy_backward_num_warps=True)
  with pytest.raises(ValueError, match="chunk_size"):
    prepare_chunks(*_inputs(1, jnp.float32, seq_len=8, key_dim=16, value_dim=16,
                            use_qk_l2norm=True), None, True, 24)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,key_dim", [(jnp.float32, 128), (jnp.bfloat16, 128),
                                           (jnp.bfloat16, 256)], ids=["float32", "bf16", "bf16_K256"])
def test_prepare_chunks_on_gpu_matches_xla(dtype, key_dim):
  # Compiled by Triton at realistic head sizes and the default chunk; T = 1000 is not a multiple
  # of it.
  _compare(dtype, seq_len=1000, chunk_size=64, key_dim=key_dim, value_dim=key_dim,
           use_qk_l2norm=True, seed=31)
