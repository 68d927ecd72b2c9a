"""`config.json` of the authors' checkpoints <-> `ModelConfig`, both directions.

The four model types of the authors' code (and of FLA, for the first and third):

  gated_deltanet         GDN layers; an `attn` block {layers, num_heads, num_kv_heads,
                         window_size, rope_theta, qkv_bias} turns the listed layers into full
                         (window_size null) or sliding-window attention: GDN, GDN+Attn, GDN+SWA
  hybrid_gated_deltanet  the same with `attn.attn_type` "lte" (laLTE, pure LTE, LTE-MLP: window,
                         buffer (cap), sinks, router conv sizes / dilations / dropout, routing and
                         lambda options), "nsa" (laNSA) or "attn"
  transformer            full or sliding-window attention in every layer (Transformer++)
  nsa                    NSA in every layer

Absent fields take the defaults of the authors' config classes. Every present field is either
mapped, checked against the value our model implements (any other value is refused, naming the
field), or declared harmless: transformers' bookkeeping, and options that change only kernels,
fusion or the training loss. Fields our ModelConfig does not hold but an exported checkpoint must
carry again (token ids, the LTE controller's training settings) come back as `carried`.

Attention and LTE layers derive their head dim as hidden_size // num_heads (the authors' layers
do); NSA names it. The hybrid model type implies the rescaled residual init (G17).
"""

from __future__ import annotations

import json
import math
import numbers

from lalte_jax.config import AttentionConfig, GDNConfig, LTEConfig, ModelConfig, NSAConfig
from lalte_jax.presets import intermediate_size as default_intermediate_size
from lalte_jax.train.lte_controller import ControllerConfig

ARCHITECTURES = {"gated_deltanet": "GatedDeltaNetForCausalLM",
                 "hybrid_gated_deltanet": "HybridGatedDeltaNetForCausalLM",
                 "transformer": "TransformerForCausalLM", "nsa": "NSAForCausalLM"}
# Keys any transformers config may hold; none of them changes the network.
_HF_BOOKKEEPING = frozenset({
    "architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
    "name_or_path", "_commit_hash", "_attn_implementation_autoset", "attn_implementation",
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "chunk_size_feed_forward", "is_decoder", "cross_attention_hidden_size",
    "tie_encoder_decoder", "finetuning_task", "id2label", "label2id", "num_labels",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "use_cache"})
# Bookkeeping keys whose non-default values would describe another kind of model.
_MUST_BE_FALSY = ("is_encoder_decoder", "add_cross_attention", "pruned_heads")
# Kernel choice, fused kernels and training-loss options: any value gives the same outputs.
_NUMERICS_ONLY = frozenset({"fuse_norm", "fuse_swiglu", "fuse_cross_entropy",
                            "fuse_linear_cross_entropy", "use_l2warp"})
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The LTE sparsity controller's settings (§4.6-4.7): training only.
LTE_TRAINING_FIELDS = ("l1_lambda_init", "l1_lambda_min", "l1_lambda_max", "l1_alpha",
                       "l1_alpha_neg", "l1_warmup_steps", "l1_lambda_initial_steps",
                       "l1_lambda_update_steps", "l1_lambda_shared", "l1_lambda_tolerate",
                       "routing_freeze_steps")

_COMMON_DEFAULTS = dict(vocab_size=32000, hidden_ratio=4, intermediate_size=None,
                        hidden_act="swish", norm_eps=1e-6, tie_word_embeddings=False,
                        hidden_size=2048, max_position_embeddings=2048, bos_token_id=1,
                        eos_token_id=2, pad_token_id=None, attnres_block_size=None)
_GDN_DEFAULTS = dict(attn_mode="chunk", expand_v=2, use_gate=True, use_short_conv=True,
                     conv_size=4, head_dim=256, num_heads=6, num_v_heads=None,
                     allow_neg_eigval=False, output_gate_activation="swish",
                     num_hidden_layers=21, attn=None)
_ATTENTION_DEFAULTS = dict(qkv_bias=False, qk_norm=False, window_size=None, rope_theta=10000.0,
                           elementwise_affine=True, num_hidden_layers=24)
