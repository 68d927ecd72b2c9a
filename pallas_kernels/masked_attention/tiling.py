"""Block sizes, the static description of one call, and the tile-range arithmetic shared by the
masked-attention Pallas kernels.

Every range below is split in three: masked tiles, interior tiles that need no mask at all (fully
causal, fully inside the window, real keys, no key padding mask), masked tiles. Interior tiles skip
the per-element mask, which is most of the visited tiles for a large window. All arithmetic is on
non-negative int32 values (Triton's integer division truncates, so negative numerators are
avoided).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.pallas_common import cdiv, is_power_of_two


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two, >= 16 for Triton dots) and launch parameters per kernel."""
  # Defaults: the fastest of a sweep on one H200 (SWA-1024, B8 T4096 Hq32 Hkv8 D64 bf16;
  # docs/benchmarks.md, "Attention kernels").
  block_q: int = 64  # forward: queries per program
  block_k: int = 64  # forward: keys per loop step
  block_q_dq: int = 64
  block_k_dq: int = 64
  block_q_dkv: int = 64  # dk/dv: queries per loop step
  block_k_dkv: int = 64  # dk/dv: keys per program
  num_warps: int = 4
  num_stages: int = 3
  num_warps_bwd: int = 4
  # Three stages, not two (one H200, 2026-11-30, fwd+bwd at B8 T4096): SWA-1024 1.557 against
  # 1.763 ms and LTE training 2.084 against 2.312 ms at 16 query over 16 KV heads (the 0.4b
  # presets), 3.035 against 3.093 and 3.419 against 3.481 ms at 32 over 8.
  num_stages_bwd: int = 3
  # The kept-list dk/dv kernel: one program per list tile below `kept_split_from` padded queries,
  # one per chunk of `kept_split_tiles` query tiles from there on (see kept_split).
  kept_split_from: int = 8192
  kept_split_tiles: int = 8

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"BlockSizes.{field.name} must be an int, got {value!r}")
      if field.name.startswith("block") and (not is_power_of_two(value) or value < 16):
        raise ValueError(f"BlockSizes.{field.name} must be a power of two >= 16, got {value}")
      if value <= 0:
        raise ValueError(f"BlockSizes.{field.name} must be positive, got {value}")

  def kept_split(self, padded_query_len: int) -> int:
    """Query tiles per program of the kept-list dk/dv kernel: `kept_split_tiles` (8) from
    `kept_split_from` (8192) padded queries on, else 0.

    0: one program per list tile, deterministic; n > 0: one program per chunk of n query tiles,
    looping over the list tiles it sees, the chunks added with float32 atomics (the sums' order
    varies between runs). A list tile's program walks every later query tile, so at long T a few
    long programs leave most of the GPU idle. LTE fwd+bwd on one H100 (2026-11-22, paired with
    cuDNN), per list tile / split 8 / split 4: B8 T4096 4.12 / 4.07 / 4.06 ms, B4 T8192 4.75 /
    4.27 / 4.25, B2 T16384 5.86 / 4.37 / 4.38 (below 8192 the split is within 1%, so the
    deterministic kernel stays).
    """
    return self.kept_split_tiles if padded_query_len >= self.kept_split_from else 0

  @property
  def query_multiple(self) -> int:
    return max(self.block_q, self.block_q_dq, self.block_q_dkv)

  @property
  def key_multiple(self) -> int:
    return max(self.block_k, self.block_k_dq, self.block_k_dkv)


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static facts about one call (hashable: it parametrises the kernels).

  query_len/key_len are the real lengths T <= S; padded_* are multiples of every block size.
  Query row i sits at absolute position query_offset + i with query_offset = S - T.
  """
  query_len: int
  key_len: int
  padded_query_len: int
  padded_key_len: int
  head_dim: int
  num_q_heads: int
  num_kv_heads: int
  window_size: int | None
  has_kept_list: bool
  has_key_valid: bool
  scale: float
  interpret: bool
  # The forward reads the kept-list keys/values from k/v by position (a gather load in the kernel)
  # instead of from gathered [B, C, Hkv, D] copies: set for calls that are not differentiated
  # (3-5% faster at B8 T4096 to B2 T16384 on one H100). Under differentiation the copies, which
  # the kept dk/dv kernel reads anyway, measured within +-2% of it, so training keeps them.
  gather_kept_in_kernel: bool = False

  @property
  def query_offset(self) -> int:
    return self.key_len - self.query_len

  @property
  def group(self) -> int:
    return self.num_q_heads // self.num_kv_heads


def key_tiles_of_query_tile(problem: Problem, q_start, block_q: int, block_k: int):
  """Key-tile bounds (first, interior_start, interior_end, end) for query rows q_start..+block_q.

  Tiles [first, end) intersect the window (or the causal past) of some query of the tile; tiles in
  [interior_start, interior_end) are visible in full to every query of the tile.
  """
  pos_start = problem.query_offset + q_start
  pos_end = pos_start + block_q - 1
  end = jnp.minimum(pos_end, problem.key_len - 1) // block_k + 1
  window = problem.window_size
  first = 0 if window is None else jnp.maximum(pos_start - window + 1, 0) // block_k
  first = jnp.asarray(first, jnp.int32)
  if problem.has_key_valid:  # the padding mask can hide any key: every tile is masked
    return first, first, first, end
  interior_start = 0 if window is None else cdiv(jnp.maximum(pos_end - window + 1, 0), block_k)
  interior_end = jnp.minimum((pos_start + 1) // block_k, problem.key_len // block_k)
  interior_start = jnp.clip(interior_start, first, end)
  interior_end = jnp.clip(interior_end, interior_start, end)
  return first, interior_start, interior_end, end


def query_tiles_of_key_tile(problem: Problem, k_start, block_q: int, block_k: int):
  """Query-tile bounds (first, interior_start, interior_end, end) that see keys k_start..+block_k
  through the window (or causally, without one); padded key tiles get an empty range."""
  offset = problem.query_offset
  num_q_tiles = problem.padded_query_len // block_q
  key_end = k_start + block_k - 1
  first = jnp.maximum(k_start - offset, 0) // block_q
  if problem.window_size is None:
    end = jnp.asarray(num_q_tiles, jnp.int32)
  else:
    last_row = jnp.minimum(key_end + problem.window_size - 1, problem.key_len - 1) - offset
    end = jnp.where(last_row >= 0, jnp.maximum(last_row, 0) // block_q + 1, 0)
  end = jnp.where(k_start < problem.key_len, end, first)  # a key tile of padding only
  end = jnp.maximum(end, first)
  if problem.has_key_valid:
    return first, first, first, end
  interior_start = cdiv(jnp.maximum(key_end - offset, 0), block_q)
  if problem.window_size is None:
    interior_end = jnp.asarray(num_q_tiles, jnp.int32)
  else:
    # The last row of the tile must stay within the window of the first key.
    room = k_start + problem.window_size - block_q - offset
    interior_end = jnp.where(room >= 0, jnp.maximum(room, 0) // block_q + 1, 0)
  interior_end = jnp.where(key_end < problem.key_len, interior_end, 0)
  interior_start = jnp.clip(interior_start, first, end)
  interior_end = jnp.clip(interior_end, interior_start, end)
  return first, interior_start, interior_end, end


def window_mask(problem: Problem, query_pos, key_pos, key_valid=None):
  """[Q, K] visibility through the causal/window part (sinks and kept keys come from the list).

  Per-key terms are combined per column first, so each element costs compares and ands only
  (masked tiles are per-element work in the kernels' inner loops)."""
  key_ok = key_pos < problem.key_len
  if key_valid is not None:
    key_ok = key_ok & (key_valid != 0)
  mask = (query_pos[:, None] >= key_pos[None, :]) & key_ok[None, :]
  if problem.window_size is not None:  # q - k < window, i.e. q < k + window
    mask = mask & (query_pos[:, None] < (key_pos + problem.window_size)[None, :])
  return mask


def kept_mask(problem: Problem, query_pos, entry_pos):
  """[Q, C] visibility of list entries: only those outside the query's window (no double count):
  q - e >= window, i.e. q >= e + window (one compare per element; PAD_POSITION + window stays
  far below int32's limit)."""
  return query_pos[:, None] >= (entry_pos + problem.window_size)[None, :]
