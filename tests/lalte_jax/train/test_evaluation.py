"""Validation during pretraining: the trainer evaluates a corpus's held-out documents every
`eval_every` steps, with values equal to a direct computation on those documents; the model's
vocabulary comes from the corpus; a model vocabulary too small is a one-line error."""

import json
import math
import pathlib

import numpy as np
import pytest

from lalte_jax.data import IGNORE_LABEL, heldout, load_tokenizer, prepare
from lalte_jax.data.pretokenized import read_metadata
from lalte_jax.inference import checkpoint
from lalte_jax.inference import cli as generate_cli
from lalte_jax.train import cli as train_cli
from lalte_jax.train.config import TrainConfig, load_config
from lalte_jax.train.metrics import MetricsLogger
from lalte_jax.train.trainer import Trainer, with_labels

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Byte-level shards (vocabulary 258) of 60 documents, a quarter of them held out."""
  root = tmp_path_factory.mktemp("corpus")
  (root / "in").mkdir()
  for i in range(60):
    (root / "in" / f"{i:03d}.txt").write_text(f"document {i}: " + "the cat sat on the mat. " * (
        1 + i % 3))
  prepare.run(["--input", str(root / "in"), "--output-dir", str(root / "out"), "--seq-len", "32",
               "--val-fraction", "0.25", "--no-progress"])
  return root / "out"


def _config(corpus, tmp_path, **changes) -> TrainConfig:
  settings = dict(variant="transformer", size="tiny", model_dtype="float32", data="pretokenized",
                  data_dir=str(corpus), seq_len=32, global_batch_size=4, steps=4, warmup_steps=1,
                  lr=1e-2, log_every=1, eval_every=2, eval_batches=2, output_dir=str(tmp_path),
                  tensorboard=False, progress_bar=False)
  return TrainConfig(**{**settings, **changes})


def _direct_loss(model, sequences: np.ndarray) -> tuple[float, int]:
  """Summed next-token NLL (nats) and scored tokens of `sequences`, from the model's logits."""
  batch = with_labels({"tokens": sequences})
  shifted = np.asarray(model(batch["tokens"]), np.float64)
  shifted -= shifted.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  labels = batch["labels"]
  scored = labels != IGNORE_LABEL
  picked = np.take_along_axis(log_probs, np.where(scored, labels, 0)[..., None], -1)[..., 0]
  return float(-(picked * scored).sum()), int(scored.sum())


def test_model_vocabulary_smaller_than_the_data_is_a_one_line_error(corpus, tmp_path):
  config = _config(corpus, tmp_path, model_overrides={"vocab_size": 256})
  with pytest.raises(ValueError) as error:
    Trainer(config)
  message = str(error.value)
  assert "\n" not in message
  assert "model.vocab_size=256 is smaller than the vocabulary" in message
  assert "set model.vocab_size=258" in message
  # An explicit size that holds the data is kept; without one the data's is taken.
  bigger = _config(corpus, tmp_path, model_overrides={"vocab_size": 300})
  assert bigger.with_data_vocab().model_config().vocab_size == 300
  assert _config(corpus, tmp_path).with_data_vocab().model_config().vocab_size == 258
  with pytest.raises(ValueError, match="TrainConfig.data_dir: .*metadata.json not found"):
    _config(tmp_path, tmp_path).with_data_vocab()
  # Config files get the corpus's vocabulary, and load before their corpus exists.
  assert load_config("tiny_text", [f"data_dir={corpus}"]).model_config().vocab_size == 258
  assert load_config("tiny_text", [f"data_dir={tmp_path}"]).model_config().vocab_size == 256


@pytest.mark.slow
def test_tiny_text_on_the_repository_text_validates_and_generates_text(tmp_path):
  """The README's "Train on text" path, shortened: shards and a BPE tokenizer from the
  repository's own text, configs/tiny_text.py for 4 steps through the CLI with validation every 2
  (values checked against a direct computation on the held-out sequences), then generation with
  the tokenizer the export holds."""
  data, run = tmp_path / "text_data", tmp_path / "tiny_text"
  # Each non-empty line is a document here, so that the validation split never depends on how
  # many files the repository has.
  assert prepare.main(["--input", str(ROOT / "README.md"), str(ROOT / "docs" / "design.md"),
                       "--text-suffix", ".md", "--txt-document", "line", "--output-dir",
                       str(data), "--seq-len", "64", "--train-tokenizer", "320",
                       "--val-fraction", "0.1", "--no-progress"]) == 0
  settings = {"data_dir": data, "output_dir": run, "steps": 4, "warmup_steps": 1, "eval_every": 2,
              "seq_len": 64, "global_batch_size": 4, "eval_batches": 1, "checkpoint_every": 0,
              "model_dtype": "float32", "progress_bar": "false"}
  overrides = [argument for key, value in settings.items()
               for argument in ("--set", f"{key}={value}")]
  assert train_cli.main(["--config", "tiny_text", *overrides]) == 0
  records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  evaluated = {r["step"]: r for r in records if "eval_loss" in r}
  assert sorted(evaluated) == [0, 2, 4]  # before the first step, every 2 steps, at the end
  assert evaluated[4]["eval_perplexity"] < evaluated[0]["eval_perplexity"]
  for record in evaluated.values():
    assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))

  # The final values from the validation sequences directly (eval_batches x 4 rows, in order).
  export = run / "export"
  model = checkpoint.load_params(export)
  assert model.config.vocab_size == read_metadata(data)["vocab_size"]  # from the corpus
  validation = heldout.validation_source(data)
  assert validation.split == "validation"
  nll, scored = _direct_loss(model, np.stack([validation[i]["tokens"] for i in range(4)]))
  final = evaluated[4]
  assert final["eval_scored_tokens"] == scored == 4 * 63
  assert final["eval_loss"] == pytest.approx(nll / scored, rel=1e-5)
  split = validation.metadata["validation"]
  bits_per_byte = nll / (scored * split["num_bytes"] / split["num_tokens"] * math.log(2))
  assert final["eval_bits_per_byte"] == pytest.approx(bits_per_byte, rel=1e-5)
  # ... which the training sequences would not give.
  train = heldout.training_source(data)
  train_nll, train_scored = _direct_loss(model, np.stack([train[i]["tokens"] for i in range(4)]))
  assert abs(train_nll / train_scored - final["eval_loss"]) > 1e-3

  tokenizer = load_tokenizer(data)
  assert load_tokenizer(export).encode("def main") == tokenizer.encode("def main")
  arguments = ["--checkpoint", str(export), "--prompt", "The model", "--max-new-tokens", "8"]
  (text,) = generate_cli.run(arguments)  # the export's tokenizer, found without --tokenizer
  (ids,) = generate_cli.run([*arguments, "--print-ids"])
  assert text == tokenizer.decode([int(i) for i in ids.split(",")])
  assert text and "\ufffd" not in text


def test_progress_bar_keeps_the_latest_evaluation(tmp_path):
  logger = MetricsLogger(tmp_path, total_steps=4, tensorboard=False, progress_bar=True)
  logger.log(0, {"eval_loss": 5.0, "eval_perplexity": 148.4, "eval_scored_tokens": 252})
  logger.log(1, {"loss": 4.5, "lr": 1e-3})
  postfix = logger._bar.postfix  # pylint: disable=protected-access
  logger.close()
  assert postfix == "loss=4.5, lr=0.001, eval_loss=5, eval_perplexity=148"
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert records[0]["eval_perplexity"] == 148.4 and records[1]["loss"] == 4.5
