"""`python -m lalte_jax.convert from-hf / to-hf`: checkpoint -> export -> checkpoint."""

import json

import jax
import numpy as np
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.convert import cli, read_hf
from lalte_jax.inference import checkpoint
from tests.lalte_jax.convert.helpers import same_params, write_checkpoint


def write_tokenizer(directory, vocab_size):
  # pylint: disable-next=import-outside-toplevel
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.save(str(directory / "tokenizer.json"))


def test_from_hf_then_to_hf(tmp_path, capsys):
  config = get_model_config("lansa-tiny")
  source = tmp_path / "hf"
  params = write_checkpoint(config, source)
  hf = json.loads((source / "config.json").read_text())
  hf.update(bos_token_id=5, eos_token_id=6, pad_token_id=0)
  (source / "config.json").write_text(json.dumps(hf))
  write_tokenizer(source, config.vocab_size)

  assert cli.main(["from-hf", str(source), "--out", str(tmp_path / "export"),
                   "--with-tokenizer"]) == 0
  assert "converted" in capsys.readouterr().out
  model = checkpoint.load_model(tmp_path / "export")
  assert model.config.replace(name=config.name) == config
  assert same_params(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))),
                     params)
  assert (tmp_path / "export" / "tokenizer.json").is_file()

  assert cli.main(["to-hf", str(tmp_path / "export"), "--out", str(tmp_path / "back"),
                   "--tokenizer", str(tmp_path / "export")]) == 0
  back = json.loads((tmp_path / "back" / "config.json").read_text())
  assert (back["bos_token_id"], back["eos_token_id"], back["pad_token_id"]) == (5, 6, 0)
  assert back["architectures"] == ["HybridGatedDeltaNetForCausalLM"]
  assert (tmp_path / "back" / "tokenizer.json").is_file()
  _, back_params, _ = read_hf(tmp_path / "back")
  assert same_params(back_params, params)
