"""lalte-prepare-data's validation split, trained tokenizer, text suffixes and one-line errors;
the held-out data of a prepared corpus (lalte_jax.data.heldout) shares no document with training."""

import re

import numpy as np
import pytest

from lalte_jax.data import IGNORE_LABEL, heldout, load_tokenizer, prepare
from lalte_jax.data.pretokenized import PretokenizedSource

BYTES = load_tokenizer(None)


def _write_documents(directory, count: int) -> list[str]:
  """`count` .txt files, one document each, starting with their index ("doc 007: ...")."""
  directory.mkdir(parents=True, exist_ok=True)
  words = ["alpha", "beta", "gamma", "delta"]
  texts = [f"doc {i:03d}: " + " ".join(words[:1 + i % 4]) * (1 + i % 3) for i in range(count)]
  for i, text in enumerate(texts):
    (directory / f"{i:03d}.txt").write_text(text)
  return texts


def _document_ids(source) -> list[int]:
  """The indices of the documents that start in `source` (its stream split at BOS)."""
  stream = np.concatenate([source[i]["tokens"] for i in range(len(source))])
  starts = np.flatnonzero(stream == BYTES.bos_id)
  texts = [BYTES.decode(stream[a + 1:b]) for a, b in zip(starts, [*starts[1:], len(stream)])]
  return [int(re.match(r"doc (\d{3}):", text).group(1)) for text in texts]


def test_validation_split_holds_whole_documents_chosen_by_their_index(tmp_path):
  _write_documents(tmp_path / "in", 60)
  metadata = prepare.run(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out"),
                          "--seq-len", "32", "--val-fraction", "0.25", "--no-progress"])
  chosen = {i for i in range(60) if heldout.held_out_document(i, 0.25)}
  assert 5 < len(chosen) < 25  # about a quarter
  train, validation = (heldout.training_source(tmp_path / "out"),
                       heldout.validation_source(tmp_path / "out"))
  train_ids, validation_ids = _document_ids(train), _document_ids(validation)
  assert not set(train_ids) & set(validation_ids)  # disjoint at the document level
  assert set(validation_ids) <= chosen and set(train_ids) <= set(range(60)) - chosen
  # Every document is there except the last one of each split, whose tail may have been dropped.
  assert set(validation_ids) >= set(sorted(chosen)[:-1])
  assert metadata["validation"]["num_documents"] == len(chosen)
  assert metadata["num_documents"] + len(chosen) == 60
  assert metadata["validation"]["fraction"] == 0.25 and "blake2b" in metadata["validation"][
      "selection"]
  assert len(validation) == metadata["validation"]["num_sequences"] > 0
  texts = [(tmp_path / "in" / f"{i:03d}.txt").read_text() for i in sorted(chosen)]
  assert metadata["validation"]["num_bytes"] == sum(len(t.encode()) for t in texts)
  assert validation.bytes_per_token == pytest.approx(
      metadata["validation"]["num_bytes"] / metadata["validation"]["num_tokens"])


def test_corpus_without_a_validation_split_holds_out_its_last_shard(tmp_path):
  _write_documents(tmp_path / "in", 40)
  metadata = prepare.run(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "out"),
                          "--seq-len", "32", "--sequences-per-shard", "8", "--no-progress"])
  last = metadata["shards"][-1]["num_sequences"]
  train, validation = (heldout.training_source(tmp_path / "out"),
                       heldout.validation_source(tmp_path / "out"))
  assert len(train) + len(validation) == metadata["num_sequences"] and len(validation) == last
  everything = PretokenizedSource(tmp_path / "out")
  held_out = np.stack([everything[len(train) + i]["tokens"] for i in range(last)])
  elements = [validation[i] for i in range(last)]
  np.testing.assert_array_equal(np.stack([e["tokens"] for e in elements]), held_out)
  # Scored from the first BOS of the held-out shard on: what comes before it ends a document that
  # began in the training shards.
  labels = np.concatenate([e["labels"] for e in elements])
  stream = held_out.reshape(-1)
  first_bos = int(np.flatnonzero(stream == BYTES.bos_id)[0])
  assert 0 < first_bos and (labels[:first_bos] == IGNORE_LABEL).all()
  for row, element in enumerate(elements):
    scored = element["labels"] != IGNORE_LABEL
    assert (scored[:-1] == (np.arange(row * 32, row * 32 + 31) >= first_bos)).all()
    np.testing.assert_array_equal(element["labels"][:-1][scored[:-1]],
                                  element["tokens"][1:][scored[:-1]])
  scored_ids = _document_ids(validation.source)  # the documents starting in the shard
  assert not set(scored_ids) & set(_document_ids(train))
  # A single shard has no held-out part.
  prepare.run(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "one"),
               "--seq-len", "32", "--no-progress"])
  assert heldout.validation_source(tmp_path / "one") is None
  assert len(heldout.training_source(tmp_path / "one")) == len(everything)


