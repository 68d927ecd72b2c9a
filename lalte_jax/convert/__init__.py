"""The authors' Hugging Face checkpoints: `load_hf(path) -> HybridLM`, `save_hf(model_or_export,
out_dir)`, and the CLI `python -m lalte_jax.convert from-hf | to-hf` (`lalte-convert`)."""

from lalte_jax.convert.api import copy_tokenizer, load_hf, read_hf, save_hf, write_hf

__all__ = ["copy_tokenizer", "load_hf", "read_hf", "save_hf", "write_hf"]
