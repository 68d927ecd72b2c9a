"""`implementation="pallas"` of `nsa_attention`: the three branches on Pallas kernels.

    k_cmp, v_cmp = mean pooling of k, v over blocks           (XLA, `reference.compress`)
    o_cmp, importance = compressed attention                  (pallas_compressed.py)
    selection = top block_count of importance                 (XLA top_k, selection.py)
    o_slc = attention over the selected blocks                (pallas_selected.py)
    o_swa = sliding-window attention                          (masked_attention's Pallas kernels)
    o = g_cmp o_cmp + g_slc o_slc + g_swa o_swa               (XLA, float32, then q's dtype)

Each kernel branch is a custom VJP; the pooling and the gates are differentiated by XLA, so the
gradients reach q, k, v and the gates through all three branches, and none through the
selection, as in the reference. On CPU the kernels run in Pallas interpret mode (for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.masked_attention import pallas as masked_attention_pallas
from pallas_kernels.nsa import reference, selection
from pallas_kernels.nsa.pallas_compressed import compressed_attention
from pallas_kernels.nsa.pallas_selected import selected_attention
from pallas_kernels.nsa.tiling import NSABlockSizes, check_supported, make_problem
from pallas_kernels.pallas_common import interpret_mode, save_kernel_outputs

__all__ = ["nsa_attention"]


def _pad_rows(x, length: int):
  """x padded with zeros along axis 1 to `length`."""
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def nsa_attention(
    q_BTHD: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    gates_BTH3: jax.Array,
    *,
    block_size: int,
    block_count: int,
    window_size: int,
    scale: float | None = None,
    block_sizes: NSABlockSizes = NSABlockSizes(),
    interpret: bool | None = None,
) -> jax.Array:
  """Same contract as `reference.nsa_attention`; differentiable wrt q, k, v and the gates.

  interpret: None -> Pallas interpret mode unless the default backend is a GPU.
  """
  if interpret is None:
    interpret = interpret_mode()
  check_supported(q_BTHD.shape, v_BTKD.shape, q_BTHD.dtype, block_size=block_size,
                  blocks=block_sizes, interpret=interpret)
  if scale is None:
    scale = q_BTHD.shape[-1] ** -0.5
  problem = make_problem(q_BTHD.shape, k_BTKD.shape, block_size=block_size,
                         block_count=block_count, scale=scale, blocks=block_sizes,
                         interpret=interpret)
  query_len = problem.query_len
  dtype = q_BTHD.dtype
  k_pad_BTKD = _pad_rows(k_BTKD, problem.padded_key_len)
  v_pad_BTKD = _pad_rows(v_BTKD, problem.padded_key_len)
  # Pooled in float32 (a partial last block over its real length), stored in the inputs' dtype.
  k_cmp_BNKD, v_cmp_BNKD = (
      _pad_rows(reference.compress(x, block_size).astype(x.dtype), problem.num_blocks_padded)
      for x in (k_BTKD, v_BTKD))
  o_cmp_BTHD, importance_BTKN = compressed_attention(
      problem, block_sizes, _pad_rows(q_BTHD, problem.padded_query_len), k_cmp_BNKD, v_cmp_BNKD)
  # Saved by the remat policies that keep kernel outputs: the backward then needs no top_k.
  indices_BTKS, counts_BTK = save_kernel_outputs(
      *selection.select_top_blocks(importance_BTKN[:, :query_len], block_count))
  o_slc_BTHD = selected_attention(problem, block_sizes, q_BTHD, k_pad_BTKD, v_pad_BTKD,
                                  indices_BTKS, counts_BTK)
  o_swa_BTHD = masked_attention_pallas.masked_attention(
      q_BTHD, k_BTKD, v_BTKD, scale=scale, window_size=window_size, interpret=interpret)
  f32 = lambda x: x.astype(jnp.float32)
  return reference.gated_sum(f32(gates_BTH3), f32(o_cmp_BTHD[:, :query_len]), f32(o_slc_BTHD),
                             f32(o_swa_BTHD)).astype(dtype)