_DEFAULTS = {
    "gated_deltanet": {**_COMMON_DEFAULTS, **_GDN_DEFAULTS, "initializer_range": 0.02},
    "hybrid_gated_deltanet": {**_COMMON_DEFAULTS, **_GDN_DEFAULTS, "initializer_range": 0.006},
    "transformer": {**_COMMON_DEFAULTS, **_ATTENTION_DEFAULTS, "initializer_range": 0.02,
                    "num_heads": 32, "num_kv_heads": None},
    "nsa": {**_COMMON_DEFAULTS, **_ATTENTION_DEFAULTS, "initializer_range": 0.02, "num_heads": 64,
            "num_kv_heads": 4, "head_dim": 32, "block_size": 64, "block_counts": 16,
            "window_size": 512},
}
_ATTN_TYPES = {"attn": "attention", "lte": "lte", "nsa": "nsa"}


class _Fields:
  """The keys of one JSON object: each must be read (`get` and friends) or declared harmless."""

  def __init__(self, data: dict, where: str, defaults: dict):
    if not isinstance(data, dict):
      raise ValueError(f"{where}: expected a JSON object, got {data!r}")
    self.data, self.where, self.defaults = data, where, defaults
    self.used: set[str] = set()

  def get(self, key: str):
    self.used.add(key)
    if key in self.data:
      return self.data[key]
    if key in self.defaults:
      return self.defaults[key]
    raise ValueError(f"{self.where}: field {key!r} is missing")

  def integer(self, key: str, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    value = self.get(key)
    if value is None and allow_none:
      return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != int(value) \
        or value < minimum:
      raise ValueError(f"{self.where}: {key} must be an integer >= {minimum}, got {value!r}")
    return int(value)

  def number(self, key: str) -> float:
    value = self.get(key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
      raise ValueError(f"{self.where}: {key} must be a finite number, got {value!r}")
    return float(value)

  def boolean(self, key: str) -> bool:
    value = self.get(key)
    if not isinstance(value, bool):
      raise ValueError(f"{self.where}: {key} must be true or false, got {value!r}")
    return value

  def require(self, key: str, allowed: tuple, why: str):
    """The value, which must be one of `allowed` (compared with its type: True is not 1)."""
    value = self.get(key)
    if not any(type(value) is type(a) and value == a for a in allowed):  # noqa: E721
      raise ValueError(f"{self.where}: {key}={json.dumps(value, default=repr)} is not supported"
                       f" ({why})")
    return value

  def int_list(self, key: str) -> tuple[int, ...]:
    value = self.get(key)
    if not isinstance(value, (list, tuple)) or not value or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value):
      raise ValueError(f"{self.where}: {key} must be a non-empty list of integers, got {value!r}")
    return tuple(value)

  def harmless(self, keys) -> None:
    self.used.update(k for k in keys if k in self.data)

  def finish(self) -> None:
    unknown = sorted(set(self.data) - self.used)
    if unknown:
      raise ValueError(f"{self.where}: unknown field {unknown[0]!r}"
                       + (f" (and {unknown[1:]})" if unknown[1:] else "")
                       + "; no option of ours corresponds to it")


def _head_dim(hidden: int, num_heads: int, where: str) -> int:
  if hidden % num_heads:
    raise ValueError(f"{where}: num_heads={num_heads} does not divide hidden_size={hidden} (the"
                     " layer's head dim is hidden_size // num_heads)")
  return hidden // num_heads


def _attention_fields(f: _Fields, hidden: int) -> dict:
  """num_heads, num_kv_heads, rope_theta of an attention-type layer; checks qkv_bias."""
  num_heads = f.integer("num_heads")
  num_kv_heads = f.integer("num_kv_heads", allow_none=True) or num_heads
  f.require("qkv_bias", (False,), "our projections have no bias")
  return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, rope_theta=f.number("rope_theta"))


def _layers(f: _Fields, num_layers: int) -> tuple[int, ...]:
  layers = f.int_list("layers")
  bad = [i for i in layers if not 0 <= i < num_layers]
  if bad or len(set(layers)) != len(layers):
    raise ValueError(f"{f.where}: layers {list(layers)} must be distinct indices in"
                     f" [0, {num_layers})")
  return layers


