"""Tiny laLTE on synthetic multi-query associative recall (MQAR), trained on the CPU in minutes.

Data is generated on the fly from (index, seed) by `lalte_jax.data.MQARSource`; nothing to
download. 4 key-value pairs, then queries (mostly soon after, a few far later); the model must
answer each query with the value bound to its key. Measured on a shared 2-core CPU: 400 steps in
~4.5 min reach ~94% held-out recall (chance ~1%). Queries forced beyond the LTE window
(`--set mqar_min_gap=24 --set seq_len=96`) are much harder and need far more steps.
Run: `python -m train --config configs/tiny_mqar.py [--set key=value ...]`.
"""

from train.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      variant="lalte", size="tiny", model_dtype="bfloat16",
      data="mqar", seq_len=64, mqar_num_kv_pairs=4, mqar_min_gap=0,
      num_train_examples=1_000_000, num_eval_examples=256,
      global_batch_size=64, grad_accum_steps=1,
      steps=400, warmup_steps=20, lr=1e-2, lr_min_ratio=0.1,
      seed=42, output_dir="runs/tiny_mqar", log_every=25, eval_batches=4)
