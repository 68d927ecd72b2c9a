"""EVAPORATE adapter on hand-made JSONL fixtures: loading, truncation, contains scoring."""

import json

import pytest

from lalte_jax.data.tokenizer import ByteTokenizer
from lalte_jax.eval import decoding, evaporate
from tests.lalte_jax.eval.helpers import tiny_model

FIXTURE = [
    {"text": "Device: Acme Pump. Applicant: Zed Corp.\nApplicant:", "value": "Zed Corp"},
    {"text": "Title: The Hobbit. Author: J. R. R. Tolkien.\nAuthor:", "value": ["Tolkien", "JRRT"]},
    {"text": "Q: capital of France? A:", "value": "Paris"},
]


def write_fixture(tmp_path, name="squad"):
  path = tmp_path / f"{name}.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in FIXTURE) + "\n")
  return path


def test_contains_score_and_stop():
  assert evaporate.contains_score(" zed corp and more", ["Zed Corp"]) == 1
  assert evaporate.contains_score("J.R.R.", ["Tolkien", "JRRT"]) == 0
  assert evaporate.contains_score("a+b", ["A+B"]) == 1  # literal, not a regex
  assert evaporate.cut_at_stop(" Paris\nQ: next") == " Paris"


def test_load_documents_and_errors(tmp_path):
  documents = evaporate.load_documents(write_fixture(tmp_path))
  assert [d.answers for d in documents] == [("Zed Corp",), ("Tolkien", "JRRT"), ("Paris",)]
  assert len(evaporate.load_documents(write_fixture(tmp_path), limit=2)) == 2
  (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1"):
    evaporate.load_documents(tmp_path / "bad.jsonl")
  with pytest.raises(ValueError, match="does not exist"):
    evaporate.load_documents(tmp_path / "missing.jsonl")


def test_long_prompts_are_cut_around_the_answer():
  ids = list(range(100))
  assert evaporate.truncate_around_answer(ids, 60, context_length=200, answer_length=10) == ids
  window = evaporate.truncate_around_answer(ids, 60, context_length=30, answer_length=10)
  assert window == list(range(50, 70))  # 20 ids, half before the answer
  assert evaporate.truncate_around_answer(ids, 95, context_length=30, answer_length=10) \
      == list(range(80, 100))
  assert evaporate.truncate_around_answer(ids, None, context_length=30, answer_length=10) \
      == list(range(80, 100))
  document = evaporate.Document("x" * 50 + "ANSWER" + "y" * 50, ("answer",))
  encode = ByteTokenizer().encode
  prompt = evaporate.build_prompt(document, encode, context_length=40, answer_length=20)
  assert bytes(prompt).decode() == "x" * 10 + "ANSWERyyyy"


def test_evaluate_scores_the_continuations(tmp_path, monkeypatch):
  documents = evaporate.load_documents(write_fixture(tmp_path))
  tokenizer = ByteTokenizer()
  outputs = [" zed corp\nmore", " Bilbo", "paris"]
  seen = {}

  def fake_generate(model, prompts, max_new_tokens, **kwargs):
    seen["prompts"], seen["max_new_tokens"] = prompts, max_new_tokens
    return [tokenizer.encode(o) for o in outputs]

  monkeypatch.setattr(decoding, "greedy_generate", fake_generate)
  result = evaporate.evaluate_evaporate(None, documents, tokenizer.encode, tokenizer.decode)
  assert result["score"] == pytest.approx(200 / 3)
  assert seen["max_new_tokens"] == 48 and seen["prompts"][2] == tokenizer.encode(FIXTURE[2]["text"])
  assert result["samples"][0]["prediction"] == " zed corp"


@pytest.mark.slow
def test_evaluate_runs_on_a_tiny_model(tmp_path):
  documents = evaporate.load_documents(write_fixture(tmp_path))
  tokenizer = ByteTokenizer()
  result = evaporate.evaluate_evaporate(tiny_model("gdn"), documents, tokenizer.encode,
                                        tokenizer.decode, max_new_tokens=4, batch_size=2)
  assert result["num_examples"] == 3 and 0.0 <= result["score"] <= 100.0


def test_export_without_the_datasets_package_is_a_clear_error(tmp_path):
  try:
    import datasets  # pylint: disable=import-outside-toplevel,unused-import
    pytest.skip("datasets is installed; exporting would need the network")
  except ImportError:
    pass
  with pytest.raises(ValueError, match="needs the `datasets` package"):
    evaporate.export_hf_dataset("hazyresearch/based-fda", tmp_path / "fda.jsonl")
