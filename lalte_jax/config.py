"""Model configuration: frozen, validated dataclasses, one per mixer plus the whole model.

Every config checks itself at construction and raises `ValueError` naming the offending field, so a
bad configuration fails before any parameter is allocated. Presets live in `presets.py`;
`get_model_config` is re-exported here because it is the public entry.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp

MixerKind = Literal["gdn", "attention", "lte", "nsa"]
MIXER_KINDS = ("gdn", "attention", "lte", "nsa")
RematPolicy = Literal["none", "block", "dots", "attention", "dots_attention"]
REMAT_POLICIES = ("none", "block", "dots", "attention", "dots_attention")


def _require(condition: bool, field: str, message: str) -> None:
  if not condition:
    raise ValueError(f"{field}: {message}")


def _positive(owner: str, **values: int | float) -> None:
  for name, value in values.items():
    _require(value > 0, f"{owner}.{name}", f"must be positive, got {value!r}")


@dataclasses.dataclass(frozen=True)
class GDNConfig:
  """Gated DeltaNet mixer (§2)."""
  num_heads: int
  head_dim: int  # d_k
  expand_v: int = 1  # d_v = expand_v * d_k
  conv_size: int = 4
  norm_eps: float = 1e-6
  chunk_size: int = 64
  implementation: str | None = None

  def __post_init__(self):
    _positive("gdn", num_heads=self.num_heads, head_dim=self.head_dim, expand_v=self.expand_v,
              conv_size=self.conv_size, norm_eps=self.norm_eps, chunk_size=self.chunk_size)

  @property
  def value_dim(self) -> int:
    return self.head_dim * self.expand_v


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Softmax attention with RoPE: full causal (`window_size=None`) or sliding window (§3.1).

  `window_size` counts keys including the current one (G1): 1024 means keys t-1023..t.
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  window_size: int | None = None
  rope_theta: float = 10_000.0
  implementation: str | None = None

  def __post_init__(self):
    _positive("attention", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
              head_dim=self.head_dim, rope_theta=self.rope_theta)
    _require(self.num_heads % self.num_kv_heads == 0, "attention.num_kv_heads",
             f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
    _require(self.head_dim % 2 == 0, "attention.head_dim", "RoPE needs an even head_dim")
    if self.window_size is not None:
      _positive("attention", window_size=self.window_size)


@dataclasses.dataclass(frozen=True)
class LTEConfig:
  """Learnable token eviction attention (§4).

  `window` is the paper's w: a query sees the w+1 most recent keys including itself (G1), plus
  sinks and every out-of-window key the router keeps. `cap` (b) bounds the kept out-of-window keys
  per KV head at inference, sinks included (G11). The router is a per-KV-head stack of grouped
  1-D convolutions ('same' zero padding); kernel size 1 everywhere gives the LTE-MLP router (§7.3).
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  window: int = 768
  cap: int = 512
  num_sinks: int = 4
  router_kernel_sizes: tuple[int, ...] = (3, 3, 3)
  router_dilations: tuple[int, ...] = (2, 2, 2)
  router_dropout: float = 0.1
  rope_theta: float = 10_000.0
  implementation: str | None = None

  def __post_init__(self):
    _positive("lte", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
              head_dim=self.head_dim, window=self.window, cap=self.cap,
              rope_theta=self.rope_theta)
    _require(self.num_heads % self.num_kv_heads == 0, "lte.num_kv_heads",
             f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
    _require(self.head_dim % 2 == 0, "lte.head_dim", "RoPE needs an even head_dim")
    _require(self.num_sinks >= 0, "lte.num_sinks", f"must be >= 0, got {self.num_sinks}")
    _require(self.num_sinks <= self.cap, "lte.num_sinks",
             f"{self.num_sinks} sinks do not fit the cap of {self.cap} kept tokens (sinks count"
             " toward the cap)")
    _require(len(self.router_kernel_sizes) >= 1, "lte.router_kernel_sizes", "needs >= 1 layer")
    _require(len(self.router_kernel_sizes) == len(self.router_dilations), "lte.router_dilations",
             f"has {len(self.router_dilations)} entries, router_kernel_sizes has"
             f" {len(self.router_kernel_sizes)}")
    for k in self.router_kernel_sizes:
      _require(k > 0 and k % 2 == 1, "lte.router_kernel_sizes",
               f"'same' padding needs odd positive kernel sizes, got {self.router_kernel_sizes}")
    for d in self.router_dilations:
      _require(d > 0, "lte.router_dilations", f"must be positive, got {self.router_dilations}")
    _require(2 * self.head_dim >> len(self.router_kernel_sizes) >= 1, "lte.router_kernel_sizes",
             f"{len(self.router_kernel_sizes)} halving layers leave no channel of"
             f" 2*head_dim={2 * self.head_dim}")
    _require(0.0 <= self.router_dropout < 1.0, "lte.router_dropout",
             f"must be in [0, 1), got {self.router_dropout}")
    # A key leaves the window at distance window+1; its score reads `router_margin` tokens to its
    # right, which must all be in the past of every query that can see it out of window.
    _require(self.window > self.router_margin, "lte.window",
             f"{self.window} is not larger than the router's half receptive field"
             f" {self.router_margin}: scores of out-of-window keys would read future tokens")
    # The decoder scores a token over its +-margin context once all of it is in the ring (§5.4).
    _require(self.window + 1 > 2 * self.router_margin, "lte.window",
             f"window+1={self.window + 1} must exceed twice the router margin"
             f" ({2 * self.router_margin}): the ring must hold a token's whole router context")

  @property
  def router_receptive_field(self) -> int:
    return 1 + sum((k - 1) * d for k, d in zip(self.router_kernel_sizes, self.router_dilations))

  @property
  def router_margin(self) -> int:
    """Tokens the router reads on each side of a token (6 for the paper's k3 d2 x3 CNN)."""
    return self.router_receptive_field // 2

  @property
  def window_keys(self) -> int:
    """W = w + 1: keys in the sliding window including the current token."""
    return self.window + 1


@dataclasses.dataclass(frozen=True)
class NSAConfig:
  """Native sparse attention as in the authors' FLA fork (§6): mean-pooled compression."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int = 64
  block_count: int = 16
  window_size: int = 512  # keys including the current one (G1)
  rope_theta: float = 10_000.0
  implementation: str | None = None

  def __post_init__(self):
    _positive("nsa", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
              head_dim=self.head_dim, block_size=self.block_size, block_count=self.block_count,
              window_size=self.window_size, rope_theta=self.rope_theta)
    _require(self.num_heads % self.num_kv_heads == 0, "nsa.num_kv_heads",
             f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
    _require(self.head_dim % 2 == 0, "nsa.head_dim", "RoPE needs an even head_dim")
    # Blocks 0, previous and current are forced into the selection.
    _require(self.block_count >= 3, "nsa.block_count",
             f"must be >= 3 (first, previous and current blocks are forced), got {self.block_count}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM: `num_layers` pre-norm blocks whose mixers follow `layer_pattern`."""
  name: str
  vocab_size: int
  hidden_size: int
  num_layers: int
  intermediate_size: int
  layer_pattern: tuple[str, ...]
  gdn: GDNConfig | None = None
  attention: AttentionConfig | None = None
  lte: LTEConfig | None = None
  nsa: NSAConfig | None = None
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  init_std: float = 0.006
  # Hybrid family (laLTE, laNSA, pure LTE, LTE-MLP): o_proj/down_proj re-initialised with
  # kaiming-uniform / sqrt(2 * num_layers) (§1.4, G17).
  rescale_prenorm_residual: bool = False
  dtype: str = "float32"  # activations and matmuls; parameters float32 (bfloat16 matrices
  # for serving: lalte_jax.inference.param_dtype)
  scan_layers: bool = True  # scan over the repeated group of layers (compile time flat in depth)
  # Recompute in the backward pass: "block" each layer group, "dots" the group but its matmuls'
  # outputs, "attention" the group but the attention kernels' outputs and the LTE router's conv
  # pre-activations, "dots_attention" the group but both (model.REMAT_CHECKPOINT_POLICIES).
  remat: RematPolicy = "none"
  max_position_embeddings: int = 4096

  def __post_init__(self):
    _positive("model", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
              num_layers=self.num_layers, intermediate_size=self.intermediate_size,
              norm_eps=self.norm_eps, init_std=self.init_std,
              max_position_embeddings=self.max_position_embeddings)
    _require(isinstance(self.layer_pattern, tuple), "model.layer_pattern", "must be a tuple")
    _require(len(self.layer_pattern) == self.num_layers, "model.layer_pattern",
             f"has {len(self.layer_pattern)} entries for num_layers={self.num_layers}")
    for kind in self.layer_pattern:
      _require(kind in MIXER_KINDS, "model.layer_pattern",
               f"unknown mixer {kind!r}; expected one of {MIXER_KINDS}")
    for kind in MIXER_KINDS:
      sub = getattr(self, kind)
      used = kind in self.layer_pattern
      _require(not used or sub is not None, f"model.{kind}",
               f"layer_pattern uses {kind!r} layers but model.{kind} is None")
      _require(used or sub is None, f"model.{kind}",
               f"is set but layer_pattern has no {kind!r} layer")
    if self.gdn is not None:
      _require(self.gdn.num_heads * self.gdn.head_dim == self.hidden_size, "gdn.head_dim",
               f"num_heads*head_dim={self.gdn.num_heads * self.gdn.head_dim} must equal"
               f" hidden_size={self.hidden_size} (key_dim = hidden, expand_k = 1)")
    _require(self.dtype in ("float32", "bfloat16", "float16"), "model.dtype",
             f"must be float32, bfloat16 or float16, got {self.dtype!r}")
    _require(self.remat in REMAT_POLICIES, "model.remat",
             f"must be one of {REMAT_POLICIES}, got {self.remat!r}")

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def pattern_period(self) -> int:
    """Length of the shortest group of layers whose repetition gives `layer_pattern`."""
    n = self.num_layers
    for p in range(1, n + 1):
      if n % p == 0 and self.layer_pattern == self.layer_pattern[:p] * (n // p):
        return p
    return n

  @property
  def num_lte_layers(self) -> int:
    return self.layer_pattern.count("lte")

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)


def get_model_config(name: str) -> ModelConfig:
  """The preset `"<variant>-<size>"` (see `presets.py`)."""
  from lalte_jax import presets  # presets import this module
  return presets.get_model_config(name)
