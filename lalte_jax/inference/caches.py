"""Decode caches of every mixer kind, and the whole model's cache (§2, §3.1, §5, §6).

Batches are left-padded (the prompt's real tokens end at the same padded-tensor index in every
row), so one scalar `position` — the padded index of the next token — describes every row; a row's
real position is `position - pad_count[row]`.

Per layer kind (`B` batch, `G` = number of layer groups; every leaf of a layer cache carries a
leading `[G]` axis because the model scans over stacked groups):
- GDN: a ring of the last `conv_size` pre-activation q/k/v projections, the input at padded index
  p in slot `p % conv_size` (what the causal conv reads; zeros before the first token and at
  pads), and the float32 recurrent state stored transposed, `[B,H,Dv,Dk]` (the layout in which
  the decode kernel reads and writes it at the copy bandwidth). Constant size. A decode step
  writes the new token's inputs over the oldest ones (which the filter no longer reads), then
  reads the ring.
- SWA: a ring of `window_size` post-RoPE keys and values; the key at padded index p lives in slot
  `p % window_size`. Constant size.
- Full attention: keys and values preallocated to `max_length` padded indices (slot = padded index).
  Grows with nothing but must be sized for the prompt plus the generated tokens. A model whose
  full-attention layers use an eviction policy (`eviction.py`) keeps a constant-size cache instead.
- NSA: keys and values preallocated to `max_length` real positions (rounded up to whole blocks):
  each row's tokens start at slot 0 (pads removed) so that NSA's 64-token blocks start at the row's
  first real token, as the reference's unpadding to varlen does (§6); plus the mean of every
  complete block (`pallas_kernels.nsa`'s compressed cache).
- LTE: `lte_cache.LTECache` (ring of W = w+1 plus the capped out-of-window segment), constant size.

Each mixer reads and writes its own cache in its `prefill` / `decode` methods
(`lalte_jax/mixers/`), given a `StepContext`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from lalte_jax.config import ModelConfig
from pallas_kernels import nsa as nsa_ops


@flax.struct.dataclass
class GDNCache:
  conv_q_BKC: jax.Array  # [B, conv_size, key_dim] pre-activation q projections, ring by index
  conv_k_BKC: jax.Array  # [B, conv_size, key_dim]
  conv_v_BKC: jax.Array  # [B, conv_size, value_dim]
  state_BHVK: jax.Array  # [B, H, Dv, Dk] float32: the recurrent state, transposed


@flax.struct.dataclass
class KVCache:
  """Post-RoPE keys and values of a full-attention layer (slot = padded index) or of an SWA layer
  (ring, slot = padded index mod window_size)."""
  k_BSKD: jax.Array
  v_BSKD: jax.Array


@flax.struct.dataclass
class NSACache:
  """Post-RoPE keys and values of an NSA layer, slot = the row's real position, and the means of
  their complete blocks (block n at index n; zeros until the block is complete)."""
  k_BSKD: jax.Array
  v_BSKD: jax.Array
  k_cmp_BNKD: jax.Array
  v_cmp_BNKD: jax.Array


@flax.struct.dataclass
class ModelCache:
  """Everything a decode step needs besides the parameters.

  layers: one cache per position of the layer group (`config.layer_pattern[:pattern_period]`),
    each leaf stacked over the `G` groups.
  pad_count_B: [B] int32 left pads of each row (fixed at prefill).
  position: [] int32 padded index of the next token (= tokens seen so far, pads included).
  max_length: capacity in padded indices of the full-attention / NSA caches, None when the model
    has none (its cache never grows).
  """
  layers: tuple[Any, ...]
  pad_count_B: jax.Array
  position: jax.Array
  max_length: int | None = flax.struct.field(pytree_node=False, default=None)


@flax.struct.dataclass
class StepContext:
  """What a mixer's prefill / decode step reads besides its input and its cache."""
  valid_BT: jax.Array  # bool: real token (False = left pad)
  pad_count_B: jax.Array  # [B] int32 left pads of each row
  position: jax.Array  # [] int32 padded index of this call's first token
  # A prefill's chunk (lalte_jax.inference.chunking): its layers run over this many
  # tokens at a time; None: the whole prompt at once.
  chunk_tokens: int | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def for_prompt(cls, valid_BT: jax.Array, chunk_tokens: int | None = None) -> StepContext:
    """A left-padded prompt from the start of the sequence."""
    pad_count_B = (valid_BT.shape[1] - jnp.sum(valid_BT, axis=1)).astype(jnp.int32)
    return cls(valid_BT=valid_BT, pad_count_B=pad_count_B, position=jnp.zeros((), jnp.int32),
               chunk_tokens=chunk_tokens)

  @classmethod
  def for_token(cls, cache: ModelCache) -> StepContext:
    """One new (real) token per row after the tokens `cache` holds."""
    batch = cache.pad_count_B.shape[0]
    return cls(valid_BT=jnp.ones((batch, 1), bool), pad_count_B=cache.pad_count_B,
               position=cache.position)

  @property
  def real_positions_BT(self) -> jax.Array:
    """RoPE positions of full/SWA/NSA layers: the first real token of a row is 0 (§3.1).
    Pads get negative positions; they are never visible."""
    length = self.valid_BT.shape[1]
    return self.position + jnp.arange(length, dtype=jnp.int32)[None] - self.pad_count_B[:, None]


