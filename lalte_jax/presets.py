"""The paper's model variants at its two sizes (§1.5) and tiny sizes for CPU work.

Names are `"<variant>-<size>"`. Tiny presets keep every structural feature of the real ones (GQA
groups, sinks, the LTE router with its 6-token margin, NSA's three branches, the 1:1 hybrid
pattern) at sizes where T=256 exercises every out-of-window path on a CPU in seconds.

Readings of the spec's (?) items, chosen here:
- pure_lte: all 24 layers LTE with laLTE's hyper-parameters, hybrid-family init (§7.4).
- lte_mlp: laLTE with a router of kernel size 1 and a single hidden layer (128 -> 64 -> SiLU ->
  1 per KV head), the literal "2-layer MLP with no context access" (§7.3); margin 0.
"""

from __future__ import annotations

import dataclasses

from lalte_jax.config import (AttentionConfig, GDNConfig, LTEConfig, ModelConfig, NSAConfig)

VARIANTS = ("gdn", "gdn_swa", "lalte", "lansa", "gdn_attn", "nsa", "transformer", "pure_lte",
            "lte_mlp")
SIZES = ("tiny", "0.4b", "1.4b")
# Variants that the paper reports only at 0.4B.
SMALL_ONLY = ("pure_lte", "lte_mlp")
# model_type hybrid_gated_deltanet in the reference: rescaled residual init (G17).
HYBRID_FAMILY = ("lalte", "lansa", "pure_lte", "lte_mlp")


@dataclasses.dataclass(frozen=True)
class _Size:
  vocab_size: int
  hidden_size: int
  num_layers: int
  intermediate_size: int
  tie_embeddings: bool
  gdn_heads: int
  gdn_head_dim: int
  attn_heads: int
  attn_kv_heads: int
  head_dim: int
  swa_window: int
  lte_window: int
  lte_cap: int
  nsa_heads: int
  nsa_kv_heads: int
  nsa_block_size: int
  nsa_block_count: int
  nsa_window: int


def intermediate_size(hidden_size: int, hidden_ratio: int = 4) -> int:
  """FLA's GatedMLP width: 256 * ceil(floor(hidden * ratio * 2/3) / 256)."""
  return 256 * -(-(hidden_size * hidden_ratio * 2 // 3) // 256)


_SIZES = {
    "0.4b": _Size(vocab_size=32000, hidden_size=1024, num_layers=24,
                  intermediate_size=intermediate_size(1024), tie_embeddings=True,
                  gdn_heads=8, gdn_head_dim=128, attn_heads=16, attn_kv_heads=16, head_dim=64,
                  swa_window=1024, lte_window=768, lte_cap=512, nsa_heads=32, nsa_kv_heads=2,
                  nsa_block_size=64, nsa_block_count=16, nsa_window=512),
    "1.4b": _Size(vocab_size=32000, hidden_size=2048, num_layers=24,
                  intermediate_size=intermediate_size(2048), tie_embeddings=False,
                  gdn_heads=8, gdn_head_dim=256, attn_heads=32, attn_kv_heads=8, head_dim=64,
                  swa_window=1024, lte_window=768, lte_cap=512, nsa_heads=32, nsa_kv_heads=2,
                  nsa_block_size=64, nsa_block_count=16, nsa_window=512),
    # 4 layers = 2 (GDN, mixer) pairs; GQA group 2 everywhere; windows far below T=256.
    "tiny": _Size(vocab_size=256, hidden_size=64, num_layers=4, intermediate_size=192,
                  tie_embeddings=True, gdn_heads=2, gdn_head_dim=32, attn_heads=4,
                  attn_kv_heads=2, head_dim=16, swa_window=48, lte_window=24, lte_cap=16,
                  nsa_heads=4, nsa_kv_heads=2, nsa_block_size=16, nsa_block_count=4,
                  nsa_window=32),
}


def _pattern(even: str, odd: str, num_layers: int) -> tuple[str, ...]:
  """1:1 interleaving (§1.2): even layers `even`, odd layers `odd` (layer 0 is even)."""
  return tuple(odd if i % 2 else even for i in range(num_layers))


def build_preset(variant: str, size: str) -> ModelConfig:
  s = _SIZES[size]
  gdn = GDNConfig(num_heads=s.gdn_heads, head_dim=s.gdn_head_dim)
  full = AttentionConfig(num_heads=s.attn_heads, num_kv_heads=s.attn_kv_heads, head_dim=s.head_dim)
  swa = dataclasses.replace(full, window_size=s.swa_window)
  lte = LTEConfig(num_heads=s.attn_heads, num_kv_heads=s.attn_kv_heads, head_dim=s.head_dim,
                  window=s.lte_window, cap=s.lte_cap)
  lte_mlp = dataclasses.replace(lte, router_kernel_sizes=(1,), router_dilations=(1,))
  nsa = NSAConfig(num_heads=s.nsa_heads, num_kv_heads=s.nsa_kv_heads, head_dim=s.head_dim,
                  block_size=s.nsa_block_size, block_count=s.nsa_block_count,
                  window_size=s.nsa_window)
  n = s.num_layers
  mixers = {
      "gdn": dict(layer_pattern=_pattern("gdn", "gdn", n), gdn=gdn),
      "gdn_swa": dict(layer_pattern=_pattern("gdn", "attention", n), gdn=gdn, attention=swa),
      "gdn_attn": dict(layer_pattern=_pattern("gdn", "attention", n), gdn=gdn, attention=full),
      "lalte": dict(layer_pattern=_pattern("gdn", "lte", n), gdn=gdn, lte=lte),
      "lte_mlp": dict(layer_pattern=_pattern("gdn", "lte", n), gdn=gdn, lte=lte_mlp),
      "lansa": dict(layer_pattern=_pattern("gdn", "nsa", n), gdn=gdn, nsa=nsa),
      "nsa": dict(layer_pattern=_pattern("nsa", "nsa", n), nsa=nsa),
      "transformer": dict(layer_pattern=_pattern("attention", "attention", n), attention=full),
      "pure_lte": dict(layer_pattern=_pattern("lte", "lte", n), lte=lte),
  }[variant]
  return ModelConfig(
      name=f"{variant}-{size}", vocab_size=s.vocab_size, hidden_size=s.hidden_size,
      num_layers=n, intermediate_size=s.intermediate_size, tie_embeddings=s.tie_embeddings,
      rescale_prenorm_residual=variant in HYBRID_FAMILY, **mixers)


def preset_names() -> tuple[str, ...]:
  return tuple(f"{v}-{s}" for v in VARIANTS for s in SIZES
               if not (v in SMALL_ONLY and s == "1.4b"))


def get_model_config(name: str) -> ModelConfig:
  """Returns the frozen preset `"<variant>-<size>"`, e.g. `"lalte-0.4b"` or `"gdn_swa-tiny"`."""
  if not isinstance(name, str) or name not in preset_names():
    raise ValueError(f"model preset name: unknown {name!r}; expected '<variant>-<size>' with"
                     f" variant in {VARIANTS} and size in {SIZES} ({SMALL_ONLY} exist only"
                     " at tiny and 0.4b)")
  variant, size = name.rsplit("-", 1)
  return build_preset(variant, size)
