"""Data: synthetic recall tasks, pre-tokenized corpora, tokenizers and the Grain input pipeline.

- `synthetic`: `MQARSource` (zoology MQAR, long-gap with `min_gap`, filler prefix), `PasskeySource`
  (S-NIAH-1 over token ids), `score_recall`; shared by the trainer and the evaluation tasks.
- `curricula`: mixtures of those sources (`RecallMixture`, `StagedCurriculum`) and the named
  training curricula a config selects with `data="curriculum:<name>"`.
- `pretokenized`: `PretokenizedSource` over the ArrayRecord shards `lalte-prepare-data`
  (`lalte_jax/data/prepare.py`) writes; `heldout`: their training and validation data, which
  never share a document.
- `tokenizer`: `load_tokenizer(path)` for HF tokenizers JSON, SentencePiece or bytes;
  `train_bpe` for a byte-level BPE tokenizer trained on a corpus.
- `pipeline`: `make_dataset(...)`, deterministic, checkpointable batches sharded by process.

Every source yields dicts {"tokens": int32 [T], "labels": int32 [T] (optional)}; labels are shifted
(`labels[t]` is the target of `logits[t]`) with `IGNORE_LABEL` = -100 where not scored.
"""

from lalte_jax.data.pipeline import make_dataset
from lalte_jax.data.pretokenized import PretokenizedSource
from lalte_jax.data.synthetic import (IGNORE_LABEL, MQARSource, PasskeySource, example_rng,
                                      score_recall)
from lalte_jax.data.tokenizer import load_tokenizer

__all__ = ["IGNORE_LABEL", "MQARSource", "PasskeySource", "PretokenizedSource", "example_rng",
           "load_tokenizer", "make_dataset", "score_recall"]
