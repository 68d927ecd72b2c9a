"""NSA decoding as pure functions over a layer's cache arrays (§6, decoding).

The cache of an NSA layer is
  k_BSKD, v_BSKD          [B, S, Hkv, D]: post-RoPE keys and values, slot = the token's position
                          in its row (S a multiple of block_size: `cache_length`);
  k_cmp_BNKD, v_cmp_BNKD  [B, N, Hkv, D]: the mean of every complete block of block_size tokens
                          (N = `compressed_blocks`), in the cache's dtype.
A block is pooled once, by `append_token` when its last token arrives (or by `compress_prompt`
after a prefill), so a decode step reads the complete blocks' means, the selected blocks and the
window, never the whole cache. Each row has its own position (rows hold prompts of different
lengths).

A decode loop per layer:
    k, v = write the prompt's keys/values at slots [0, L_b) of each row  (prefill)
    k_cmp, v_cmp = compress_prompt(k, v, L_B, ...)
    per step, for the token at position t_B (= L_B, then + 1 each step):
      k, v, k_cmp, v_cmp = append_token(k, v, k_cmp, v_cmp, new_k, new_v, t_B, ...)
      o_BHD = nsa_decode_attention(q_BHD, gates_BH3, k, v, k_cmp, v_cmp, t_B, ...)

`append_token` and `nsa_decode_attention` also take the four caches stacked over the model's layer
groups with the group to use (`group=`, `pallas_kernels.stacked`): they then write and read that
group's part of the stacked buffers in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention_checks import check_positive_int, check_qkv
from pallas_kernels.dispatch import Implementation, resolve
from pallas_kernels.nsa import pallas_decode, reference, xla_decode
from pallas_kernels.nsa.tiling import NSABlockSizes
from pallas_kernels.pallas_common import cdiv, round_up
from pallas_kernels.stacked import as_stacked, per_group

__all__ = ["append_token", "cache_length", "compress_prompt", "compressed_blocks",
           "nsa_decode_attention"]

# What implementation=None runs on a GPU: the Pallas kernels (16+ query heads per KV head, caches
# laid out by cache_length / compressed_blocks); other inputs go to "xla".
GPU_DEFAULT = ("pallas", "xla")


def cache_length(max_length: int, block_size: int) -> int:
  """Slots of a key/value cache for sequences of up to max_length tokens: whole blocks."""
  return round_up(max_length, block_size)


def compressed_blocks(max_length: int, block_size: int,
                      block_sizes: NSABlockSizes = NSABlockSizes()) -> int:
  """Blocks of a compressed cache for up to max_length tokens, rounded up to the compressed
  attention kernel's tile (the Pallas version reads it in whole tiles)."""
  return round_up(cdiv(max_length, block_size), block_sizes.cmp_keys)


def _pool_block(x_GBSKD, group, block_B, block_size: int):
  """Mean over each row's block block_B[b] of group `group` (float32 sums), in x's dtype:
  [B, Hkv, D]."""
  zero = jnp.zeros((), jnp.int32)
  take = lambda row, block: jax.lax.dynamic_slice(
      x_GBSKD, (group, row, (block * block_size).astype(jnp.int32), zero, zero),
      (1, 1, block_size, *x_GBSKD.shape[3:]))[0, 0]
  blocks_BSKD = jax.vmap(take)(jnp.arange(block_B.shape[0], dtype=jnp.int32), block_B)
  return jnp.mean(blocks_BSKD.astype(jnp.float32), axis=1).astype(x_GBSKD.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "num_blocks"))
