"""Export -> import is exact for every tiny variant; the paper's configs map onto our presets."""

import json

import jax
import ml_dtypes
import pytest

from lalte_jax.config import get_model_config
from lalte_jax.convert import hf_config, read_hf, write_hf
from lalte_jax.convert.safetensors_io import INDEX_FILE, SINGLE_FILE
from lalte_jax.presets import VARIANTS
from tests.lalte_jax.convert.helpers import random_params, same_params, write_checkpoint


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_import_round_trip_is_exact(variant, tmp_path):
  config = get_model_config(f"{variant}-tiny")
  params = write_checkpoint(config, tmp_path / "hf")
  assert (tmp_path / "hf" / SINGLE_FILE).is_file()
  loaded_config, loaded, _ = read_hf(tmp_path / "hf")
  assert loaded_config.name == "hf"
  assert loaded_config.replace(name=config.name) == config
  assert same_params(loaded, params)


def test_sharded_round_trip_with_index_and_bfloat16(tmp_path):
  config = get_model_config("lalte-tiny").replace(tie_embeddings=False)
  params = random_params(config)
  write_hf(config, params, tmp_path / "hf", dtype="bfloat16", max_shard_bytes=20_000)
  index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
  shards = set(index["weight_map"].values())
  assert len(shards) > 2 and all((tmp_path / "hf" / s).is_file() for s in shards)
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  _, loaded, _ = read_hf(tmp_path / "hf")
  rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype("float32"), params)
  assert same_params(loaded, rounded)


@pytest.mark.parametrize("size", ["0.4b", "1.4b"])
@pytest.mark.parametrize("variant", ["gdn", "gdn_swa", "gdn_attn", "lalte", "lansa", "nsa",
                                     "transformer"])
def test_exported_paper_configs_read_back_as_the_presets(variant, size):
  preset = get_model_config(f"{variant}-{size}")
  hf = hf_config.hf_config_from_model(preset)
  config, carried = hf_config.model_config_from_hf(json.loads(json.dumps(hf)), name=preset.name)
  assert config == preset
  assert carried["bos_token_id"] == 1 and carried["eos_token_id"] == 2


# Fields that FLA 0.6's config classes write besides ours (their defaults), and transformers 5's.
FLA_06_FIELDS = {"fuse_linear_cross_entropy": False, "use_l2warp": False,
                 "attnres_block_size": None, "dtype": "float32", "transformers_version": "5.17.0"}
FLA_06_GDN_FIELDS = {"num_v_heads": None, "allow_neg_eigval": False,
                     "output_gate_activation": "swish"}


@pytest.mark.parametrize("variant", ["gdn_swa", "transformer", "nsa"])
def test_configs_saved_by_fla_0_6_read_back(variant):
  preset = get_model_config(f"{variant}-tiny")
  hf = {**hf_config.hf_config_from_model(preset), **FLA_06_FIELDS}
  if preset.gdn is not None:
    hf.update(FLA_06_GDN_FIELDS)
  config, _ = hf_config.model_config_from_hf(hf, name=preset.name)
  assert config == preset