def _lte_config(f: _Fields, hidden: int, carried: dict) -> LTEConfig:
  attention = _attention_fields(f, hidden)
  f.require("routing_method", ("sigmoid",), "our router scores are sigmoid(x) - 0.5 (G27)")
  f.require("routing_shared", ("head",), "our router has its own weights per KV head")
  f.require("routing_grad", (True,), "our router's input is not detached")
  lte = LTEConfig(**attention, head_dim=_head_dim(hidden, attention["num_heads"], f.where),
                  window=f.integer("window_size"), cap=f.integer("buffer_size"),
                  num_sinks=f.integer("sink_size", minimum=0),
                  router_kernel_sizes=f.int_list("conv_size"),
                  router_dilations=f.int_list("conv_dilation"),
                  router_dropout=f.number("dropout_prob"))
  if "receptive_margin" in f.data:  # written into the config by the authors' forward pass
    f.require("receptive_margin", (lte.router_margin + 1,),
              f"the router's receptive field gives {lte.router_margin + 1}")
  if "l1_lambda_shared" in f.data:  # shapes the controller buffer `model.l1_lambda`
    f.require("l1_lambda_shared", ("all", "layer", "head"), "the authors' lambda sharing modes")
  carried["lte"] = {key: f.get(key) for key in LTE_TRAINING_FIELDS if key in f.data}
  f.harmless(LTE_TRAINING_FIELDS)
  return lte


def _nsa_config(f: _Fields, hidden: int) -> NSAConfig:
  return NSAConfig(**_attention_fields(f, hidden), head_dim=f.integer("head_dim"),
                   block_size=f.integer("block_size"), block_count=f.integer("block_counts"),
                   window_size=f.integer("window_size"))


def _attn_block(model_type: str, attn, hidden: int, num_layers: int, carried: dict):
  """(mixer kind, its config, layer indices) of the `attn` block of a GDN-family config."""
  where = "config.json attn"
  if isinstance(attn, list):
    if len(attn) != 1:
      raise ValueError(f"{where}: {len(attn)} attention specifications; our model has one"
                       " attention setting for all its attention layers")
    attn = attn[0]
  f = _Fields(attn, where, {"num_kv_heads": None, "qkv_bias": False, "window_size": None,
                            "rope_theta": 10000.0, "attn_type": "attn"})
  layers = _layers(f, num_layers)
  attn_type = "attn"
  if model_type == "hybrid_gated_deltanet":
    attn_type = f.require("attn_type", tuple(_ATTN_TYPES), "the authors' hybrid layer types")
  kind = _ATTN_TYPES[attn_type]
  if kind == "lte":
    sub = _lte_config(f, hidden, carried)
  elif kind == "nsa":
    sub = _nsa_config(f, hidden)
  else:
    attention = _attention_fields(f, hidden)
    sub = AttentionConfig(**attention, head_dim=_head_dim(hidden, attention["num_heads"], where),
                          window_size=f.integer("window_size", allow_none=True))
  f.finish()
  return kind, sub, layers


def _gdn_config(f: _Fields, hidden: int) -> GDNConfig:
  f.require("attn_mode", ("chunk", "fused_recurrent"), "a kernel choice of the authors' code")
  f.require("use_gate", (True,), "our GDN layer always has the output gate")
  f.require("use_short_conv", (True,), "our GDN layer always has the short convolutions")
  f.require("allow_neg_eigval", (False,), "our beta is sigmoid(b_proj x) in (0, 1)")
  f.require("output_gate_activation", ("swish", "silu"), "our output gate is SiLU")
  num_heads = f.integer("num_heads")
  num_v_heads = f.integer("num_v_heads", allow_none=True)
  if num_v_heads not in (None, num_heads):
    raise ValueError(f"{f.where}: num_v_heads={num_v_heads} is not supported (our GDN layer has"
                     f" as many value heads as heads, {num_heads})")
  expand_v = f.number("expand_v")
  if expand_v != int(expand_v) or expand_v < 1:
    raise ValueError(f"{f.where}: expand_v={expand_v} is not supported (a positive integer)")
  return GDNConfig(num_heads=num_heads, head_dim=f.integer("head_dim"), expand_v=int(expand_v),
                   conv_size=f.integer("conv_size"), norm_eps=f.number("norm_eps"))


def model_config_from_hf(hf: dict, *, name: str, dtype: str = "float32"
                         ) -> tuple[ModelConfig, dict]:
  """The ModelConfig of an authors' `config.json` and the carried fields (token ids, LTE
  training settings). Raises ValueError naming an unknown, unsupported or malformed field."""
  if not isinstance(hf, dict):
    raise ValueError(f"config.json: expected a JSON object, got {type(hf).__name__}")
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported; expected one of"
                     f" {sorted(ARCHITECTURES)}")
  try:
    return _model_config_from_hf(hf, model_type, name, dtype)
  except ValueError as error:
    message = str(error)
    raise ValueError(message if message.startswith("config.json") else
                     f"config.json: {message}") from None


