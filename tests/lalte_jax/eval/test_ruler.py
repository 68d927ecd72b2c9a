"""S-NIAH in RULER's format: scoring, determinism, prompt layout, and prompts that fit the target
length with the tokenizer in use (bytes and a tiny HF tokenizer)."""

import functools
import re

import pytest

from lalte_jax.data.tokenizer import ByteTokenizer, encode_prompt
from lalte_jax.eval import ruler
from tests.lalte_jax.eval.helpers import ESSAY_TEXT, tiny_hf_tokenizer

UUID4 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def test_string_match_all_is_case_insensitive_and_averages_gold_values():
  assert ruler.string_match_all(["The number is 1234567."], [["1234567"]]) == 100.0
  uuid = "9F1C2D3E-0000-4ABC-8DEF-0123456789AB"
  assert ruler.string_match_all([f"it is {uuid.lower()}"], [[uuid]]) == 100.0
  # Two gold values, one found: 1/2; averaged with a miss: 25.
  assert ruler.string_match_all(["alpha and BETA", "nothing"],
                                [["beta", "gamma"], ["1"]]) == pytest.approx(25.0)
  assert ruler.string_match_all(["123456"], [["1234567"]]) == 0.0
  with pytest.raises(ValueError, match="differ in length"):
    ruler.string_match_all(["a"], [])
  assert ruler.postprocess_prediction(" 12\n34\x07 ") == "12 34"


def byte_encoder(vocab_size=258):
  return functools.partial(encode_prompt, ByteTokenizer(), vocab_size=vocab_size)


def essay_words():
  return ESSAY_TEXT.split()


@pytest.mark.parametrize("name", ["sniah1", "sniah2", "sniah3"])
def test_examples_are_deterministic_in_the_seed_and_laid_out_like_ruler(name):
  words = essay_words() if name != "sniah1" else None
  task = ruler.SNIAHTask(name, 1024, byte_encoder(), essay_words=words, seed=3)
  again = ruler.SNIAHTask(name, 1024, byte_encoder(), essay_words=words, seed=3)
  other = ruler.SNIAHTask(name, 1024, byte_encoder(), essay_words=words, seed=4)
  examples = task.examples(4)
  assert examples == again.examples(4)
  assert [e.answers for e in examples] != [e.answers for e in other.examples(4)]
  kind = "uuid" if name == "sniah3" else "number"
  for example in examples:
    (value,) = example.answers
    assert UUID4.match(value) if kind == "uuid" else re.fullmatch(r"[1-9]\d{6}", value)
    key = re.search(rf"One of the special magic {kind}s for (\w+-\w+) is: {value}\.",
                    example.prompt).group(1)
    assert example.prompt.startswith(f"A special magic {kind} is hidden within the following")
    assert example.prompt.endswith(f"What is the special magic {kind} for {key} mentioned in the"
                                   f" provided text? The special magic {kind} for {key} mentioned"
                                   " in the provided text is")
    if name == "sniah1":
      assert ruler.S1_HAYSTACK_LINE + "\n" in example.prompt
    else:
      assert example.depth_percent in ruler.DEPTHS_PERCENT


@pytest.mark.parametrize("tokenizer_kind", ["bytes", "hf"])
@pytest.mark.parametrize("name,length", [("sniah1", 768), ("sniah1", 1500), ("sniah2", 700),
                                         ("sniah3", 900)])
def test_prompts_fill_the_target_length_minus_128_tokens(tmp_path, tokenizer_kind, name, length):
  if tokenizer_kind == "bytes":
    tokenizer, vocab_size = ByteTokenizer(), 258
  else:
    tokenizer = tiny_hf_tokenizer(tmp_path)
    vocab_size = tokenizer.vocab_size
  encode = functools.partial(encode_prompt, tokenizer, vocab_size=vocab_size)
  task = ruler.SNIAHTask(name, length, encode,
                         essay_words=essay_words() if name != "sniah1" else None)
  size = task.haystack_size()
  for example in task.examples(3):
    assert len(example.prompt_ids) + ruler.TOKENS_TO_GENERATE <= length
    assert example.prompt_ids[0] == tokenizer.bos_id  # BOS counted in the budget
    decoded = tokenizer.decode(example.prompt_ids).strip()
    assert decoded.endswith("mentioned in the provided text is")
  # Largest size: one more line / word no longer fits (unless the essay text ran out).
  if size < task.max_haystack_size:
    assert len(task._build(0, size + 1).prompt_ids) + ruler.TOKENS_TO_GENERATE > length


def test_bad_inputs_raise(tmp_path):
  with pytest.raises(ValueError, match="needs essay_words"):
    ruler.SNIAHTask("sniah2", 1024, byte_encoder())
  with pytest.raises(ValueError, match="not one of"):
    ruler.SNIAHTask("sniah9", 1024, byte_encoder())
  with pytest.raises(ValueError, match="exceeds"):
    ruler.SNIAHTask("sniah1", 200, byte_encoder()).haystack_size()
  with pytest.raises(ValueError, match="no .txt file"):
    ruler.load_essay_words(tmp_path)
  (tmp_path / "a.txt").write_text("one two. three")
  assert ruler.load_essay_words(tmp_path) == ["one", "two.", "three"]
