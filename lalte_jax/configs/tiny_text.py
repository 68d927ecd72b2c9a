"""Tiny laLTE trained on a prepared text corpus on the CPU (the README's "Train on text").

Prepare shards with a trained tokenizer and a validation split, here from the repository's own
text (every checkout has it):

  python -m lalte_jax.data.prepare --input docs/*.md lalte_jax --text-suffix .md \\
      --text-suffix .py --output-dir runs/text_data --seq-len 256 --train-tokenizer 2048 \\
      --val-fraction 0.1

then train (`data_dir` defaults to runs/text_data; the model's vocabulary is the corpus's):

  python -m lalte_jax.train --config tiny_text [--set data_dir=DIR]

The validation loss, perplexity and bits per byte are logged every `eval_every` steps (and before
the first); the export in runs/tiny_text/export holds the corpus's tokenizer, so
`python -m lalte_jax.generate --checkpoint runs/tiny_text/export --prompt "def "` prints text.
"""

from lalte_jax.train.config import TrainConfig


def get_config() -> TrainConfig:
  return TrainConfig(
      variant="lalte", size="tiny", model_dtype="float32",
      data="pretokenized", data_dir="runs/text_data", seq_len=256,
      global_batch_size=8, grad_accum_steps=1,
      steps=80, warmup_steps=8, lr=1e-2, lr_min_ratio=0.1,
      seed=42, output_dir="runs/tiny_text", log_every=10, eval_every=20, eval_batches=4,
      checkpoint_every=40, checkpoint_keep=2, tensorboard=False)