def _model_config_from_hf(hf: dict, model_type: str, name: str, dtype: str
                          ) -> tuple[ModelConfig, dict]:
  f = _Fields(hf, "config.json", _DEFAULTS[model_type])
  f.get("model_type")
  f.harmless(_HF_BOOKKEEPING | _NUMERICS_ONLY)
  for key in _MUST_BE_FALSY:
    if key in hf and f.get(key):
      raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (a decoder-only LM)")
  architectures = hf.get("architectures")
  if architectures is not None and architectures != [ARCHITECTURES[model_type]]:
    raise ValueError(f"config.json: architectures {architectures} is not supported (expected"
                     f" [{ARCHITECTURES[model_type]!r}]: the causal LM with its head)")
  f.require("attnres_block_size", (None,), "our blocks have plain residual connections")
  carried = {key: f.get(key) for key in TOKEN_IDS}
  hidden = f.integer("hidden_size")
  num_layers = f.integer("num_hidden_layers")
  f.require("hidden_act", ("swish", "silu"), "our MLP is SwiGLU")
  intermediate = f.integer("intermediate_size", allow_none=True)
  ratio = f.integer("hidden_ratio", allow_none=True) or 4
  subs: dict = {}
  if model_type in ("transformer", "nsa"):
    f.require("elementwise_affine", (True,), "our RMSNorms have a weight")
    if model_type == "transformer":
      f.require("qk_norm", (False,), "our attention has no q/k norm")
      attention = _attention_fields(f, hidden)
      subs["attention"] = AttentionConfig(
          **attention, head_dim=_head_dim(hidden, attention["num_heads"], "config.json"),
          window_size=f.integer("window_size", allow_none=True))
      pattern = ("attention",) * num_layers
    else:
      subs["nsa"] = _nsa_config(f, hidden)
      pattern = ("nsa",) * num_layers
  else:
    gdn = _gdn_config(f, hidden)
    pattern = ["gdn"] * num_layers
    attn = f.get("attn")
    if attn is not None:
      kind, subs[kind], layers = _attn_block(model_type, attn, hidden, num_layers, carried)
      for layer in layers:
        pattern[layer] = kind
    pattern = tuple(pattern)
    if "gdn" in pattern:
      subs["gdn"] = gdn
  config = ModelConfig(
      name=name, vocab_size=f.integer("vocab_size"), hidden_size=hidden, num_layers=num_layers,
      intermediate_size=intermediate or default_intermediate_size(hidden, ratio),
      layer_pattern=pattern, tie_embeddings=f.boolean("tie_word_embeddings"),
      norm_eps=f.number("norm_eps"), init_std=f.number("initializer_range"),
      rescale_prenorm_residual=model_type == "hybrid_gated_deltanet", dtype=dtype,
      max_position_embeddings=f.integer("max_position_embeddings"), **subs)
  f.finish()
  return config, carried


def model_type_of(config: ModelConfig) -> str:
  """The authors' model type that holds `config`'s layer pattern (ValueError if none does)."""
  kinds = frozenset(config.layer_pattern)
  by_kinds = {frozenset({"gdn"}): "gated_deltanet",
              frozenset({"gdn", "attention"}): "gated_deltanet",
              frozenset({"attention"}): "transformer", frozenset({"nsa"}): "nsa",
              frozenset({"gdn", "lte"}): "hybrid_gated_deltanet",
              frozenset({"lte"}): "hybrid_gated_deltanet",
              frozenset({"gdn", "nsa"}): "hybrid_gated_deltanet"}
  if kinds not in by_kinds:
    raise ValueError(f"model.layer_pattern: the mixers {sorted(kinds)} together have no model"
                     " type in the authors' code")
  return by_kinds[kinds]


def _derived_head_dim(sub, hidden: int, field: str) -> None:
  if sub.head_dim * sub.num_heads != hidden:
    raise ValueError(f"{field}.head_dim: {sub.head_dim} is not hidden_size // num_heads ="
                     f" {hidden // sub.num_heads}, which the authors' layer derives")


