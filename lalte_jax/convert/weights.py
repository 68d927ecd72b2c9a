"""The one mapping between the authors' tensors and our parameter tree, used in both directions.

Tensor names are those of the authors' `*ForCausalLM` modules (and FLA's, which share them);
layer i of the stack is `model.layers.{i}`. Our parameters of layer i live in block
`i % period` of the scanned layer group, at index `i // period` of the leading [num_groups] axis
(`ModelConfig.pattern_period`). Layouts (PyTorch's first, ours second):

  linear        nn.Linear weight [out, in]            <-> kernel [in, out]           (transpose)
  short_conv    depthwise Conv1d weight [C, 1, K]     <-> [C, K]  (tap K-1 = current token)
  router_conv   grouped Conv2d weight [H*Co, Ci, 1, K] (groups = H KV heads, kernel (1, K))
                                                      <-> [H, K, Ci, Co]
  router_bias   grouped Conv2d bias [H*Co]            <-> [H, Co]
  router_proj   grouped 1x1 Conv2d weight [H, C, 1, 1] <-> [H, C]
  same          embeddings [V, D], norm weights, A_log, dt_bias, the GDN o_norm weight [d_v]
                (shared by all heads), the router's projection bias [H]

Output channel h*Co + o of a grouped convolution belongs to KV head h, and its input channels are
head h's [key dims, value dims] (§4.1), which is also the order of our router's input.

Tensors with no parameter of ours: `model.l1_lambda` and `model.num_kept` of LTE models (the
sparsity controller's state, §4.6: read nowhere at inference; written as zeros) and RoPE
`inv_freq` buffers (recomputed from rope_theta). With tied embeddings `lm_head.weight` is usually
absent; if present it must equal `model.embeddings.weight`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from lalte_jax.config import ModelConfig

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one tensor is stored by PyTorch, given our (per-layer) shape."""
  name: str
  hf_shape: Callable[[Shape], Shape]
  to_hf: Callable[[np.ndarray], np.ndarray]
  to_ours: Callable[[np.ndarray, Shape], np.ndarray]


SAME = Layout("same", lambda s: s, lambda x: x, lambda x, s: x)
LINEAR = Layout("linear", lambda s: (s[1], s[0]), lambda x: x.T, lambda x, s: x.T)
SHORT_CONV = Layout("short_conv", lambda s: (s[0], 1, s[1]), lambda x: x[:, None, :],
                    lambda x, s: x[:, 0, :])
ROUTER_CONV = Layout(  # ours [H, K, Ci, Co]
    "router_conv", lambda s: (s[0] * s[3], s[2], 1, s[1]),
    lambda x: x.transpose(0, 3, 2, 1).reshape(x.shape[0] * x.shape[3], x.shape[2], 1, x.shape[1]),
    lambda x, s: x.reshape(s[0], s[3], s[2], s[1]).transpose(0, 3, 2, 1))
ROUTER_BIAS = Layout("router_bias", lambda s: (s[0] * s[1],), lambda x: x.reshape(-1),
                     lambda x, s: x.reshape(s))
ROUTER_PROJ = Layout("router_proj", lambda s: (s[0], s[1], 1, 1), lambda x: x[:, :, None, None],
                     lambda x, s: x[:, :, 0, 0])

