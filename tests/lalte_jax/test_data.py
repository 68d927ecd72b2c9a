"""lalte_jax.data: synthetic tasks, tokenizers, prepare_data -> shards, the Grain pipeline."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from lalte_jax.data import (IGNORE_LABEL, MQARSource, PasskeySource, PretokenizedSource,
                            load_tokenizer, make_dataset, score_recall)
from lalte_jax.data import prepare, synthetic
from lalte_jax.data.pretokenized import pack_documents



def _assert_same_example(a, b):
  assert a.keys() == b.keys()
  for field in a:
    np.testing.assert_array_equal(a[field], b[field])


# ------------------------------------------------------------------------------------------------
# Synthetic tasks

_MQAR = MQARSource(num_examples=50, seq_len=128, vocab_size=96, num_kv_pairs=8, seed=3)


@pytest.mark.parametrize("source", [_MQAR, PasskeySource(num_examples=50, seq_len=200,
                                                         vocab_size=64, seed=3)])
def test_generators_are_deterministic_by_seed_and_index(source):
  _assert_same_example(source[7], dataclasses.replace(source)[7])
  assert not np.array_equal(source[7]["tokens"], source[8]["tokens"])
  other_seed = dataclasses.replace(source, seed=4)
  assert not np.array_equal(source[7]["tokens"], other_seed[7]["tokens"])
  for field in ("tokens", "labels"):
    assert source[7][field].dtype == np.int32 and source[7][field].shape == (source.seq_len,)
  with pytest.raises(IndexError):
    source[len(source)]


def _mqar_pairs(source, example):
  """(keys, values, query positions) read back from an example."""
  kv = example["tokens"][:source.kv_region_len]
  query_positions = np.flatnonzero(example["labels"] != IGNORE_LABEL)
  return kv[0::2], kv[1::2], query_positions


@pytest.mark.parametrize("random_non_queries", [True, False])
def test_mqar_format(random_non_queries):
  source = dataclasses.replace(_MQAR, random_non_queries=random_non_queries)
  half = source.vocab_size // 2
  for index in range(20):
    example = source[index]
    tokens, labels = example["tokens"], example["labels"]
    keys, values, query_positions = _mqar_pairs(source, example)
    assert ((keys >= source.num_reserved_ids) & (keys < half)).all()
    assert ((values >= half) & (values < source.vocab_size)).all()
    assert len(set(keys)) == len(set(values)) == source.num_kv_pairs
    # One query per key, in the query region at the start of a two-token slot.
    assert len(query_positions) == source.num_kv_pairs
    assert (query_positions >= source.kv_region_len).all()
    assert ((query_positions - source.kv_region_len) % 2 == 0).all()
    assert sorted(tokens[query_positions]) == sorted(keys)
    # The label at a query is the value bound to the queried key.
    value_of = dict(zip(keys, values))
    assert [value_of[k] for k in tokens[query_positions]] == list(labels[query_positions])
    filler = np.delete(tokens, np.concatenate([np.arange(source.kv_region_len), query_positions]))
    if random_non_queries:
      assert filler.min() >= source.num_reserved_ids and filler.max() < source.vocab_size
    else:
      assert (filler == synthetic.PAD_ID).all()


def test_mqar_queries_follow_zoology_power_law():
  # P(slot s) ~ (s+1)^-0.99: about 85% of queries fall in the first half of the 56 slots.
  slots = np.concatenate([(_mqar_pairs(_MQAR, _MQAR[i])[2] - _MQAR.kv_region_len) // 2
                          for i in range(len(_MQAR))])
  assert np.mean(slots < 28) > 0.7


def test_mqar_long_gap_puts_every_pair_beyond_min_gap():
  window = 48  # e.g. SWA window_size=48: the pair must be >= 48 positions back
  long_gap = dataclasses.replace(_MQAR, seq_len=192, min_gap=window - 1)
  short_gaps = 0
  for index in range(len(long_gap)):
    for source in (long_gap, dataclasses.replace(long_gap, min_gap=0)):
      example = source[index]
      keys, _, query_positions = _mqar_pairs(source, example)
      queried = example["tokens"][query_positions]
      key_positions = 2 * np.array([list(keys).index(k) for k in queried])
      value_gaps = query_positions - (key_positions + 1)
      if source.min_gap:
        assert (value_gaps > window - 1).all()
        assert (query_positions - key_positions >= window).all()
      else:
        short_gaps += int((value_gaps <= window - 1).sum())
  assert short_gaps > 0  # the plain task does query inside the window, so the check has teeth


def test_mqar_filler_prefix_and_roles():
  source = dataclasses.replace(_MQAR, seq_len=192, prefix_len=6, min_gap=47)
  assert source.query_start == 6 + 2 * source.num_kv_pairs
  for index in range(10):
    tokens, labels = source[index]["tokens"], source[index]["labels"]
    roles = source.roles(index)
    np.testing.assert_array_equal(roles["query"], np.flatnonzero(labels != IGNORE_LABEL))
    # Each query's value sits right after its key in the key-value region that follows the
    # prefix, more than min_gap positions before the query.
    np.testing.assert_array_equal(tokens[roles["value"]], labels[roles["query"]])
    np.testing.assert_array_equal(tokens[roles["value"] - 1], tokens[roles["query"]])
    assert (roles["value"] >= 7).all() and (roles["value"] < source.query_start).all()
    assert (roles["query"] - roles["value"] > 47).all()
    filler = roles["filler"]
    assert filler[:6].all() and not filler[6:source.query_start].any()
    assert not filler[roles["query"]].any()
    assert filler.sum() == 192 - 2 * source.num_kv_pairs - source.num_kv_pairs


@pytest.mark.parametrize("bad", [dict(num_kv_pairs=60), dict(seq_len=20), dict(min_gap=200),
                                 dict(vocab_size=10), dict(seed=-1), dict(prefix_len=-1),
                                 dict(prefix_len=100)])
def test_mqar_rejects_impossible_configs(bad):
  with pytest.raises(ValueError, match="MQARSource"):
    dataclasses.replace(_MQAR, **bad)


def test_passkey_layout_and_labels():
  source = PasskeySource(num_examples=40, seq_len=300, vocab_size=64, seed=0, num_digits=7,
                         key_len=2, haystack_pattern_len=10)
  pattern = source.haystack_pattern()
  cuts = set()
  for index in range(len(source)):
    example = source[index]
    tokens, labels = example["tokens"], example["labels"]
    prompt, answer = source.prompt_and_answer(index)
    np.testing.assert_array_equal(np.concatenate([prompt, answer]), tokens)
    assert tokens[0] == synthetic.PAD_ID
    # Labels: exactly the answer, predicted from the position before each answer digit.
    scored = np.flatnonzero(labels != IGNORE_LABEL)
    np.testing.assert_array_equal(scored, np.arange(source.answer_start - 1, source.seq_len - 1))
    np.testing.assert_array_equal(labels[scored], answer)
    digits = answer - synthetic.FIRST_DIGIT_ID
    assert ((digits >= 0) & (digits <= 9)).all() and digits[0] != 0
    # One needle "NEEDLE key IS value", and the question asks for the same key.
    (needle_at,) = np.flatnonzero(tokens == synthetic.NEEDLE_ID)
    key = tokens[needle_at + 1:needle_at + 3]
    np.testing.assert_array_equal(tokens[needle_at + 3:needle_at + 11],
                                  np.concatenate([[synthetic.IS_ID], answer]))
    np.testing.assert_array_equal(prompt[-4:], np.concatenate([[synthetic.QUERY_ID], key,
                                                               [synthetic.IS_ID]]))
    # The needle sits between whole pattern repetitions of the haystack.
    cut = needle_at - 1
    assert cut % len(pattern) == 0
    haystack = np.concatenate([tokens[1:needle_at], tokens[needle_at + 11:source.answer_start - 4]])
    np.testing.assert_array_equal(haystack, np.resize(pattern, source.haystack_len))
    cuts.add(cut)
  assert len(cuts) > 5  # depths vary across examples


def test_score_recall():
  labels = np.array([[IGNORE_LABEL, 5, IGNORE_LABEL, 7], [3, IGNORE_LABEL, IGNORE_LABEL, 2]])
  predictions = np.array([[9, 5, 9, 1], [3, 9, 9, 2]])
  assert score_recall(predictions, labels) == pytest.approx(3 / 4)
  np.testing.assert_allclose(score_recall(predictions, labels, per_example=True), [0.5, 1.0])
  logits = np.eye(10)[predictions]  # [B, T, V] whose argmax is `predictions`
  assert score_recall(logits, labels) == pytest.approx(3 / 4)
  example = _MQAR[0]
  assert score_recall(example["labels"], example["labels"]) == 1.0
  with pytest.raises(ValueError, match="no scored"):
    score_recall(predictions, np.full_like(labels, IGNORE_LABEL))


# ------------------------------------------------------------------------------------------------
# Tokenizers

_TEXTS = ["Hello, world!", "Ünïcödé → 漢字 and emoji 🙂", "  spaces\tand\nnewlines  "]


def test_byte_tokenizer_round_trip():
  tokenizer = load_tokenizer(None)
  assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)
  for text in _TEXTS:
    ids = tokenizer.encode(text)
    assert max(ids) < 256 and tokenizer.decode(ids) == text
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == text


def _tiny_hf_tokenizer(path):
  tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(_TEXTS * 4, trainer=trainer)
  tokenizer.save(str(path))
  return path


def test_hf_tokenizer_round_trip_and_special_tokens(tmp_path):
  tokenizer = load_tokenizer(_tiny_hf_tokenizer(tmp_path / "tokenizer.json"))
  assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
  for text in _TEXTS:
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert tokenizer.encode_batch(_TEXTS) == [tokenizer.encode(text) for text in _TEXTS]
  # A tokenizer_config.json beside the file (or an explicit flag) names the specials.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "</s>"}}))
  assert load_tokenizer(tmp_path).bos_id == 2
  assert load_tokenizer(tmp_path, bos_token="<pad>").bos_id == 0
  with pytest.raises(ValueError, match="not in the vocabulary"):
    load_tokenizer(tmp_path, bos_token="<nope>")


def test_sentencepiece_round_trip(tmp_path):
  sentencepiece = pytest.importorskip("sentencepiece", reason="`sentencepiece` is not installed")
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog"
                               for i in range(50)))
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe",
      byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
  tokenizer = load_tokenizer(tmp_path / "sp.model")
  assert tokenizer.bos_id is not None and tokenizer.vocab_size > 256
  assert tokenizer.decode(tokenizer.encode("the lazy fox 7")) == "the lazy fox 7"


def test_tokenizer_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_tokenizer(tmp_path / "missing.json")
  (tmp_path / "vocab.txt").write_text("a b c")
  with pytest.raises(ValueError, match="unknown tokenizer file"):
    load_tokenizer(tmp_path / "vocab.txt")
  with pytest.raises(ValueError, match="no tokenizer.json"):
    load_tokenizer(tmp_path)


# ------------------------------------------------------------------------------------------------
# prepare_data -> ArrayRecord shards -> PretokenizedSource


def test_prepare_data_packs_documents_into_shards(tmp_path):
  documents = [f"document {i}: " + "lorem ipsum " * (i % 7) for i in range(30)]
  (tmp_path / "in").mkdir()
  (tmp_path / "in/a.txt").write_text(documents[0])
  (tmp_path / "in/b.txt").write_text("\n".join(documents[1:10]))  # one document per file
  (tmp_path / "c.jsonl").write_text(
      "\n".join(json.dumps({"body": doc, "id": i}) for i, doc in enumerate(documents[10:20])))
  inputs = [str(tmp_path / "in"), str(tmp_path / "c.jsonl")]
  expected_texts = [documents[0], "\n".join(documents[1:10]), *documents[10:20]]
  try:
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.table({"body": documents[20:]}), tmp_path / "d.parquet")
    inputs.append(str(tmp_path / "d.parquet"))
    expected_texts += documents[20:]
  except ImportError:
    pass  # parquet input is covered where pyarrow is installed

  seq_len = 32
  metadata = prepare.run([
      "--input", *inputs, "--output-dir", str(tmp_path / "out"), "--seq-len", str(seq_len),
      "--text-field", "body", "--sequences-per-shard", "5", "--no-progress"])

  byte_tokenizer = load_tokenizer(None)
  stream = np.concatenate([[byte_tokenizer.bos_id, *byte_tokenizer.encode(text)]
                           for text in expected_texts])
  num_sequences = len(stream) // seq_len
  expected = stream[:num_sequences * seq_len].reshape(num_sequences, seq_len)
  np.testing.assert_array_equal(pack_documents(
      [byte_tokenizer.encode(text) for text in expected_texts], seq_len, byte_tokenizer.bos_id),
      expected)

  source = PretokenizedSource(tmp_path / "out")
  assert len(source) == num_sequences == metadata["num_sequences"]
  assert len(metadata["shards"]) == -(-num_sequences // 5) > 1
  assert metadata["num_documents"] == len(expected_texts)
  assert metadata["num_dropped_tokens"] == len(stream) - num_sequences * seq_len
  assert (source.seq_len, source.vocab_size) == (seq_len, 258)
  read_back = np.stack([source[i]["tokens"] for i in range(len(source))])
  assert read_back.dtype == np.int32
  np.testing.assert_array_equal(read_back, expected)

  # The pipeline reads the corpus in order when not shuffled.
  batches = make_dataset(source, batch_size_per_process=2, seed=0, shuffle=False, process_index=0,
                         process_count=1, num_epochs=1)
  tokens = np.concatenate([batch["tokens"] for batch in batches])
  np.testing.assert_array_equal(tokens, expected[:len(tokens)])
  assert len(tokens) == num_sequences // 2 * 2


def test_prepare_data_refuses_bad_inputs(tmp_path):
  prepare_data = prepare
  (tmp_path / "a.csv").write_text("x")
  with pytest.raises(ValueError, match="unsupported input"):
    prepare_data.run(["--input", str(tmp_path / "a.csv"), "--output-dir", str(tmp_path / "o")])
  (tmp_path / "a.jsonl").write_text(json.dumps({"content": "x"}))
  with pytest.raises(ValueError, match="no field 'text' .*--text-field"):
    prepare_data.run(["--input", str(tmp_path / "a.jsonl"), "--output-dir", str(tmp_path / "o"),
                       "--no-progress"])
  with pytest.raises(FileNotFoundError, match="metadata.json"):
    PretokenizedSource(tmp_path)


# ------------------------------------------------------------------------------------------------
# Pipeline


@dataclasses.dataclass(frozen=True)
class _IdentitySource:
  """Element i = tokens [i, i + 1]: batches show which records they hold."""
  size: int
  vocab_size: int = 1000

  def __len__(self):
    return self.size

  def __getitem__(self, index):
    return {"tokens": np.array([index, index + 1])}


def _pipeline(source, **overrides):
  options = dict(batch_size_per_process=4, seed=5, shuffle=True, process_index=0, process_count=1)
  return make_dataset(source, **{**options, **overrides})


@pytest.mark.parametrize("process_count", [1, 2])
def test_iterator_resumes_exactly(process_count):
  # 48 examples / (4 x process_count) per step: the 14 steps after the save cross an epoch boundary.
  source = dataclasses.replace(_MQAR, num_examples=48)
  options = dict(process_count=process_count, process_index=process_count - 1)
  iterator = _pipeline(source, **options)
  for _ in range(5):
    next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))  # what a checkpoint stores
  expected = [next(iterator) for _ in range(14)]
  restored = _pipeline(source, **options)
  restored.set_state(state)
  for batch, reference in zip([next(restored) for _ in range(14)], expected):
    _assert_same_example(batch, reference)
    assert batch["tokens"].shape == batch["labels"].shape == (4, source.seq_len)


def test_epochs_are_permutations_reshuffled_each_epoch():
  iterator = _pipeline(_IdentitySource(24), batch_size_per_process=6)
  epochs = [np.concatenate([next(iterator)["tokens"][:, 0] for _ in range(4)]) for _ in range(2)]
  for order in epochs:
    assert sorted(order) == list(range(24))
  assert list(epochs[0]) != list(epochs[1]) != list(range(24))


def test_process_shards_are_disjoint_and_cover_the_data():
  source = _IdentitySource(30)
  per_process = [[batch["tokens"][:, 0] for batch in _pipeline(
      source, batch_size_per_process=2, process_index=p, process_count=3, num_epochs=2)]
                 for p in range(3)]
  assert [len(batches) for batches in per_process] == [10, 10, 10]  # 2 x 30 / (2 x 3)
  for epoch in range(2):  # 5 steps of 6 records make one epoch
    records = np.concatenate([np.concatenate(batches[5 * epoch:5 * epoch + 5])
                              for batches in per_process])
    assert sorted(records) == list(range(30))  # disjoint (no repeat) and covering
  # Global step k holds the same records whatever the number of processes reading them ...
  def step_records(process_count):
    batch = 12 // process_count
    iterators = [_pipeline(source, batch_size_per_process=batch, process_index=p,
                           process_count=process_count) for p in range(process_count)]
    return [list(np.concatenate([next(it)["tokens"][:, 0] for it in iterators]))
            for _ in range(5)]
  # ... in the same rows: process p holds rows [p*b, (p+1)*b) of the one-process batch.
  assert step_records(1) == step_records(2) == step_records(4)


def test_uneven_source_keeps_processes_in_lockstep():
  per_process = [list(_pipeline(_IdentitySource(23), batch_size_per_process=2, process_index=p,
                                process_count=3, num_epochs=1)) for p in range(3)]
  assert [len(batches) for batches in per_process] == [3, 3, 3]  # 23 // 6 global batches
  records = np.concatenate([b["tokens"][:, 0] for batches in per_process for b in batches])
  assert len(set(records)) == 18


def test_out_of_vocabulary_ids_are_refused():
  message = r"record 9 of _IdentitySource.*token id 10 is outside the vocabulary \[0, 10\)"
  with pytest.raises(ValueError, match=message):
    list(_pipeline(_IdentitySource(12), vocab_size=10, shuffle=False, num_epochs=1))
  with pytest.raises(ValueError, match="process_index"):
    _pipeline(_IdentitySource(12), process_index=2, process_count=2)


def test_prepare_data_streams_a_hf_dataset_offline(tmp_path, monkeypatch):
  """--hf-dataset streams through `datasets.load_dataset(..., streaming=True)`; a stand-in module
  replaces the real one, so nothing goes online. --max-tokens stops the stream early."""
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  calls = []

  def load_dataset(name, config, *, split, streaming):
    calls.append((name, config, split, streaming))
    return ({"text": f"streamed document {i} " * 3, "id": i} for i in range(10_000))

  monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
  metadata = prepare.run([
      "--hf-dataset", "org/corpus", "--hf-config", "sample", "--output-dir", str(tmp_path / "out"),
      "--seq-len", "64", "--max-tokens", "5000", "--no-progress"])
  assert calls == [("org/corpus", "sample", "train", True)]
  assert 5000 <= metadata["num_tokens"] < 5000 + 256 * 70  # stopped within one encode batch
  assert metadata["inputs"] == ["hf:org/corpus/sample:train"]
  assert PretokenizedSource(tmp_path / "out").seq_len == 64
  with pytest.raises(ValueError, match="no field 'body'"):
    prepare.run(["--hf-dataset", "org/corpus", "--text-field", "body",
                               "--output-dir", str(tmp_path / "out2"), "--no-progress"])
