"""Presets, parameter counts (§1.5) and config validation."""

import dataclasses

import pytest

from lalte_jax.config import (AttentionConfig, GDNConfig, LTEConfig, ModelConfig, NSAConfig,
                              get_model_config)
from lalte_jax.model import count_parameters
from lalte_jax.presets import preset_names

# Counted from the paper's configs; they agree with the rounded table of §1.5 (to 0.1M), which
# SPEC_TABLE_MILLIONS restates.
EXPECTED_PARAMETERS = {
    "gdn-0.4b": 366_956_928,
    "gdn_swa-0.4b": 354_028_224,
    "gdn_attn-0.4b": 354_028_224,
    "lalte-0.4b": 360_246_144,
    "lansa-0.4b": 358_353_600,
    "nsa-0.4b": 349_750_272,
    "transformer-0.4b": 341_099_520,
    "pure_lte-0.4b": 353_535_360,
    "lte_mlp-0.4b": 355_625_856,
    "gdn-1.4b": 1_466_343_808,
    "gdn_swa-1.4b": 1_339_823_296,
    "gdn_attn-1.4b": 1_339_823_296,
    "lalte-1.4b": 1_342_932_256,
    "lansa-1.4b": 1_323_308_224,
    "nsa-1.4b": 1_180_272_640,
    "transformer-1.4b": 1_213_302_784,
}
SPEC_TABLE_MILLIONS = {  # §1.5's rounded table, as a cross-check of the exact numbers above
    "gdn-0.4b": 367.0, "gdn_swa-0.4b": 354.0, "lalte-0.4b": 360.2, "lansa-0.4b": 358.4,
    "nsa-0.4b": 349.8, "transformer-0.4b": 341.1, "pure_lte-0.4b": 353.5, "gdn-1.4b": 1466.3,
    "gdn_swa-1.4b": 1339.8, "lalte-1.4b": 1342.9, "lansa-1.4b": 1323.3, "nsa-1.4b": 1180.3,
    "transformer-1.4b": 1213.3,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMETERS))
def test_parameter_counts_match_the_paper_configs(name):
  count = count_parameters(get_model_config(name))
  assert count == EXPECTED_PARAMETERS[name]
  if name in SPEC_TABLE_MILLIONS:
    assert round(count / 1e6, 1) == SPEC_TABLE_MILLIONS[name]


def test_lte_mlp_router_is_the_two_linear_map_reading():
  # 128 -> 64 (+bias) -> SiLU -> 1 (+bias) per KV head = 8,321, vs 32,385 for the CNN (§4.1).
  cnn = count_parameters(get_model_config("lalte-0.4b"))
  mlp = count_parameters(get_model_config("lte_mlp-0.4b"))
  assert cnn - mlp == 12 * 16 * (32_385 - 8_321)


def test_every_variant_has_its_presets():
  names = set(preset_names())
  for variant in ("gdn", "gdn_swa", "lalte", "lansa", "gdn_attn", "nsa", "transformer"):
    for size in ("tiny", "0.4b", "1.4b"):
      assert f"{variant}-{size}" in names
  for variant in ("pure_lte", "lte_mlp"):
    assert {f"{variant}-tiny", f"{variant}-0.4b"} <= names


def test_paper_hyperparameters():
  lalte = get_model_config("lalte-0.4b")
  assert lalte.layer_pattern[:2] == ("gdn", "lte") and lalte.layer_pattern[-1] == "lte"
  assert lalte.lte.window_keys == 769 and lalte.lte.cap == 512 and lalte.lte.num_sinks == 4
  assert lalte.lte.router_margin == 6 and lalte.rescale_prenorm_residual
  assert get_model_config("gdn_swa-1.4b").attention.window_size == 1024
  assert not get_model_config("gdn_swa-1.4b").rescale_prenorm_residual
  assert get_model_config("lalte-1.4b").lte.num_kv_heads == 8
  assert get_model_config("lalte-0.4b").intermediate_size == 2816
  assert get_model_config("lalte-1.4b").intermediate_size == 5632
  assert not get_model_config("lalte-1.4b").tie_embeddings


@pytest.mark.parametrize("name", [n for n in preset_names() if n.endswith("-tiny")])
def test_tiny_presets_are_small_enough_for_cpu(name):
  config = get_model_config(name)
  if config.attention is not None and config.attention.window_size is not None:
    assert config.attention.window_size <= 64
  if config.lte is not None:
    assert config.lte.window_keys <= 64 and config.lte.cap <= 32 and config.lte.num_sinks == 4
    assert config.lte.num_heads > config.lte.num_kv_heads  # GQA exercised
  if config.nsa is not None:
    assert config.nsa.block_size <= 16 and config.nsa.num_heads > config.nsa.num_kv_heads


# --- invalid configs: each raises ValueError naming the field -----------------------------------

@pytest.mark.parametrize("make, field", [
    (lambda: get_model_config("lalte-2b"), "model preset name"),
    (lambda: get_model_config("LaLTE-0.4b"), "model preset name"),
    (lambda: get_model_config("pure_lte-1.4b"), "model preset name"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=2, head_dim=16, window=6, cap=8), "lte.window"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=2, head_dim=16, window=10, cap=8), "lte.window"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=3, head_dim=16), "lte.num_kv_heads"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=2, head_dim=16, num_sinks=9, cap=8),
     "lte.num_sinks"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=2, head_dim=16, router_kernel_sizes=(2, 3, 3)),
     "lte.router_kernel_sizes"),
    (lambda: LTEConfig(num_heads=4, num_kv_heads=2, head_dim=16, router_dilations=(2, 2)),
     "lte.router_dilations"),
    (lambda: AttentionConfig(num_heads=6, num_kv_heads=4, head_dim=16), "attention.num_kv_heads"),
    (lambda: AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=0), "attention.head_dim"),
    (lambda: AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, window_size=0),
     "attention.window_size"),
    (lambda: GDNConfig(num_heads=-2, head_dim=32), "gdn.num_heads"),
    (lambda: NSAConfig(num_heads=4, num_kv_heads=2, head_dim=16, block_count=2),
     "nsa.block_count"),
    (lambda: get_model_config("gdn-tiny").replace(hidden_size=96), "gdn.head_dim"),
    (lambda: get_model_config("gdn-tiny").replace(num_layers=5), "model.layer_pattern"),
    (lambda: get_model_config("gdn-tiny").replace(vocab_size=0), "model.vocab_size"),
    (lambda: get_model_config("gdn-tiny").replace(dtype="int8"), "model.dtype"),
    (lambda: get_model_config("gdn-tiny").replace(layer_pattern=("gdn", "lte") * 2),
     "model.lte"),
    (lambda: get_model_config("gdn-tiny").replace(layer_pattern=("gdn", "mamba") * 2),
     "model.layer_pattern"),
    (lambda: get_model_config("lalte-tiny").replace(remat="all"), "model.remat"),
])
def test_invalid_config_raises_value_error_naming_the_field(make, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    make()


def test_configs_are_frozen():
  config = get_model_config("lalte-tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.hidden_size = 3  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.lte.window = 3  # type: ignore[misc]


def test_pattern_period():
  assert get_model_config("lalte-0.4b").pattern_period == 2
  assert get_model_config("gdn-0.4b").pattern_period == 1
  config = ModelConfig(name="x", vocab_size=8, hidden_size=64, num_layers=3, intermediate_size=8,
                       layer_pattern=("gdn", "gdn", "attention"),
                       gdn=GDNConfig(num_heads=2, head_dim=32),
                       attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=32))
  assert config.pattern_period == 3