def compress_prompt(k_BSKD: jax.Array, v_BSKD: jax.Array, length_B: jax.Array, *,
                    block_size: int, num_blocks: int):
  """(k_cmp, v_cmp) [B, num_blocks, Hkv, D]: the means of each row's complete blocks among its
  first length_B[b] tokens, zeros for the others."""
  batch, slots, num_kv_heads, _ = k_BSKD.shape
  if slots % block_size or num_blocks * block_size < slots:
    raise ValueError(f"compress_prompt: cache length {slots} must be a multiple of block_size"
                     f" {block_size} and at most num_blocks x block_size")
  complete_BN1 = (jnp.arange(num_blocks)[None, :] < (length_B // block_size)[:, None])[..., None]

  def pool(x_BSKD):
    means_BNKD = jnp.mean(x_BSKD.astype(jnp.float32).reshape(
        batch, slots // block_size, block_size, num_kv_heads, -1), axis=2)
    means_BNKD = jnp.pad(means_BNKD, ((0, 0), (0, num_blocks - slots // block_size), (0, 0),
                                      (0, 0)))
    return jnp.where(complete_BN1[..., None], means_BNKD, 0.0).astype(x_BSKD.dtype)

  return pool(k_BSKD), pool(v_BSKD)


@functools.partial(jax.jit, static_argnames=("block_size",))
def append_token(k_BSKD: jax.Array, v_BSKD: jax.Array, k_cmp_BNKD: jax.Array,
                 v_cmp_BNKD: jax.Array, new_k_BKD: jax.Array, new_v_BKD: jax.Array,
                 position_B: jax.Array, *, block_size: int, group: jax.Array | None = None):
  """Writes each row's new key/value at slot position_B[b]; a row whose token completes its
  block (position + 1 a multiple of block_size) also writes that block's mean to the compressed
  cache. Returns the four cache arrays (updated in place when the caller donates them, as a
  jitted decode step does with its cache). With `group`, the caches are stacked over layer
  groups ([G, B, ...]) and only group `group`'s new rows are written."""
  stacked = [as_stacked(x, group) for x in (k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD)]
  (k_GBSKD, index), (v_GBSKD, _), (k_cmp_GBNKD, _), (v_cmp_GBNKD, _) = stacked
  rows_B = jnp.arange(k_GBSKD.shape[1])
  k_GBSKD = k_GBSKD.at[index, rows_B, position_B].set(new_k_BKD.astype(k_GBSKD.dtype))
  v_GBSKD = v_GBSKD.at[index, rows_B, position_B].set(new_v_BKD.astype(v_GBSKD.dtype))
  block_B = position_B // block_size
  # Rows whose block is not complete write to block index N (past the end): dropped.
  target_B = jnp.where((position_B + 1) % block_size == 0, block_B, k_cmp_GBNKD.shape[2])

  def pooled(x_GBSKD, x_cmp_GBNKD):
    return x_cmp_GBNKD.at[index, rows_B, target_B].set(
        _pool_block(x_GBSKD, index, block_B, block_size), mode="drop")

  out = (k_GBSKD, v_GBSKD, pooled(k_GBSKD, k_cmp_GBNKD), pooled(v_GBSKD, v_cmp_GBNKD))
  return out if group is not None else tuple(x[0] for x in out)


def _check_arguments(q_BHD, gates_BH3, k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD, position_B,
                     block_size, block_count, window_size, group):
  op = "nsa_decode_attention"
  k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD = (
      per_group(op, name, x, group, 4) for name, x in (
          ("k_BSKD", k_BSKD), ("v_BSKD", v_BSKD), ("k_cmp_BNKD", k_cmp_BNKD),
          ("v_cmp_BNKD", v_cmp_BNKD)))
  check_qkv(op, q_BHD, k_BSKD, v_BSKD, names=("q_BHD", "k_BSKD", "v_BSKD"), one_query=True)
  batch, num_q_heads = q_BHD.shape[:2]
  for name, value in (("block_size", block_size), ("block_count", block_count),
                      ("window_size", window_size)):
    check_positive_int(op, name, value)
  if gates_BH3.shape != (batch, num_q_heads, 3):
    raise ValueError(f"{op}: gates_BH3 must have shape [B, Hq, 3] = {(batch, num_q_heads, 3)},"
                     f" got {gates_BH3.shape}")
  slots = k_BSKD.shape[1]
  for name, array in (("k_cmp_BNKD", k_cmp_BNKD), ("v_cmp_BNKD", v_cmp_BNKD)):
    if (array.ndim != 4 or array.shape[0] != batch or array.shape[2:] != k_BSKD.shape[2:]
        or array.shape[1] * block_size < slots):
      raise ValueError(f"{op}: {name} must be [B, N, Hkv, D] with N >= S / block_size ="
                       f" {cdiv(slots, block_size)}, got {array.shape} for k_BSKD {k_BSKD.shape}")
  if position_B.shape != (batch,) or not jnp.issubdtype(position_B.dtype, jnp.integer):
    raise ValueError(f"{op}: position_B must be integer [B] = ({batch},), got"
                     f" {position_B.dtype} {position_B.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "block_count", "window_size", "scale", "implementation"))
def nsa_decode_attention(
    q_BHD: jax.Array,
    gates_BH3: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    k_cmp_BNKD: jax.Array,
    v_cmp_BNKD: jax.Array,
    position_B: jax.Array,
    *,
    block_size: int,
    block_count: int,
    window_size: int,
    scale: float | None = None,
    group: jax.Array | None = None,
    implementation: Implementation = None,
) -> jax.Array:
  """NSA output of each row's one new query, from the caches (module docstring).

  Args:
    q_BHD: [B, Hq, D] the new tokens' queries (after RoPE).
    gates_BH3: [B, Hq, 3] their sigmoided gates, ordered [cmp, slc, swa].
    k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD: the cache after `append_token` of these tokens.
    position_B: int [B] each row's query position; slots after it are never read.
    block_size, block_count, window_size, scale: as `nsa_attention`.
    group: int32 [] layer group to read when the four caches are stacked over the model's layer
      groups ([G, B, ...] each); None: plain caches.
    implementation: "xla" (`xla_decode.decode_attention`: reads the compressed cache, the
      selected blocks and the window) or "pallas" (`pallas_decode.decode_attention`); None:
      GPU_DEFAULT on a GPU, "xla" elsewhere. `reference.decode_attention` (dense) is the ground
      truth of both.

  Returns:
    [B, Hq, Dv] in q's dtype: `nsa_attention`'s output at position_B[b] for the sequence in the
    cache (teacher forcing).
  """
  _check_arguments(q_BHD, gates_BH3, k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD, position_B,
                   block_size, block_count, window_size, group)
  version = resolve("nsa_decode_attention", implementation,
                    {"xla": xla_decode.decode_attention, "pallas": pallas_decode.decode_attention},
                    gpu_default=GPU_DEFAULT)
  stacked = [as_stacked(x, group) for x in (k_BSKD, v_BSKD, k_cmp_BNKD, v_cmp_BNKD)]
  return version(q_BHD, gates_BH3, *(x for x, _ in stacked), position_B, stacked[0][1],
                 block_size=block_size, block_count=block_count, window_size=window_size,
                 scale=scale)