def lte_training_defaults(lte: LTEConfig) -> dict:
  """The controller settings our trainer uses (§4.6), in the authors' field names."""
  c = ControllerConfig(cap=lte.cap)
  return dict(l1_lambda_init=c.lambda_init, l1_lambda_min=c.lambda_min,
              l1_lambda_max=c.lambda_max, l1_alpha=c.alpha_up, l1_alpha_neg=c.alpha_down,
              l1_warmup_steps=0, l1_lambda_initial_steps=0,
              l1_lambda_update_steps=c.update_every, l1_lambda_shared="head",
              l1_lambda_tolerate=[c.tolerance_low, c.tolerance_high], routing_freeze_steps=0)


def hf_config_from_model(config: ModelConfig, *, torch_dtype: str = "float32",
                         carried: dict | None = None) -> dict:
  """The authors' `config.json` for `config`. `carried` (from `model_config_from_hf`) restores
  token ids and LTE training settings; absent, the defaults (BOS 1, EOS 2, our controller's
  settings) are written. Raises ValueError naming what the authors' code cannot express."""
  carried = carried or {}
  model_type = model_type_of(config)
  hidden = config.hidden_size
  hf = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": hidden,
        "num_hidden_layers": config.num_layers, "intermediate_size": config.intermediate_size,
        "hidden_ratio": 4, "hidden_act": "swish", "norm_eps": config.norm_eps,
        "initializer_range": config.init_std,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_embeddings, "fuse_norm": True, "fuse_swiglu": True,
        "fuse_cross_entropy": True, "use_cache": True, "torch_dtype": torch_dtype}
  hf.update({key: carried.get(key, _COMMON_DEFAULTS[key]) for key in TOKEN_IDS})
  if config.gdn is not None:
    gdn = config.gdn
    if gdn.norm_eps != config.norm_eps:
      raise ValueError(f"gdn.norm_eps: {gdn.norm_eps} differs from model.norm_eps"
                       f" {config.norm_eps}; the authors' config has one norm_eps")
    hf.update(attn_mode="chunk", expand_v=gdn.expand_v, use_gate=True, use_short_conv=True,
              conv_size=gdn.conv_size, head_dim=gdn.head_dim, num_heads=gdn.num_heads)
  if model_type == "transformer":
    attn = config.attention
    _derived_head_dim(attn, hidden, "attention")
    hf.update(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, qkv_bias=False,
              qk_norm=False, window_size=attn.window_size, rope_theta=attn.rope_theta,
              elementwise_affine=True)
  elif model_type == "nsa":
    nsa = config.nsa
    hf.update(num_heads=nsa.num_heads, num_kv_heads=nsa.num_kv_heads, head_dim=nsa.head_dim,
              qkv_bias=False, block_size=nsa.block_size, block_counts=nsa.block_count,
              window_size=nsa.window_size, rope_theta=nsa.rope_theta, elementwise_affine=True)
  else:
    kind = next((k for k in ("attention", "lte", "nsa") if k in config.layer_pattern), None)
    if kind is not None:
      hf["attn"] = _attn_block_of(config, kind, carried)
  return hf


def _attn_block_of(config: ModelConfig, kind: str, carried: dict) -> dict:
  sub = getattr(config, kind)
  block = {"layers": [i for i, k in enumerate(config.layer_pattern) if k == kind],
           "num_heads": sub.num_heads, "num_kv_heads": sub.num_kv_heads, "qkv_bias": False,
           "rope_theta": sub.rope_theta}
  if kind == "attention":
    _derived_head_dim(sub, config.hidden_size, "attention")
    block["window_size"] = sub.window_size
  elif kind == "nsa":
    block.update(attn_type="nsa", head_dim=sub.head_dim, block_size=sub.block_size,
                 block_counts=sub.block_count, window_size=sub.window_size)
  else:
    _derived_head_dim(sub, config.hidden_size, "lte")
    block.update(attn_type="lte", window_size=sub.window, conv_size=list(sub.router_kernel_sizes),
                 conv_dilation=list(sub.router_dilations), dropout_prob=sub.router_dropout,
                 buffer_size=sub.cap, sink_size=sub.num_sinks, routing_method="sigmoid",
                 routing_grad=True, routing_shared="head",
                 receptive_margin=sub.router_margin + 1)
    block.update({**lte_training_defaults(sub), **carried.get("lte", {})})
  return block


def lambda_sharing(hf: dict) -> str:
  """How an LTE config shares its controller's lambda ('all', 'layer' or 'head')."""
  attn = hf.get("attn") or {}
  return attn.get("l1_lambda_shared", "head") if isinstance(attn, dict) else "head"