_BLOCK_RULES = (
    ("attn_norm.weight", ("mixer_norm", "weight"), SAME),
    ("mlp_norm.weight", ("mlp_norm", "weight"), SAME),
    ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), LINEAR),
    ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), LINEAR),
    ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), LINEAR),
)
_GDN_RULES = tuple(
    (f"attn.{name}.weight", ("mixer", name, "kernel"), LINEAR)
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj", "o_proj")) + tuple(
    (f"attn.{x}_conv1d.weight", ("mixer", f"{x}_conv", "weight"), SHORT_CONV) for x in "qkv") + (
    ("attn.A_log", ("mixer", "A_log"), SAME),
    ("attn.dt_bias", ("mixer", "dt_bias"), SAME),
    ("attn.o_norm.weight", ("mixer", "o_norm_weight"), SAME),
)
_ATTENTION_RULES = tuple((f"attn.{name}.weight", ("mixer", "proj", name, "kernel"), LINEAR)
                         for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
_NSA_RULES = _ATTENTION_RULES + (("attn.g_proj.weight", ("mixer", "g_proj", "kernel"), LINEAR),)


def _lte_rules(config: ModelConfig) -> tuple:
  router = "attn.router.conv_stack"
  conv = tuple(rule for i in range(len(config.lte.router_kernel_sizes)) for rule in (
      (f"{router}.convs.{i}.weight", ("mixer", "router", "conv_weights", i), ROUTER_CONV),
      (f"{router}.convs.{i}.bias", ("mixer", "router", "conv_biases", i), ROUTER_BIAS)))
  return _ATTENTION_RULES + conv + (
      (f"{router}.proj.weight", ("mixer", "router", "proj_weight"), ROUTER_PROJ),
      (f"{router}.proj.bias", ("mixer", "router", "proj_bias"), SAME))


def _mixer_rules(config: ModelConfig, kind: str) -> tuple:
  if kind == "lte":
    return _lte_rules(config)
  return {"gdn": _GDN_RULES, "attention": _ATTENTION_RULES, "nsa": _NSA_RULES}[kind]


EMBEDDINGS = "model.embeddings.weight"
LM_HEAD = "lm_head.weight"
LTE_CONTROLLER_BUFFERS = ("model.l1_lambda", "model.num_kept")
_DERIVED_BUFFER = re.compile(r"model\.layers\.\d+\.attn\.rotary\.inv_freq")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One tensor: its name, where it lives in our pure param dict, the index on the stacked group
  axis (None for unstacked parameters) and its layout."""
  hf_name: str
  path: tuple
  group: int | None
  layout: Layout


def weight_entries(config: ModelConfig) -> list[Entry]:
  """Every tensor of a model with `config`, in the authors' naming."""
  entries = [Entry(EMBEDDINGS, ("embed", "embedding"), None, SAME),
             Entry("model.norm.weight", ("final_norm", "weight"), None, SAME)]
  if not config.tie_embeddings:
    entries.append(Entry(LM_HEAD, ("lm_head",), None, LINEAR))
  period = config.pattern_period
  for layer, kind in enumerate(config.layer_pattern):
    group, block = divmod(layer, period)
    for name, path, layout in _BLOCK_RULES + _mixer_rules(config, kind):
      entries.append(Entry(f"model.layers.{layer}.{name}", ("groups", "blocks", block) + path,
                           group, layout))
  return entries


def _at(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _first(names, limit: int = 3) -> str:
  names = sorted(names)
  more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
  return ", ".join(repr(n) for n in names[:limit]) + more


def params_from_hf(config: ModelConfig, reader, shapes: dict, where: str) -> dict:
  """Our pure param dict (float32 NumPy arrays) from the tensors of `reader`
  (`SafetensorsReader`-like: `names`, `shape`, `get`).

  shapes: the model's pure dict of parameter shapes (`jax.ShapeDtypeStruct` leaves), which the
  tensors must fit. Raises ValueError naming any missing, left-over or misshaped tensor.
  """
  entries = weight_entries(config)
  available = reader.names
  missing = [e.hf_name for e in entries if e.hf_name not in available]
  if missing:
    raise ValueError(f"{where}: missing tensor {_first(missing)}")
  leftover = available - {e.hf_name for e in entries}
  leftover -= {name for name in leftover if _DERIVED_BUFFER.fullmatch(name)}
  if "lte" in config.layer_pattern:
    leftover -= set(LTE_CONTROLLER_BUFFERS)
  if config.tie_embeddings and LM_HEAD in leftover:
    if not np.array_equal(reader.get(LM_HEAD), reader.get(EMBEDDINGS)):
      raise ValueError(f"{where}: tie_word_embeddings is true but {LM_HEAD!r} differs from"
                       f" {EMBEDDINGS!r}")
    leftover.discard(LM_HEAD)
  if leftover:
    raise ValueError(f"{where}: unexpected tensor {_first(leftover)} (not part of this"
                     " architecture)")
  params: dict = {}
  for entry in entries:
    full_shape = tuple(_at(shapes, entry.path).shape)
    shape = full_shape if entry.group is None else full_shape[1:]
    expected = entry.layout.hf_shape(shape)
    stored = reader.shape(entry.hf_name)
    if stored != expected:
      raise ValueError(f"{where}: tensor {entry.hf_name!r} has shape {list(stored)}, expected"
                       f" {list(expected)} ({entry.layout.name} layout of our {shape})")
    value = entry.layout.to_ours(np.asarray(reader.get(entry.hf_name), np.float32), shape)
    if entry.group is None:
      _set(params, entry.path, value)
      continue
    try:
      stacked = _at(params, entry.path)
    except KeyError:
      stacked = np.empty(full_shape, np.float32)
      _set(params, entry.path, stacked)
    stacked[entry.group] = value
  return params


def params_to_hf(config: ModelConfig, params: dict, lambda_sharing: str = "head"
                 ) -> dict[str, np.ndarray]:
  """The authors' tensors (float32) of our pure param dict. LTE models also get the controller
  buffers, zero: `num_kept` [LTE layers, KV heads] and `l1_lambda` shaped by the config's
  `l1_lambda_shared` ('all' [], 'layer' [LTE layers], 'head' [LTE layers, KV heads])."""
  tensors = {}
  for entry in weight_entries(config):
    value = np.asarray(_at(params, entry.path), np.float32)
    if entry.group is not None:
      value = value[entry.group]
    tensors[entry.hf_name] = np.ascontiguousarray(entry.layout.to_hf(value))
  if "lte" in config.layer_pattern:
    per_head = (config.num_lte_layers, config.lte.num_kv_heads)
    lambda_shape = {"all": (), "layer": per_head[:1], "head": per_head}[lambda_sharing]
    tensors["model.l1_lambda"] = np.zeros(lambda_shape, np.float32)
    tensors["model.num_kept"] = np.zeros(per_head, np.float32)
  return tensors
