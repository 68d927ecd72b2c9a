"""A tiny laLTE model fits a fixed batch of repeated-pattern sequences for a few steps on the CPU.

It shows the pieces working together: a preset, parameter counting without allocation, the jitted
forward and backward pass through every mixer, the LTE router's scores and retention counts, and
an AdamW update. Usage: `python -m train.demo [--preset lalte-tiny] [--steps 30]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.loss import next_token_cross_entropy
from lalte_jax.model import HybridLM, count_parameters


def periodic_batch(seed: int, batch: int, length: int, period: int, vocab: int) -> np.ndarray:
  """Rows that repeat a random pattern of `period` tokens: predictable only by looking back."""
  rng = np.random.default_rng(seed)
  pattern = rng.integers(0, vocab, size=(batch, period))
  return np.tile(pattern, (1, -(-length // period)))[:, :length].astype(np.int32)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="lalte-tiny")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.steps <= 0:
    parser.error(f"--steps must be positive, got {args.steps}")

  config = get_model_config(args.preset)
  print(f"preset {config.name}: {config.num_layers} layers {config.layer_pattern},"
        f" {count_parameters(config):,} parameters")
  model = HybridLM(config, rngs=nnx.Rngs(args.seed))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1),
                            wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, tokens, dropout_key):
    def loss_fn(model):
      logits, aux = model(tokens, dropout_key=dropout_key, return_aux=True)
      return next_token_cross_entropy(logits, tokens), aux
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, optax.global_norm(grads), aux

  # A period longer than the LTE window: tokens must be fetched from beyond it.
  period = config.lte.window + 9 if config.lte is not None else 40
  tokens = jnp.asarray(periodic_batch(args.seed, args.batch, args.length, period,
                                      config.vocab_size))
  key = jax.random.key(args.seed)
  start = time.perf_counter()
  for step in range(1, args.steps + 1):
    key, dropout_key = jax.random.split(key)
    loss, grad_norm, aux = train_step(model, optimizer, tokens, dropout_key)
    if step == 1 or step % 10 == 0 or step == args.steps:
      line = f"step {step:4d}  loss {float(loss):.4f}  grad norm {float(grad_norm):.3f}"
      if aux.lte_retained is not None:
        kept = np.asarray(aux.lte_retained).mean(axis=1)  # [L_lte, Hkv], averaged over the batch
        rows = "; ".join(" ".join(f"{x:.1f}" for x in layer) for layer in kept)
        line += f"  LTE tokens kept per layer/head [{rows}]"
      print(line, flush=True)
  elapsed = time.perf_counter() - start
  print(f"{args.steps} steps of {args.batch}x{args.length} tokens in {elapsed:.1f} s"
        f" (first step includes compilation)")


if __name__ == "__main__":
  main()
