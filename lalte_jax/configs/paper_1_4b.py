"""The paper's 1.4B recipe (§8.1-8.2) for any variant: `--set variant=<name>`.

30,720 steps of 256 x 4096 = 1,048,576 tokens (~32.2B), warmup 512, peak lr 3e-4 -> 3e-5 cosine,
AdamW (0.9, 0.95, eps 1e-15, wd 0.1), clip 1.0, bf16 compute with float32 master weights, seed 42.
The reference ran 2 GPUs x 8 sequences x 16 accumulation steps; grad_accum_steps=16 keeps its
micro-batch of 16 sequences (8 per GPU on 2 GPUs). Variants: gdn, gdn_swa, lalte, lansa,
gdn_attn, nsa, transformer (pure_lte and lte_mlp exist only at 0.4B).
Remat `dots_attention` recomputes elementwise work to save memory (40-41 GiB at 4 sequences a
GPU); where 4 sequences a GPU fit without recompute (57-60 GiB), `--set remat=none` with
grad_accum_steps raised to match trains faster (gdn_swa-1.4b 45.0% against 42.2% MFU on one
H200, docs/benchmarks.md §5).
Example: python -m lalte_jax.train --config lalte_jax/configs/paper_1_4b.py --set variant=lansa \
             --set data_dir=/data/fineweb_edu_4096
"""

from lalte_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      variant="lalte", size="1.4b", model_dtype="bfloat16", remat="dots_attention",
      scan_layers=False,  # unrolled: faster on GPUs than the scan (docs/benchmarks.md §5)
      data="pretokenized", data_dir="data/fineweb_edu_4096", seq_len=4096,
      global_batch_size=256, grad_accum_steps=16,
      steps=30_720, warmup_steps=512, lr=3e-4, lr_min_ratio=0.1,
      seed=42, log_every=10)