def test_trained_tokenizer_is_deterministic_and_kept_beside_the_shards(tmp_path):
  _write_documents(tmp_path / "in", 30)
  arguments = ["--input", str(tmp_path / "in"), "--seq-len", "16", "--train-tokenizer", "300",
               "--val-fraction", "0.2", "--no-progress"]
  metadata = prepare.run([*arguments, "--output-dir", str(tmp_path / "a")])
  prepare.run([*arguments, "--output-dir", str(tmp_path / "b")])
  trained = [(tmp_path / name / "tokenizer.json").read_bytes() for name in ("a", "b")]
  assert trained[0] == trained[1]
  tokenizer = load_tokenizer(tmp_path / "a")  # the directory: its tokenizer.json
  assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1) == (metadata["bos_id"], metadata["eos_id"])
  assert metadata["vocab_size"] == tokenizer.vocab_size <= 300
  assert metadata["tokenizer_file"] == "tokenizer.json"
  assert metadata["tokenizer_training"]["max_vocab_size"] == 300
  text = "doc 999: gamma delta, ünïcödé"
  assert tokenizer.decode(tokenizer.encode(text)) == text
  assert len(tokenizer.encode("alpha beta gamma")) < len("alpha beta gamma")  # merges learned
  # A given HF tokenizer is copied beside the shards too.
  metadata = prepare.run(["--input", str(tmp_path / "in"), "--seq-len", "16", "--no-progress",
                          "--tokenizer", str(tmp_path / "a/tokenizer.json"),
                          "--output-dir", str(tmp_path / "c")])
  assert metadata["tokenizer_file"] == "tokenizer.json"
  assert load_tokenizer(tmp_path / "c").encode(text) == tokenizer.encode(text)


def test_text_suffixes_read_other_files_as_text(tmp_path):
  (tmp_path / "in").mkdir()
  (tmp_path / "in/notes.md").write_text("# notes\n" * 20)
  (tmp_path / "in/code.py").write_text("print('x')\n" * 20)
  with pytest.raises(ValueError, match="holds no .txt/.jsonl/.parquet file"):
    prepare.run(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "o")])
  metadata = prepare.run(["--input", str(tmp_path / "in"), "--output-dir", str(tmp_path / "o"),
                          "--seq-len", "32", "--text-suffix", ".md", "--text-suffix", ".py",
                          "--no-progress"])
  assert metadata["num_documents"] == 2 and metadata["num_bytes"] == 8 * 20 + 11 * 20


def _bad_inputs(tmp_path):
  """(arguments, message) of each user error; tmp_path holds a small corpus in in/."""
  (tmp_path / "in").mkdir()
  (tmp_path / "in/a.txt").write_text("a short document")
  (tmp_path / "empty").mkdir()
  (tmp_path / "full").mkdir()
  (tmp_path / "full/old.bin").write_text("x")
  (tmp_path / "notes.csv").write_text("x")
  (tmp_path / "vocab.txt").write_text("a b c")
  corpus = ["--input", str(tmp_path / "in")]
  return {
      "empty input directory": (["--input", str(tmp_path / "empty")], "holds no .txt"),
      "non-empty output directory": ([*corpus, "--output-dir", str(tmp_path / "full")],
                                     "is not an empty directory"),
      "sequence longer than the corpus": ([*corpus, "--seq-len", "4096"],
                                          "fewer than one sequence of --seq-len 4096"),
      "unknown suffix": (["--input", str(tmp_path / "notes.csv")],
                         "unsupported input type '.csv'.*--text-suffix .csv"),
      "missing file": (["--input", str(tmp_path / "nope.txt")], "nope.txt does not exist"),
      "missing tokenizer": ([*corpus, "--tokenizer", str(tmp_path / "nope.json")],
                            "tokenizer file .*nope.json does not exist"),
      "not a tokenizer": ([*corpus, "--tokenizer", str(tmp_path / "vocab.txt")],
                          "unknown tokenizer file"),
      "empty validation split": ([*corpus, "--seq-len", "8", "--val-fraction", "0.01"],
                                 "validation split holds 0 tokens"),
      "tiny trained vocabulary": ([*corpus, "--train-tokenizer", "100"], "at least 258 ids"),
  }


_BAD_CASES = ["empty input directory", "non-empty output directory",
              "sequence longer than the corpus", "unknown suffix", "missing file",
              "missing tokenizer", "not a tokenizer", "empty validation split",
              "tiny trained vocabulary"]


@pytest.mark.parametrize("case", _BAD_CASES)
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, case):
  cases = _bad_inputs(tmp_path)
  assert sorted(cases) == sorted(_BAD_CASES)
  arguments, message = cases[case]
  if "--output-dir" not in arguments:
    arguments = [*arguments, "--output-dir", str(tmp_path / "out")]
  assert prepare.main([*arguments, "--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
  assert re.search(message, err), err
  # Nothing is left behind: the output directory is as it was found.
  assert not (tmp_path / "out").exists()
  assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["old.bin"]
