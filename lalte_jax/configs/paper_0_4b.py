"""The paper's 0.4B recipe (§8.1-8.2) for any variant: `--set variant=<name>`.

20,480 steps of 128 x 4096 = 524,288 tokens (~10.7B), warmup 1024, peak lr 3e-4 -> 3e-5 cosine,
AdamW (0.9, 0.95, eps 1e-15, wd 0.1), clip 1.0, bf16 compute with float32 master weights, seed 42.
Data: FineWeb-Edu packed into 4096-token sequences by lalte_jax/data/prepare.py (set `data_dir`).
The device split is not part of the recipe: raise `grad_accum_steps` until a micro-batch fits
(global_batch_size / grad_accum_steps sequences over all data x fsdp devices).
Example: python -m lalte_jax.train --config lalte_jax/configs/paper_0_4b.py --set variant=gdn_swa \
             --set data_dir=/data/fineweb_edu_4096 --set grad_accum_steps=2
"""

from lalte_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      variant="lalte", size="0.4b", model_dtype="bfloat16",
      # Keeps every activation: fastest unrolled, 8 sequences of 4096 a GPU in 49-54 GiB
      # (docs/benchmarks.md §5).
      remat="none",
      scan_layers=False,  # unrolled: faster on GPUs than the scan (docs/benchmarks.md §5)
      data="pretokenized", data_dir="data/fineweb_edu_4096", seq_len=4096,
      global_batch_size=128, grad_accum_steps=1,
      steps=20_480, warmup_steps=1024, lr=3e-4, lr_min_ratio=0.1,
      seed=42, log_every=10)
