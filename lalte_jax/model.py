"""HybridLM: embeddings, a stack of pre-norm blocks whose mixers follow the layer pattern, the head.

Block (§1.1): h = h + Mixer(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h)). The stack repeats one group of
`config.pattern_period` blocks (a (GDN, mixer) pair for the hybrids); parameters of the groups are
stacked on a leading axis so the forward pass is one `lax.scan` whose compile time does not grow
with depth. `scan_layers=False` runs the same stacked parameters in a Python loop (the unscanned
path, for debugging and for the test that both agree).

Outputs: float32 logits [B, T, V], or with `return_hidden=True` the hidden states before the final
norm [B, T, D] (for a loss that applies `logits_from_hidden` chunk by chunk); with
`return_aux=True` also `ModelAux`, which carries each LTE layer's router scores and retention
counts for the sparsity loss and controller (§4.4-4.5).

Inference runs the same blocks with caches: `Block.step` calls the mixer's `prefill` or `decode`
method (each mixer owns both, next to its training forward) inside the block's own norms, MLP and
residuals, and `HybridLM.logits_from_hidden` is the head of both modes
(`lalte_jax/inference/stack.py` threads the caches through the scanned groups).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.inference import chunking, group_slot
from lalte_jax.inference.caches import StepContext
from lalte_jax.layers import initializers, lm_head
from lalte_jax.layers.mlp import SwiGLU
from lalte_jax.layers.norms import RMSNorm
from lalte_jax.mixers.attention import Attention
from lalte_jax.mixers.gdn import GatedDeltaNet
from lalte_jax.mixers.lte import LTEAttention, RoutingControls, retention_count
from lalte_jax.mixers.nsa import NativeSparseAttention
from pallas_kernels.lte_router import ROUTER_ACTIVATION
from pallas_kernels.pallas_common import KERNEL_OUTPUT

MIXERS = {"gdn": GatedDeltaNet, "attention": Attention, "lte": LTEAttention,
          "nsa": NativeSparseAttention}


@flax.struct.dataclass
class ModelAux:
  """What the trainer reads besides the logits.

  lte_scores: [L_lte, B, T, Hkv] float32 router scores (sigmoid - 0.5) of the LTE layers in depth
    order, or None for models without LTE layers.
  lte_retained: [L_lte, B, Hkv] float32 number of positions j < T - margin with score > 0 (§4.5).
  """
  lte_scores: jax.Array | None
  lte_retained: jax.Array | None


# ModelConfig.remat -> the jax.checkpoint policy of a layer group (None: recompute all of it).
# "attention" keeps the attention kernels' outputs (output and logsumexp, which their backward
# kernels read), so the backward pass does not run the forward kernels again: the costliest part
# of a group's recompute (laNSA's selected branch above all); and the LTE router's activations,
# so its backward recomputes no convolution and redraws no mask (pallas_kernels/lte_router).
_KEEP_KERNEL_OUTPUTS = jax.checkpoint_policies.save_only_these_names(KERNEL_OUTPUT,
                                                                     ROUTER_ACTIVATION)
REMAT_CHECKPOINT_POLICIES = {
    "block": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": _KEEP_KERNEL_OUTPUTS,
    # Both: the backward recomputes the group's elementwise work only.
    "dots_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _KEEP_KERNEL_OUTPUTS),
}


class Block(nnx.Module):

  def __init__(self, config: ModelConfig, mixer_kind: str, *, rngs: nnx.Rngs):
    self.mixer_kind = mixer_kind
    self.mixer_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
    self.mixer = MIXERS[mixer_kind](config, rngs=rngs)
    self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
    self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, init_std=config.init_std,
                      rescale_num_layers=config.num_layers if config.rescale_prenorm_residual
                      else None, dtype=config.compute_dtype, rngs=rngs)

  def _residual(self, h_BTD: jax.Array, mix) -> tuple[jax.Array, object]:
    """h + mixed, then + SwiGLU(RMSNorm(.)), where `mix(RMSNorm(h))` returns (mixed, extra);
    returns the new h and extra."""
    normed_BTD = self.mixer_norm(h_BTD)
    with jax.named_scope(f"{self.mixer_kind}_mixer"):  # names its kernels in profiles
      mixed_BTD, extra = mix(normed_BTD)
    return self._mlp_residual(h_BTD + mixed_BTD), extra

  def _mlp_residual(self, h_BTD: jax.Array, chunk_tokens: int | None = None) -> jax.Array:
    """h + SwiGLU(RMSNorm(h)), `chunk_tokens` tokens at a time (a prefill's chunks)."""
    return chunking.add_chunks(lambda x: self.mlp(self.mlp_norm(x)), h_BTD, chunk_tokens)

  def __call__(self, h_BTD: jax.Array, dropout_key: jax.Array | None,
               routing: RoutingControls | None = None
               ) -> tuple[jax.Array, jax.Array | None]:
    """Returns the new residual stream and, for LTE blocks, the router scores [B, T, Hkv]."""
    if self.mixer_kind == "lte":
      return self._residual(h_BTD, lambda x: self.mixer(
          x, dropout_key=dropout_key, routing=routing))
    return self._residual(h_BTD, lambda x: (self.mixer(x), None))

  def step(self, h_BTD: jax.Array, cache, ctx: StepContext, mode: str):
    """The block on the tokens of one inference call, with the mixer's layer cache as a
    `group_slot.group_view` (its layer group's part of the stacked cache): `mode` "prefill" (a
    left-padded prompt, empty cache) or "decode" (one token per row). Returns (h, cache)."""
    if mode == "decode":  # reads and writes the stacked cache in place
      return self._residual(h_BTD, lambda x: self.mixer.decode(x, cache, ctx))
    # A prompt fills the whole cache: the mixer's prefill takes and returns the group's arrays.
    # It normalises the residual stream and adds its output itself, so that in chunks neither
    # the normalised prompt nor the mixer's output exists whole (chunking.py).
    h_BTD, filled = self.mixer.prefill(h_BTD, self.mixer_norm, group_slot.read_group(cache),
                                       ctx)
    return self._mlp_residual(h_BTD, ctx.chunk_tokens), group_slot.write_group(cache, filled)


class LayerGroup(nnx.Module):
  """One period of the layer pattern, e.g. (GDN block, LTE block)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    kinds = config.layer_pattern[:config.pattern_period]
    self.blocks = nnx.List([Block(config, kind, rngs=rngs) for kind in kinds])

  def __call__(self, h_BTD: jax.Array, dropout_key: jax.Array | None,
               routing: RoutingControls | None = None
               ) -> tuple[jax.Array, jax.Array | None]:
    """Returns h and the stacked LTE scores of this group [L_lte_in_group, B, T, Hkv] (or None)."""
    keys = [None] * len(self.blocks) if dropout_key is None else list(
        jax.random.split(dropout_key, len(self.blocks)))
    scores = []
    for block, key in zip(self.blocks, keys):
      h_BTD, score_BTK = block(h_BTD, key, routing)
      if score_BTK is not None:
        scores.append(score_BTK)
    return h_BTD, jnp.stack(scores) if scores else None


def validate_tokens(tokens: jax.Array, vocab_size: int) -> None:
  """Raises ValueError for a token array that is not int [B, T] with ids in [0, vocab_size).

  The id range is checked only when the values are known (outside `jax.jit`); inputs of a jitted
  step are checked where they enter (the data pipeline, the generation API).
  """
  if tokens.ndim != 2:
    raise ValueError(f"tokens: expected shape [batch, length], got {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens: expected an integer dtype, got {tokens.dtype}")
  if tokens.shape[1] == 0:
    raise ValueError("tokens: the sequence is empty (length 0)")
  if isinstance(tokens, jax.core.Tracer):
    return
  low, high = int(jnp.min(tokens)), int(jnp.max(tokens))
  if low < 0 or high >= vocab_size:
    bad = low if low < 0 else high
    raise ValueError(f"tokens: id {bad} is outside the vocabulary [0, {vocab_size})")


class HybridLM(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    num_groups = config.num_layers // config.pattern_period
    self.embed = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.compute_dtype,
                           embedding_init=initializers.normal(config.init_std), rngs=rngs)

    @nnx.split_rngs(splits=num_groups)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_groups(rngs: nnx.Rngs) -> LayerGroup:
      return LayerGroup(config, rngs=rngs)

    self.groups = make_groups(rngs)  # every parameter has a leading [num_groups] axis
    self.final_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
    if not config.tie_embeddings:
      self.lm_head = nnx.Param(initializers.normal(config.init_std)(
          rngs.params(), (config.hidden_size, config.vocab_size)))

  @property
  def num_groups(self) -> int:
    return self.config.num_layers // self.config.pattern_period

  def _run_groups(self, h_BTD: jax.Array, dropout_key: jax.Array | None,
                  routing: RoutingControls | None
                  ) -> tuple[jax.Array, jax.Array | None]:
    graphdef, stacked_state = nnx.split(self.groups)
    keys = None if dropout_key is None else jax.random.split(dropout_key, self.num_groups)

    def one_group(h, state, key):
      return nnx.merge(graphdef, state)(h, key, routing)

    if self.config.remat != "none":
      one_group = jax.checkpoint(one_group, policy=REMAT_CHECKPOINT_POLICIES[self.config.remat])

    if self.config.scan_layers:
      def body(h, xs):
        state, key = xs
        return one_group(h, state, key)
      h_BTD, scores = jax.lax.scan(body, h_BTD, (stacked_state, keys))
    else:
      per_group = []
      for i in range(self.num_groups):
        state = jax.tree.map(lambda x, i=i: x[i], stacked_state)
        h_BTD, score = one_group(h_BTD, state, None if keys is None else keys[i])
        per_group.append(score)
      scores = None if per_group[0] is None else jnp.stack(per_group)
    if scores is not None:  # [G, L_lte_in_group, B, T, H] -> depth order [L_lte, B, T, H]
      scores = scores.reshape(-1, *scores.shape[2:])
    return h_BTD, scores

  def logits_from_hidden(self, h_BTD: jax.Array) -> jax.Array:
    """Final norm and LM head (the embedding's transpose when tied): logits [B, T, V] float32."""
    h_BTD = self.final_norm(h_BTD)
    head_DV = self.embed.embedding[...].T if self.config.tie_embeddings else self.lm_head[...]
    with jax.named_scope("lm_head"):  # names its kernels in profiles (tools/step_profile.py)
      return lm_head.float32_logits(h_BTD, head_DV.astype(h_BTD.dtype))

  def __call__(self, tokens_BT: jax.Array, *, dropout_key: jax.Array | None = None,
               routing: RoutingControls | None = None, return_aux: bool = False,
               return_hidden: bool = False):
    """Logits [B, T, V] float32, or with `return_hidden` the last group's output [B, T, D] in the
    compute dtype (`logits_from_hidden` of it gives the logits); and `ModelAux` if `return_aux`.

    `dropout_key` turns on the only dropout of these models (inside the LTE router, §4.1); leave
    it None for evaluation. `routing` (`lalte_jax.mixers.lte.RoutingControls`) changes how the
    LTE layers route in training: evicted tokens revealed at random, or no gradient through the
    scores (the router warm-up variants of lalte_jax/train/router_warmup.py); None: as §4.
    """
    config = self.config
    validate_tokens(tokens_BT, config.vocab_size)
    h_BTD = self.embed(tokens_BT)
    h_BTD, lte_scores = self._run_groups(h_BTD, dropout_key, routing)
    out = h_BTD if return_hidden else self.logits_from_hidden(h_BTD)
    if not return_aux:
      return out
    retained = None
    if lte_scores is not None:
      retained = jax.vmap(retention_count, in_axes=(0, None))(lte_scores,
                                                              config.lte.router_margin)
    return out, ModelAux(lte_scores=lte_scores, lte_retained=retained)


def count_parameters(config: ModelConfig) -> int:
  """Number of parameters of `HybridLM(config)`, from shapes only (nothing is allocated)."""
  abstract = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
  state = nnx.state(abstract, nnx.Param)
  return sum(int(x.size) for x in jax.tree.leaves(state))

