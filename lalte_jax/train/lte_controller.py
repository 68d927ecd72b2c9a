"""The LTE sparsity loss and the lambda controller, exactly as §4.4-4.6 of docs/model_spec.md.

Sparsity loss (§4.4, G2, G3): mean over batch, positions j < T - margin, LTE layers and KV heads
of lambda[n, h] * ReLU(score[n, b, j, h]), score = sigmoid(x) - 0.5. The last `margin` positions
(6 for the paper's router) are cropped because their right context was zero padding.

Retention count c (§4.5, G7): per LTE layer and head, the number of positions j < T - margin with
score > 0, averaged over the sequences of the step (all micro-batches). It counts every position,
in-window ones included, and is compared with the cap b. The model reports the per-sequence counts
(`ModelAux.lte_retained`, same crop); the train step averages them.

Controller (§4.6, G4-G6, G19), with steps numbered k = 1, 2, ...:
- start: lambda = 0 (not 1e-9), EMA = seq_len;
- every step: ema <- (1 - a) * ema + a * c, a = 2 / (1 + u // 2) (u = 32 gives 2/17);
- when k % u == 0: large = ema > 0.95 b, small = ema < 1.0 b;
  at k == u (first update) lambda = 1e-9 where large else 0, nothing else;
  afterwards lambda *= 1.5 if large and not small (ema >= b), *= 1/2 if small and not large
  (ema <= 0.95 b), unchanged in between; clamp to <= lambda_max; entries < lambda_min become 0;
  entries that are 0 and large are re-enabled at 1e-9 (threshold 0.95 b, not b).
- the new lambda enters the loss from the next step on.

Data parallelism (G19). The reference keeps a local EMA per rank and replaces it by the
all-reduce average only at update steps. Our step is one jitted program over a global mesh, so
`c` is already the average over the global batch (every rank's rows). Because the EMA is linear
and all ranks start each period from the same (averaged) value, the EMA of the globally averaged
counts equals the average of the per-rank EMAs at every update step:
  mean_r((1-a) e + a c_r) = (1-a) e + a mean_r(c_r).
Lambda, the only thing the EMA feeds, is therefore identical; no explicit collective is needed.
Between update steps our EMA is the global one, the reference's a rank-local one (logging only).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
  """§4.6 hyper-parameters (`l1_*` in the reference) and the target count b (buffer_size)."""
  cap: int  # b: target number of kept tokens per sequence, layer and head
  lambda_init: float = 1e-9
  lambda_min: float = 1e-9
  lambda_max: float = 1.0
  alpha_up: float = 1.5
  alpha_down: float = 2.0
  update_every: int = 32
  tolerance_low: float = 0.95
  tolerance_high: float = 1.0

  @property
  def ema_weight(self) -> float:
    """a = 2 / (1 + u // 2): the weight of the newest count."""
    return 2.0 / (1 + self.update_every // 2)


@flax.struct.dataclass
class ControllerState:
  """lambda_LH and ema_LH: float32 [L_lte, Hkv]."""
  lambda_LH: jax.Array
  ema_LH: jax.Array


def init_controller(num_lte_layers: int, num_kv_heads: int, seq_len: int
                    ) -> ControllerState | None:
  """lambda = 0 and EMA = seq_len everywhere (§4.6 "start of training", G4); None for a model
  without LTE layers (it has no controller, and a checkpoint cannot hold zero-size arrays)."""
  if num_lte_layers == 0:
    return None
  shape = (num_lte_layers, num_kv_heads)
  return ControllerState(lambda_LH=jnp.zeros(shape, jnp.float32),
                         ema_LH=jnp.full(shape, float(seq_len), jnp.float32))


def crop_scored_positions(score_LBTH: jax.Array, margin: int) -> jax.Array:
  """Drops the last `margin` positions, whose router input was partly zero padding."""
  return score_LBTH[:, :, :score_LBTH.shape[2] - margin]


def sparsity_loss(score_LBTH: jax.Array, lambda_LH: jax.Array, margin: int) -> jax.Array:
  """mean_{n,b,j<T-margin,h} lambda[n,h] * ReLU(score[n,b,j,h]) in float32 (§4.4, G3)."""
  penalty_LBTH = jax.nn.relu(crop_scored_positions(score_LBTH, margin).astype(jnp.float32))
  return jnp.mean(penalty_LBTH * lambda_LH[:, None, None, :])


def update_controller(state: ControllerState, count_LH: jax.Array, step: jax.Array | int,
                      config: ControllerConfig) -> ControllerState:
  """One optimizer step k (1-based) of §4.6: EMA of `count_LH`, then the lambda update when
  k % update_every == 0. Pure function of its inputs; safe under jit with a traced `step`."""
  a = jnp.float32(config.ema_weight)
  ema_LH = (1.0 - a) * state.ema_LH + a * count_LH.astype(jnp.float32)
  large_LH = ema_LH > config.tolerance_low * config.cap
  small_LH = ema_LH < config.tolerance_high * config.cap
  lam_LH = state.lambda_LH

  first_LH = jnp.where(large_LH, jnp.float32(config.lambda_init), jnp.float32(0.0))

  sign_LH = large_LH.astype(jnp.int32) - small_LH.astype(jnp.int32)
  factor_LH = jnp.where(sign_LH > 0, jnp.float32(config.alpha_up),
                        jnp.where(sign_LH < 0, jnp.float32(1.0 / config.alpha_down),
                                  jnp.float32(1.0)))
  later_LH = jnp.minimum(lam_LH * factor_LH, jnp.float32(config.lambda_max))
  later_LH = jnp.where(later_LH < config.lambda_min, jnp.float32(0.0), later_LH)
  later_LH = jnp.where((later_LH == 0.0) & large_LH, jnp.float32(config.lambda_init), later_LH)

  step = jnp.asarray(step, jnp.int32)
  is_update = (step > 0) & (step % config.update_every == 0)
  new_lam_LH = jnp.where(is_update, jnp.where(step == config.update_every, first_LH, later_LH),
                         lam_LH)
  return ControllerState(lambda_LH=new_lam_LH, ema_LH=ema_LH)