def ring_from_prompt(x_BT_: jax.Array, ring_size: int) -> jax.Array:
  """The last `ring_size` prompt entries [B, T, ...] placed at slot (padded index mod ring_size),
  zeros in slots no prompt entry reached: [B, ring_size, ...]."""
  length = x_BT_.shape[1]
  if length < ring_size:
    return jnp.pad(x_BT_, ((0, 0), (0, ring_size - length)) + ((0, 0),) * (x_BT_.ndim - 2))
  start = length - ring_size
  return jnp.roll(x_BT_[:, start:], start % ring_size, axis=1)


def ring_from_tail(tail_BR_: jax.Array, length: int) -> jax.Array:
  """`ring_from_prompt` of a prompt of `length` entries from its last R = ring size entries
  [B, R, ...] (zeros standing for entries before the prompt's start)."""
  ring_size = tail_BR_.shape[1]
  return jnp.roll(tail_BR_, (length - ring_size) % ring_size, axis=1)


def write_prompt(buffer_BSKD: jax.Array, x_BTKD: jax.Array) -> jax.Array:
  """The prompt's keys or values into the first T slots of a preallocated cache buffer."""
  return jax.lax.dynamic_update_slice_in_dim(buffer_BSKD, x_BTKD.astype(buffer_BSKD.dtype), 0,
                                             axis=1)


def needs_max_length(config: ModelConfig, eviction) -> list[str]:
  """Layer kinds of `config` whose cache is sized by max_length (empty list: constant memory)."""
  kinds = []
  if "attention" in config.layer_pattern and config.attention.window_size is None \
      and eviction is None:
    kinds.append("full attention")
  if "nsa" in config.layer_pattern:
    kinds.append("nsa")
  return kinds


def _gdn_cache(config: ModelConfig, batch: int) -> GDNCache:
  gdn = config.gdn
  dtype = config.compute_dtype
  key_dim, value_dim = gdn.num_heads * gdn.head_dim, gdn.num_heads * gdn.value_dim
  taps = gdn.conv_size
  return GDNCache(
      conv_q_BKC=jnp.zeros((batch, taps, key_dim), dtype),
      conv_k_BKC=jnp.zeros((batch, taps, key_dim), dtype),
      conv_v_BKC=jnp.zeros((batch, taps, value_dim), dtype),
      state_BHVK=jnp.zeros((batch, gdn.num_heads, gdn.value_dim, gdn.head_dim), jnp.float32))


