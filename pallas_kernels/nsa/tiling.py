"""Block sizes and the static description of one NSA call, shared by the Pallas kernels.

Rows of the compressed-attention kernels are (query position, head) pairs: a program takes
`positions` consecutive queries with all G query heads of one KV head, row r = p * G + g, so each
compressed key tile is loaded once for the whole group. The selected-attention kernels take one
query position per program with its G heads as rows (the G heads share the position's selection,
so each selected block is loaded once for all of them); their key/value gradient gathers, per
selected block, the queries that chose it, `queries_per_step` at a time (rows = queries x G).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.pallas_common import (
    LOG2_E, MIN_DOT_DIM, check_launch_fields, is_power_of_two, next_power_of_two, round_up)


@dataclasses.dataclass(frozen=True)
class NSABlockSizes:
  """Tile sizes (powers of two) and launch parameters of the NSA kernels."""
  # Compressed attention, forward and dq: query positions per program (rows = positions x G) and
  # compressed keys per loop step.
  cmp_positions: int = 4
  cmp_keys: int = 64
  # Compressed attention dk/dv: compressed keys per program, query positions per loop step, and
  # query positions per program (the queries are split over programs whose partial sums add up).
  cmp_bwd_keys: int = 32
  cmp_bwd_positions: int = 4
  cmp_bwd_queries_per_program: int = 512
  # Selected attention dk/dv: queries gathered per loop step (rows = queries x G) and at most how
  # many queries of one block's list a program takes (longer lists, such as the first block's,
  # which every query selects, are split over programs that add up with float32 atomics).
  slc_queries_per_step: int = 4
  slc_queries_per_program: int = 256
  # Warps of the selected forward and dq programs, whose rows are the G heads of one position:
  # with so few rows, 1 warp ran them in 1,412 and 1,570 us against 2,108 and 2,164 with 4 (H200,
  # B8 T4096 G16, 2026-11-28).
  slc_num_warps: int = 1
  slc_dq_num_warps: int = 1
  # Decoding: programs per (batch row, KV head), each taking every decode_splits-th selected block
  # and window tile (more programs than rows x KV heads keep the GPU's cores busy at small B).
  decode_splits: int = 4
  # Launch parameters of the other kernels (compressed attention, selected dk/dv, decoding).
  num_warps: int = 4
  num_stages: int = 2
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    check_launch_fields(self, power_of_two=lambda name: not name.startswith("num_stages"))
    if self.cmp_bwd_queries_per_program < max(self.cmp_positions, self.cmp_bwd_positions):
      raise ValueError("NSABlockSizes.cmp_bwd_queries_per_program must be >= cmp_positions and"
                       f" cmp_bwd_positions, got {self.cmp_bwd_queries_per_program}")


@dataclasses.dataclass(frozen=True)
class Problem:
  """Static facts about one call (hashable: it parametrises the kernels).

  Queries are the last query_len of key_len positions: query row i sits at position
  query_offset + i. Arrays reach the kernels padded: queries to padded_query_len, keys to
  padded_key_len (a multiple of block_size), compressed keys to num_blocks_padded (a power of two
  >= every tile of compressed keys).
  """
  query_len: int
  key_len: int
  padded_query_len: int
  padded_key_len: int
  num_blocks_padded: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  block_count: int
  scale: float
  interpret: bool

  @property
  def query_offset(self) -> int:
    return self.key_len - self.query_len

  @property
  def group(self) -> int:
    return self.num_q_heads // self.num_kv_heads

  @property
  def score_scale(self) -> float:
    """scale * log2(e): the kernels' scores are in the log2 domain."""
    return self.scale * LOG2_E


def make_problem(q_shape, k_shape, *, block_size: int, block_count: int, scale: float,
                 blocks: NSABlockSizes, interpret: bool) -> Problem:
  batch, query_len, num_q_heads, head_dim = q_shape
  key_len, num_kv_heads = k_shape[1], k_shape[2]
  del batch
  query_multiple = max(blocks.cmp_positions, blocks.cmp_bwd_positions)
  padded_key_len = round_up(key_len, block_size)
  num_blocks = padded_key_len // block_size
  return Problem(
      query_len=query_len, key_len=key_len,
      padded_query_len=round_up(query_len, query_multiple), padded_key_len=padded_key_len,
      num_blocks_padded=max(next_power_of_two(num_blocks), blocks.cmp_keys, blocks.cmp_bwd_keys),
      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
      block_size=block_size, block_count=block_count, scale=float(scale), interpret=interpret)


def check_supported(q_shape, v_shape, dtype, *, block_size: int, blocks: NSABlockSizes,
                    interpret: bool) -> None:
  """Raises NotImplementedError for inputs the Pallas version cannot handle (callers may fall
  back to "xla")."""
  head_dim, num_q_heads, num_kv_heads = q_shape[-1], q_shape[2], v_shape[2]
  group = num_q_heads // num_kv_heads
  problems = []
  if v_shape[-1] != head_dim:
    problems.append(f"value head dim {v_shape[-1]} != key head dim {head_dim}")
  for name, size in (("head dim", head_dim), ("block_size", block_size),
                     ("query heads per KV head", group)):
    if not is_power_of_two(size):
      problems.append(f"{name} {size} must be a power of two (Triton block shapes)")
  if head_dim < MIN_DOT_DIM or block_size < MIN_DOT_DIM:
    problems.append(f"head dim {head_dim} and block_size {block_size} must be >= {MIN_DOT_DIM}")
  if not interpret:
    # Every tl.dot operand needs >= 16 rows: the selected kernels' rows are the G heads.
    if group < MIN_DOT_DIM or group * min(blocks.cmp_positions, blocks.cmp_bwd_positions,
                                          blocks.slc_queries_per_step) < MIN_DOT_DIM:
      problems.append(f"{group} query heads per KV head; the GPU kernels need >= {MIN_DOT_DIM}")
    if str(dtype) not in ("bfloat16", "float16", "float32"):
      problems.append(f"dtype {dtype} on GPU")
  if problems:
    raise NotImplementedError("nsa_attention[pallas]: " + "; ".join(problems))
