"""The train state and the train step: micro-batches, CE + LTE sparsity loss, controller, AdamW.

One call of the step is one optimizer step k = state.step + 1 (§8.3):
1. for each of the A micro-batches (a `lax.scan`): forward with router dropout, loss
   = CE_sum / (scored tokens of the whole step) + L_sparse / A, backward; gradients summed in
   float32. With `loss_chunk_tokens` = N > 0 the CE sum is taken from the final hidden states N
   positions at a time (`lalte_jax.loss.chunked_cross_entropy_sum`), so the micro-batch's float32
   [B, T, V] logits and their gradient never exist at once;
2. the controller's EMA of the retention count, and every 32 steps the lambda update (§4.6);
3. clip to global norm 1.0, AdamW with the scheduled lr. If the gradient norm is not finite the
   update is dropped: parameters and optimizer state come back bitwise unchanged, and the step is
   counted in `skipped_total` / `skipped_consecutive` (the driver stops after N in a row).

CE normalisation: the token-weighted mean over the whole step's scored tokens. For pretraining
(every position scored, equal rows per micro-batch) this is exactly the reference's per-micro-batch
mean divided by A; for masked tasks (MQAR) it also makes the loss independent of how the batch is
split into micro-batches and devices.

The controller is updated even on a skipped step, as in the reference, where the EMA/lambda update
(step 2) precedes the clip that detects the non-finite norm.

Router warm-up (`lte_routing_freeze_steps` = N > 0, lalte_jax/train/router_warmup.py): steps
1..N keep every token, give the routers no gradient and no update (or, with
`lte_routing_freeze_learns`, the straight-through gradient of reads that see every token, or
with `lte_routing_freeze_anneal` each evicted token with a probability falling to 0), and
hold the controller at its initial state; from step N + 1 the controller counts its steps from
there (and with `lte_router_frozen_after_warmup` the routers learned during the warm-up get no
update after it, except, with `lte_router_threshold_rate`, their output biases, which follow
the step's retention count).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lalte_jax.config import ModelConfig
from lalte_jax.data import IGNORE_LABEL
from lalte_jax.loss import chunked_cross_entropy_sum
from lalte_jax.model import HybridLM
from lalte_jax.train import optimizer as opt_lib
from lalte_jax.train import router_warmup
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.lte_controller import (ControllerConfig, ControllerState, init_controller,
                                  sparsity_loss, update_controller)


@flax.struct.dataclass
class TrainState:
  """Everything that evolves during training; a plain pytree of arrays (Orbax saves it as is).

  step: int32 [] optimizer steps attempted so far (skipped ones included).
  params: float32 master weights as an nnx pure dict (`nnx.to_pure_dict`).
  opt_state: optax AdamW state (moments float32, count of applied updates).
  rng: uint32 [2] raw key data; the step's dropout key is fold_in(key, step), so a resumed run
    draws the same masks. Raw data rather than a typed key keeps the tree plain.
  controller: LTE lambda and retention EMA, float32 [L_lte, Hkv]; None without LTE layers.
  skipped_total, skipped_consecutive: int32 [] counts of non-finite-gradient steps.
  """
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  rng: jax.Array
  controller: ControllerState | None
  skipped_total: jax.Array
  skipped_consecutive: jax.Array


def _no_lte() -> jax.Array:
  """The [L_lte, Hkv] statistics of a model without LTE layers."""
  return jnp.zeros((0, 0), jnp.float32)


class TooManySkippedSteps(RuntimeError):
  """Raised by the driver after `max_consecutive_skips` non-finite gradients in a row."""


def controller_config(model_config: ModelConfig, config: TrainConfig) -> ControllerConfig | None:
  if model_config.num_lte_layers == 0:
    return None
  return ControllerConfig(
      cap=model_config.lte.cap, lambda_init=config.lte_lambda_init,
      lambda_min=config.lte_lambda_min, lambda_max=config.lte_lambda_max,
      alpha_up=config.lte_alpha_up, alpha_down=config.lte_alpha_down,
      update_every=config.lte_update_every, tolerance_low=config.lte_tolerance_low,
      tolerance_high=config.lte_tolerance_high)


def model_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
  """The model's structure, built abstractly (no parameter is allocated)."""
  abstract = nnx.eval_shape(lambda: HybridLM(model_config, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract, nnx.Param)
  return graphdef


def init_train_state(model_config: ModelConfig, config: TrainConfig, key: jax.Array
                     ) -> TrainState:
  """A fresh state from `key` (jit it with out_shardings to build it directly sharded)."""
  init_key, step_key = jax.random.split(key)
  model = HybridLM(model_config, rngs=nnx.Rngs(init_key))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  num_kv_heads = model_config.lte.num_kv_heads if model_config.lte is not None else 0
  zero = jnp.zeros((), jnp.int32)
  return TrainState(
      step=zero, params=params, opt_state=opt_lib.make_adamw(config).init(params),
      rng=jax.random.key_data(step_key),
      controller=init_controller(model_config.num_lte_layers, num_kv_heads, config.seq_len),
      skipped_total=zero, skipped_consecutive=zero)


def _to_micro_batches(x_BT: jax.Array, num_micro: int) -> jax.Array:
  """[B, T] -> [A, B/A, T] with micro-batch i = rows i, i+A, i+2A, ...

  Interleaving (rather than contiguous blocks) keeps every micro-batch spread over all devices
  when the batch axis is sharded in contiguous blocks: reshape to [B/A, A, T] leaves dim 0 split
  exactly as B was, and the scan then walks the unsharded axis.
  """
  batch = x_BT.shape[0]
  return x_BT.reshape(batch // num_micro, num_micro, *x_BT.shape[1:]).swapaxes(0, 1)


def make_gradient_fn(graphdef: nnx.GraphDef, model_config: ModelConfig, config: TrainConfig, *,
                     micro_batch_sharding: jax.sharding.Sharding | None = None
                     ) -> Callable[[TrainState, dict], tuple[dict, dict]]:
  """(state, {"tokens", "labels"} [B, T]) -> (float32 gradients summed over the micro-batches,
  stats): step 1 of the module doc. Stats: ce_sum, sparsity_loss (mean over micro-batches),
  count_LH (retention count c, [L_lte, Hkv]), num_scored.

  `micro_batch_sharding`, for [A, B/A, T] arrays, pins how micro-batches are laid out on the mesh.
  """
  ctrl = controller_config(model_config, config)
  margin = model_config.lte.router_margin if ctrl is not None else 0
  num_micro = config.grad_accum_steps
  freeze_steps = config.lte_routing_freeze_steps
  router_learns = config.lte_routing_freeze_learns
  chunk_tokens = config.loss_chunk_tokens

  def micro_loss(params, tokens_BT, labels_BT, lambda_LH, key, num_scored, frozen, routing):
    if freeze_steps and not router_learns:  # d(forward)/d(router output bias) is 0 while frozen
      params = router_warmup.keep_every_token(params, frozen)
    model = nnx.merge(graphdef, params)
    # The head runs inside the loss, chunk by chunk when chunk_tokens > 0: no [B, T, V] logits.
    hidden_BTD, aux = model(tokens_BT, dropout_key=key, return_aux=True, return_hidden=True,
                            routing=routing)
    with jax.named_scope("cross_entropy_loss"):  # names its ops in profiles (step_profile.py)
      ce_sum = chunked_cross_entropy_sum(model.logits_from_hidden, hidden_BTD, labels_BT,
                                         chunk_tokens)
    if ctrl is None:
      return ce_sum / num_scored, (ce_sum, jnp.float32(0.0), _no_lte())
    sparse = sparsity_loss(aux.lte_scores, lambda_LH, margin)
    count_LH = jnp.mean(aux.lte_retained, axis=1)  # per-sequence counts, mean over rows
    return ce_sum / num_scored + sparse / num_micro, (ce_sum, sparse, count_LH)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  def gradients(state: TrainState, batch: dict) -> tuple[dict, dict]:
    tokens_ABT = _to_micro_batches(batch["tokens"], num_micro)
    labels_ABT = _to_micro_batches(batch["labels"], num_micro)
    if micro_batch_sharding is not None:
      tokens_ABT = jax.lax.with_sharding_constraint(tokens_ABT, micro_batch_sharding)
      labels_ABT = jax.lax.with_sharding_constraint(labels_ABT, micro_batch_sharding)
    num_scored = jnp.maximum(jnp.sum(batch["labels"] != IGNORE_LABEL), 1).astype(jnp.float32)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    micro_keys = jax.random.split(step_key, num_micro)
    frozen = state.step < freeze_steps  # this step (0-based state.step) is a warm-up step
    routing = router_warmup.routing_controls(state.step, config)
    lambda_LH = None if ctrl is None else state.controller.lambda_LH

    def accumulate(carry, xs):
      grads_acc, ce_acc, sparse_acc, count_acc = carry
      tokens_BT, labels_BT, key = xs
      (_, (ce_sum, sparse, count_LH)), grads = grad_fn(
          state.params, tokens_BT, labels_BT, lambda_LH, key, num_scored, frozen, routing)
      grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
      return (grads_acc, ce_acc + ce_sum, sparse_acc + sparse, count_acc + count_LH), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    init = (zeros, jnp.float32(0.0), jnp.float32(0.0),
            _no_lte() if ctrl is None else jnp.zeros_like(state.controller.ema_LH))
    (grads, ce_sum, sparse_sum, count_sum), _ = jax.lax.scan(
        accumulate, init, (tokens_ABT, labels_ABT, micro_keys))
    return grads, {"ce_sum": ce_sum, "sparsity_loss": sparse_sum / num_micro,
                   "count_LH": count_sum / num_micro, "num_scored": num_scored}

  return gradients


def make_train_step(graphdef: nnx.GraphDef, model_config: ModelConfig, config: TrainConfig, *,
                    micro_batch_sharding: jax.sharding.Sharding | None = None
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
  """The pure step function (state, {"tokens", "labels"} [B, T]) -> (state, metrics); jit it."""
  tx = opt_lib.make_adamw(config)
  ctrl = controller_config(model_config, config)
  gradients = make_gradient_fn(graphdef, model_config, config,
                               micro_batch_sharding=micro_batch_sharding)
  freeze_steps = config.lte_routing_freeze_steps

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, stats = gradients(state, batch)
    step = state.step + 1  # 1-based, as the reference numbers its steps
    frozen = state.step < freeze_steps
    controller = state.controller
    if ctrl is not None:
      controller = update_controller(controller, stats["count_LH"], step - freeze_steps, ctrl)
      if freeze_steps:
        initial = init_controller(model_config.num_lte_layers, model_config.lte.num_kv_heads,
                                  config.seq_len)
        controller = jax.tree.map(lambda held, new: jnp.where(frozen, held, new), initial,
                                  controller)

    with jax.named_scope("optimizer_update"):  # names its ops in profiles (step_profile.py)
      clipped, grad_norm = opt_lib.clip_by_global_norm(grads, config.clip_norm)
      finite = jnp.isfinite(grad_norm)
      updates, new_opt_state = tx.update(clipped, state.opt_state, state.params)
      lr = opt_lib.learning_rate(config, state.step)  # 0-based index of this optimizer step
      new_params = opt_lib.apply_updates(state.params, updates, lr)
      if freeze_steps and not config.lte_routing_freeze_learns:
        new_params = router_warmup.hold_routers(new_params, state.params, frozen)
      elif config.lte_router_frozen_after_warmup:
        new_params = router_warmup.hold_routers(new_params, state.params,
                                                jnp.logical_not(frozen))
        if config.lte_router_threshold_rate:
          shift_LH = router_warmup.threshold_shift(stats["count_LH"], model_config.lte.cap,
                                                   config.lte_router_threshold_rate)
          new_params = router_warmup.shift_router_bias(new_params, shift_LH,
                                                       jnp.logical_not(frozen))
      # Select, never blend: the old leaves come back bit for bit when the step is skipped.
      keep_new = lambda new, old: jnp.where(finite, new, old)
      new_params = jax.tree.map(keep_new, new_params, state.params)
      new_opt_state = jax.tree.map(keep_new, new_opt_state, state.opt_state)
    skipped = jnp.logical_not(finite).astype(jnp.int32)
    new_state = state.replace(
        step=step, params=new_params, opt_state=new_opt_state,
        controller=controller, skipped_total=state.skipped_total + skipped,
        skipped_consecutive=jnp.where(finite, 0, state.skipped_consecutive + 1))
    ce_loss = stats["ce_sum"] / stats["num_scored"]
    metrics = {
        "loss": ce_loss + stats["sparsity_loss"], "ce_loss": ce_loss,
        "sparsity_loss": stats["sparsity_loss"], "grad_norm": grad_norm, "lr": lr,
        "skipped": skipped, "skipped_total": new_state.skipped_total,
        "skipped_consecutive": new_state.skipped_consecutive,
        "scored_tokens": stats["num_scored"],
        "lte_lambda": _no_lte() if controller is None else controller.lambda_LH,
        "lte_retained": stats["count_LH"],
        "lte_retained_ema": _no_lte() if controller is None else controller.ema_LH,
    }
    return new_state, metrics

  return train_step


def check_skipped_steps(skipped_consecutive, step: int, max_consecutive: int) -> None:
  """Raises TooManySkippedSteps when `max_consecutive` steps in a row had non-finite gradients
  (`skipped_consecutive`: the step's metric of that name, on the host)."""
  consecutive = int(np.asarray(skipped_consecutive))
  if consecutive >= max_consecutive:
    raise TooManySkippedSteps(
        f"stopping at step {step}: the last {consecutive} optimizer steps had a non-finite"
        f" (NaN/Inf) gradient norm and were skipped (max_consecutive_skips={max_consecutive})."
        " Parameters are those of the last good step. Likely causes: corrupt input batches,"
        " a learning rate that is too high, or an overflow in a custom kernel.")