def _kv(batch: int, slots: int, heads: int, head_dim: int, dtype) -> tuple[jax.Array, jax.Array]:
  shape = (batch, slots, heads, head_dim)
  return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _layer_cache(kind: str, config: ModelConfig, batch: int, max_length: int | None, eviction):
  dtype = config.compute_dtype
  if kind == "gdn":
    return _gdn_cache(config, batch)
  if kind == "attention":
    attn = config.attention
    if attn.window_size is not None:
      return KVCache(*_kv(batch, attn.window_size, attn.num_kv_heads, attn.head_dim, dtype))
    if eviction is not None:
      from lalte_jax.inference import eviction as eviction_lib
      return eviction_lib.init_eviction_cache(eviction, attn, batch, dtype)
    return KVCache(*_kv(batch, max_length, attn.num_kv_heads, attn.head_dim, dtype))
  if kind == "nsa":
    nsa = config.nsa
    slots = nsa_ops.cache_length(max_length, nsa.block_size)
    blocks = nsa_ops.compressed_blocks(max_length, nsa.block_size)
    return NSACache(*_kv(batch, slots, nsa.num_kv_heads, nsa.head_dim, dtype),
                    *_kv(batch, blocks, nsa.num_kv_heads, nsa.head_dim, dtype))
  if kind == "lte":
    from lalte_jax.inference import lte_cache  # written separately; imported only when used
    return lte_cache.init_lte_cache(config.lte, batch, dtype)
  raise ValueError(f"unknown mixer kind {kind!r}")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def build_cache(config: ModelConfig, batch: int, max_length: int | None, eviction) -> ModelCache:
  """The empty cache, unchecked (`init_model_cache` validates). Jitted so that multi-GB caches
  are created on the device, not transferred from the host; traceable inside other jits."""
  num_groups = config.num_layers // config.pattern_period
  layers = []
  for kind in config.layer_pattern[:config.pattern_period]:
    one = _layer_cache(kind, config, batch, max_length, eviction)
    layers.append(jax.tree.map(lambda x: jnp.broadcast_to(x, (num_groups, *x.shape)), one))
  return ModelCache(layers=tuple(layers), pad_count_B=jnp.zeros((batch,), jnp.int32),
                    position=jnp.zeros((), jnp.int32), max_length=max_length)


def check_cache_request(config: ModelConfig, batch_size: int, max_length: int | None,
                        eviction=None) -> int | None:
  """Validates `init_model_cache`'s arguments; returns the max_length the cache will use (None for
  constant-memory models, whose caches do not depend on it)."""
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size: must be a positive int, got {batch_size!r}")
  if eviction is not None:
    if "attention" not in config.layer_pattern or config.attention.window_size is not None:
      raise ValueError(f"eviction: {config.name} has no full-attention layer to apply"
                       f" {eviction.policy!r} to (eviction policies replace full-attention caches)")
  sized = needs_max_length(config, eviction)
  if max_length is None:
    if sized:
      raise ValueError(f"max_length: {config.name} has {' and '.join(sized)} layers whose cache"
                       " holds every token; give max_length (prompt + new tokens, pads included)")
  elif not isinstance(max_length, int) or max_length < 1:
    raise ValueError(f"max_length: must be a positive int or None, got {max_length!r}")
  return max_length if sized else None


def init_model_cache(config: ModelConfig, batch_size: int, max_length: int | None = None,
                     eviction=None) -> ModelCache:
  """An empty cache for `batch_size` rows; see `lalte_jax.generate.init_cache`."""
  max_length = check_cache_request(config, batch_size, max_length, eviction)
  return build_cache(config, batch_size, max_length, eviction)


def cache_bytes(cache) -> int:
  """Bytes held by the arrays of `cache` (all rows): a ModelCache, one layer's cache, or any
  pytree of arrays or shapes."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
