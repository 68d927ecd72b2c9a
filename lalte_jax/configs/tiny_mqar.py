"""Tiny laLTE on synthetic multi-query associative recall (MQAR), trained on the CPU in minutes.

Data is generated on the fly from (index, seed) by `lalte_jax.data.MQARSource`; nothing to
download. 4 key-value pairs, then queries (mostly soon after, a few far later); the model must
answer each query with the value bound to its key. Measured (jax 0.10.2, 2-core CPU): 400 steps
reach 89.5% held-out recall (chance < 1%; the loss drops between steps 150 and 200), 3.4 min on
an idle 2-core machine; 600 steps gave 93.9% (drop at 200-275) before the GDN reference's inverse
got its closed-form gradient. With 400 steps at lr 1e-2 the drop once came too late after a
numerically different (but exact) chunk inverse moved the trajectory (20.7% recall): lr 5e-3
leaves ~200 steps of room after the drop. Queries forced beyond the LTE window
(`--set mqar_min_gap=24 --set seq_len=96`) are much harder and need far more steps.
Run: `python -m lalte_jax.train --config lalte_jax/configs/tiny_mqar.py [--set key=value ...]`.
"""

from lalte_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      variant="lalte", size="tiny", model_dtype="bfloat16",
      data="mqar", seq_len=64, mqar_num_kv_pairs=4, mqar_min_gap=0,
      num_train_examples=1_000_000, num_eval_examples=256,
      global_batch_size=64, grad_accum_steps=1,
      steps=400, warmup_steps=20, lr=5e-3, lr_min_ratio=0.1,
      seed=42, output_dir="runs/tiny_mqar", log_every=25, eval_batches=4)
