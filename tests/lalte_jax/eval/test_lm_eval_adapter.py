"""lm-eval adapter and perplexity on a tiny model: log-likelihoods equal the forward pass's,
generate_until cuts at its stop strings, bits per byte on a prepared corpus."""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from lalte_jax.data import pretokenized
from lalte_jax.data.tokenizer import ByteTokenizer
from lalte_jax.eval import decoding, lm_eval_adapter, perplexity
from tests.lalte_jax.eval.helpers import tiny_model

pytestmark = pytest.mark.slow


PADDED_LENGTH = 32


@functools.lru_cache(maxsize=None)
def _jitted_forward(model):
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  return lambda tokens: forward(state, tokens)


def forward_logprobs(model, ids):
  """log P(ids[t+1] | ids[:t+1]) from the plain forward pass. The models are causal, so padding
  every sequence on the right to one length changes no logit of a real position and lets one
  compiled forward serve every call (eager calls cost minutes of CPU dispatch)."""
  assert len(ids) <= PADDED_LENGTH, ids
  tokens = np.zeros((1, PADDED_LENGTH), np.int32)
  tokens[0, :len(ids)] = ids
  logp = np.asarray(jax.nn.log_softmax(_jitted_forward(model)(tokens)[0], axis=-1))
  return np.asarray([float(logp[t, ids[t + 1]]) for t in range(len(ids) - 1)])


class Request:  # stands for lm_eval's Instance: only `.args` is read
  def __init__(self, *args):
    self.args = args


def test_loglikelihood_and_rolling_match_the_forward_pass():
  model = tiny_model("gdn_swa", vocab_size=258)
  lm = lm_eval_adapter.LaLTELM(model, ByteTokenizer(), batch_size=2)
  results = lm.loglikelihood([("Hello", " world"), Request("ab ", "cd"), ("", "xyz")])
  bos = 256
  expected = [forward_logprobs(model, [bos] + list(b"Hello world"))[-6:].sum(),
              forward_logprobs(model, [bos] + list(b"ab cd"))[-3:].sum(),  # " cd": space moved
              forward_logprobs(model, [bos] + list(b"xyz")).sum()]
  np.testing.assert_allclose([r[0] for r in results], expected, rtol=1e-4, atol=1e-4)
  assert all(isinstance(r[1], bool) for r in results)
  (rolling,) = lm.loglikelihood_rolling([("some text",)])
  assert rolling == pytest.approx(forward_logprobs(model, [bos] + list(b"some text")).sum(),
                                  rel=1e-4)
  short = lm_eval_adapter.LaLTELM(model, ByteTokenizer(), max_length=4)
  (windowed,) = short.loglikelihood_rolling([("some text",)])
  assert math.isfinite(windowed) and windowed < 0


def test_generate_until_cuts_at_the_stop_strings():
  model = tiny_model("gdn", vocab_size=258)
  lm = lm_eval_adapter.LaLTELM(model, ByteTokenizer(), batch_size=2)
  requests = [("abc", {"until": ["\n"], "max_gen_toks": 6}), ("hello", {"max_gen_toks": 6})]
  outputs = lm.generate_until(requests)
  greedy = decoding.greedy_generate(model, [[256] + list(b"abc"), [256] + list(b"hello")], 6,
                                    stop_ids=(257,))
  full = [ByteTokenizer().decode(ids) for ids in greedy]
  assert outputs == [full[0].split("\n")[0], full[1]]


def test_checkpoint_or_model_required():
  with pytest.raises(ValueError, match="exactly one"):
    lm_eval_adapter.LaLTELM()


def test_perplexity_and_bits_per_byte_on_a_prepared_corpus(tmp_path):
  model = tiny_model("gdn_swa", vocab_size=258)
  documents = [list(b"the cat sat on the mat. "), list(b"a dog ran far away, fast!")]
  sequences = pretokenized.pack_documents(documents * 4, 16, bos_id=256)
  with pretokenized.ShardWriter(tmp_path, 16, sequences_per_shard=4) as writer:
    for sequence in sequences:
      writer.write(sequence)
  pretokenized.write_metadata(tmp_path, {
      "seq_len": 16, "vocab_size": 258, "bos_id": 256, "eos_id": 257, "tokenizer": "byte",
      "num_sequences": len(sequences), "num_documents": 8, "num_tokens": int(sequences.size),
      "num_dropped_tokens": 0, "shards": writer.shards})
  result = perplexity.evaluate_perplexity(model, tmp_path, ByteTokenizer(), num_sequences=3,
                                          batch_size=2)
  nll = -sum(forward_logprobs(model, list(s)).sum() for s in sequences[:3])
  num_bytes = sum(int((s[1:] < 256).sum()) for s in sequences[:3])
  assert result["num_tokens"] == 45 and result["num_bytes"] == num_bytes
  assert result["bits_per_byte"] == pytest.approx(nll / math.log(2) / num_bytes, rel=1e-4)
  assert result["perplexity"] == pytest.approx(math.exp(nll / 45), rel=1e-4)
