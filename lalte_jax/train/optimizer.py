"""AdamW, the warmup-stable-cosine learning rate and global-norm clipping of §8.1.

The reference trains with torch AdamW (betas 0.9/0.95, eps 1e-15, weight decay 0.1 on every
parameter in one group), torchtitan's linear-warmup / one stable step / cosine-to-0.1x schedule,
and `clip_grad_norm_(1.0)`. Three choices keep that exact here:

- The learning rate is a function of the train step (steps attempted, skipped ones included, as
  torchtitan steps its scheduler every iteration), passed in from outside rather than read from an
  optax step counter inside the optimizer state: a skipped step must leave that state bitwise
  unchanged, yet the schedule moves on.
- AdamW is `scale_by_adam` + `add_decayed_weights`, scaled by -lr afterwards:
  p <- p - lr * (adam(g) + wd * p), the same as torch's decoupled p *= (1 - lr*wd), p -= lr*adam
  (both read the old p). Adam's bias correction counts only applied updates, as torch's does.
- Clipping uses torch's coefficient max_norm / (norm + 1e-6), capped at 1.

Parameters (master weights) and optimizer moments are float32; gradients arrive in float32
because they are taken with respect to the float32 parameters (the model casts to bf16 inside).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from lalte_jax.train.config import TrainConfig

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
TORCH_CLIP_EPS = 1e-6


def lr_factor(step_index: jax.Array | int, *, warmup_steps: int, total_steps: int,
              min_ratio: float) -> jax.Array:
  """Multiplier of the peak lr for the optimizer step with 0-based index s (§8.1).

  s < warmup: (s+1)/warmup; s == warmup: 1 (torchtitan's one "stable" step);
  s > warmup: min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,
             p = (s - warmup) / (total - warmup).
  """
  s = jnp.asarray(step_index, jnp.float32)
  warmup = jnp.float32(warmup_steps)
  progress = (s - warmup) / jnp.float32(total_steps - warmup_steps)
  cosine = min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + jnp.cos(jnp.float32(math.pi) * progress))
  return jnp.where(s < warmup, (s + 1.0) / warmup, jnp.where(s == warmup, 1.0, cosine))


def learning_rate(config: TrainConfig, step_index: jax.Array | int) -> jax.Array:
  """The lr of the optimizer step with 0-based index `step_index` (float32 scalar)."""
  return config.lr * lr_factor(step_index, warmup_steps=config.warmup_steps,
                               total_steps=config.steps, min_ratio=config.lr_min_ratio)


def make_adamw(config: TrainConfig) -> optax.GradientTransformation:
  """AdamW without the learning rate: updates u such that p_new = p - lr * u (see module doc)."""
  return optax.chain(
      optax.scale_by_adam(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps),
      optax.add_decayed_weights(config.weight_decay),
  )


def global_norm(tree) -> jax.Array:
  """L2 norm over every leaf, accumulated in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def clip_by_global_norm(grads, max_norm: float) -> tuple[object, jax.Array]:
  """(grads scaled by min(1, max_norm / (norm + 1e-6)), norm) as torch's clip_grad_norm_."""
  norm = global_norm(grads)
  scale = jnp.minimum(1.0, max_norm / (norm + TORCH_CLIP_EPS))
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def apply_updates(params, updates, lr: jax.Array):
  """p - lr * u, in the parameters' dtype (float32 master weights)."""
  return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
