"""Hand-built checkpoints in the authors' format import to a model with the source's logits.

The tensors are laid out here by hand from the documented mapping (lalte_jax/convert/weights.py):
names of the authors' modules, PyTorch layouts written out index by index, config.json in the
shape of the shipped configs. Nothing is downloaded.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from lalte_jax.config import get_model_config
from lalte_jax.convert import load_hf
from lalte_jax.inference import checkpoint
from tests.lalte_jax.convert.helpers import random_params, same_params


def grouped_conv_weight(ours):
  """[H, K, Ci, Co] -> Conv2d(groups=H, kernel (1, K)) weight [H*Co, Ci, 1, K]."""
  heads, taps, c_in, c_out = ours.shape
  torch_w = np.zeros((heads * c_out, c_in, 1, taps), np.float32)
  for h in range(heads):
    for o in range(c_out):
      for i in range(c_in):
        for t in range(taps):
          torch_w[h * c_out + o, i, 0, t] = ours[h, t, i, o]
  return torch_w


def authors_tensors(config, params):
  """The state dict the authors' *ForCausalLM would hold for `params` (our pure dict)."""
  out = {"model.embeddings.weight": params["embed"]["embedding"],
         "model.norm.weight": params["final_norm"]["weight"]}
  if not config.tie_embeddings:
    out["lm_head.weight"] = params["lm_head"].T
  period = config.pattern_period
  for layer, kind in enumerate(config.layer_pattern):
    block = jax.tree.map(lambda x, g=layer // period: x[g],
                         params["groups"]["blocks"][layer % period])
    pre, mixer = f"model.layers.{layer}.", block["mixer"]
    out[pre + "attn_norm.weight"] = block["mixer_norm"]["weight"]
    out[pre + "mlp_norm.weight"] = block["mlp_norm"]["weight"]
    for name in ("gate_proj", "up_proj", "down_proj"):
      out[pre + f"mlp.{name}.weight"] = block["mlp"][name]["kernel"].T
    if kind == "gdn":
      for name in ("q", "k", "v", "g", "a", "b", "o"):
        out[pre + f"attn.{name}_proj.weight"] = mixer[f"{name}_proj"]["kernel"].T
      for name in ("q", "k", "v"):  # depthwise Conv1d weight [C, 1, K]
        out[pre + f"attn.{name}_conv1d.weight"] = mixer[f"{name}_conv"]["weight"][:, None, :]
      out[pre + "attn.A_log"] = mixer["A_log"]
      out[pre + "attn.dt_bias"] = mixer["dt_bias"]
      out[pre + "attn.o_norm.weight"] = mixer["o_norm_weight"]
      continue
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
      out[pre + f"attn.{name}.weight"] = mixer["proj"][name]["kernel"].T
    if kind == "lte":
      router, stack = mixer["router"], pre + "attn.router.conv_stack."
      for i in range(len(config.lte.router_kernel_sizes)):
        out[stack + f"convs.{i}.weight"] = grouped_conv_weight(router["conv_weights"][i])
        out[stack + f"convs.{i}.bias"] = router["conv_biases"][i].reshape(-1)  # [H*Co]
      out[stack + "proj.weight"] = router["proj_weight"][:, :, None, None]
      out[stack + "proj.bias"] = router["proj_bias"]
  if "lte" in config.layer_pattern:
    out["model.l1_lambda"] = np.zeros((config.num_lte_layers, config.lte.num_kv_heads), np.float32)
    out["model.num_kept"] = np.zeros((config.num_lte_layers, config.lte.num_kv_heads), np.float32)
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def lte_config_json(config):
  """config.json as the shipped laLTE config, at the tiny preset's sizes."""
  lte, gdn = config.lte, config.gdn
  return {
      "attn_mode": "chunk", "bos_token_id": 1, "conv_size": 4, "eos_token_id": 2,
      "expand_v": 1, "fuse_cross_entropy": True, "head_dim": gdn.head_dim, "hidden_act": "swish",
      "hidden_ratio": 4, "hidden_size": config.hidden_size, "initializer_range": 0.006,
      "intermediate_size": config.intermediate_size, "max_position_embeddings": 4096,
      "model_type": "hybrid_gated_deltanet", "norm_eps": 1e-06, "num_heads": gdn.num_heads,
      "num_hidden_layers": config.num_layers, "tie_word_embeddings": True, "use_cache": True,
      "use_gate": True, "use_short_conv": True, "vocab_size": config.vocab_size,
      "architectures": ["HybridGatedDeltaNetForCausalLM"], "torch_dtype": "float32",
      "transformers_version": "4.53.3",
      "attn": {"attn_type": "lte", "layers": [1, 3], "num_heads": lte.num_heads,
               "num_kv_heads": lte.num_kv_heads, "qkv_bias": False, "window_size": lte.window,
               "rope_theta": 10000.0, "conv_size": [3, 3, 3], "conv_dilation": [2, 2, 2],
               "dropout_prob": 0.1, "buffer_size": lte.cap, "sink_size": 4,
               "routing_method": "sigmoid", "routing_grad": True, "routing_shared": "head",
               "routing_freeze_steps": 0, "l1_lambda_init": 1e-9, "l1_lambda_min": 1e-9,
               "l1_lambda_max": 1.0, "l1_alpha": 1.5, "l1_alpha_neg": 2,
               "l1_warmup_steps": 0, "l1_lambda_initial_steps": 0,
               "l1_lambda_update_steps": 32, "l1_lambda_shared": "head",
               "l1_lambda_tolerate": [0.95, 1.0], "receptive_margin": 7}}


def transformer_config_json(config):
  attn = config.attention
  return {"model_type": "transformer", "hidden_size": config.hidden_size,
          "num_hidden_layers": config.num_layers, "num_heads": attn.num_heads,
          "num_kv_heads": attn.num_kv_heads, "hidden_ratio": 4, "intermediate_size": None,
          "max_position_embeddings": 4096, "norm_eps": 1e-06, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "vocab_size": config.vocab_size,
          "initializer_range": 0.006, "elementwise_affine": True, "fuse_norm": True,
          "fuse_swiglu": True, "fuse_cross_entropy": True, "pad_token_id": 2}


def check_logits(config, params, directory):
  source = checkpoint.model_from_param_dict(config, params)
  loaded = load_hf(directory)
  assert same_params(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(loaded, nnx.Param))),
                     params)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 64)))
  np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(source(tokens)))


@pytest.mark.slow
def test_hand_built_lalte_checkpoint_gives_the_source_logits(tmp_path):
  config = get_model_config("lalte-tiny")
  params = random_params(config, seed=3)
  save_file(authors_tensors(config, params), str(tmp_path / "model.safetensors"),
            metadata={"format": "pt"})
  (tmp_path / "config.json").write_text(json.dumps(lte_config_json(config)))
  check_logits(config, params, tmp_path)


def test_hand_built_sharded_untied_transformer_gives_the_source_logits(tmp_path):
  config = get_model_config("transformer-tiny").replace(tie_embeddings=False,
                                                        intermediate_size=256)
  params = random_params(config, seed=4)
  tensors = authors_tensors(config, params)
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
  for file, keys in shards.items():
    save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
  (tmp_path / "config.json").write_text(json.dumps(transformer_config_json(config)))
  check_logits(config, params, tmp_path)
