"""Every malformed input is refused with a message naming what is wrong."""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lalte_jax.config import get_model_config
from lalte_jax.convert import cli, load_hf
from tests.lalte_jax.convert.helpers import write_checkpoint


@pytest.fixture(name="checkpoint_dir")
def fixture_checkpoint_dir(tmp_path):
  write_checkpoint(get_model_config("lalte-tiny"), tmp_path / "hf")
  return tmp_path / "hf"


def edit_config(directory, edit):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  edit(config)
  path.write_text(json.dumps(config))


def edit_tensors(directory, edit):
  path = directory / "model.safetensors"
  tensors = dict(load_file(str(path)))
  edit(tensors)
  save_file(tensors, str(path), metadata={"format": "pt"})


CONFIG_EDITS = {
    "unknown model_type": (lambda c: c.update(model_type="mamba2"),
                           "model_type 'mamba2' is not supported"),
    "unknown field": (lambda c: c.update(use_mystery_gate=True),
                      "unknown field 'use_mystery_gate'"),
    "unsupported attn option": (lambda c: c["attn"].update(routing_method="relu"),
                                'config.json attn: routing_method="relu" is not supported'),
    "unsupported model option": (lambda c: c.update(allow_neg_eigval=True),
                                 "config.json: allow_neg_eigval=true is not supported"),
}


@pytest.mark.parametrize("case", CONFIG_EDITS)
def test_bad_config(case, checkpoint_dir):
  edit, message = CONFIG_EDITS[case]
  edit_config(checkpoint_dir, edit)
  with pytest.raises(ValueError, match=re.escape(message)):
    load_hf(checkpoint_dir)


CONV = "model.layers.1.attn.router.conv_stack.convs.0.weight"
TENSOR_EDITS = {
    "missing": (lambda t: t.pop("model.layers.3.attn.router.conv_stack.proj.bias"),
                "missing tensor 'model.layers.3.attn.router.conv_stack.proj.bias'"),
    "left over": (lambda t: t.update({"model.layers.0.attn.q_norm.weight": np.ones(32, "f4")}),
                  "unexpected tensor 'model.layers.0.attn.q_norm.weight'"),
    "misshaped": (lambda t: t.update({CONV: t[CONV].reshape(16, 2, 32, 3)}),
                  f"tensor '{CONV}' has shape [16, 2, 32, 3], expected [32, 32, 1, 3]"),
    "tied head differs": (lambda t: t.update({"lm_head.weight": t["model.embeddings.weight"] + 1}),
                          "tie_word_embeddings is true but 'lm_head.weight' differs"),
}


@pytest.mark.parametrize("case", TENSOR_EDITS)
def test_bad_tensors(case, checkpoint_dir):
  edit, message = TENSOR_EDITS[case]
  edit_tensors(checkpoint_dir, edit)
  with pytest.raises(ValueError, match=re.escape(message)):
    load_hf(checkpoint_dir)


def test_absent_tokenizer_is_a_cli_error(checkpoint_dir, tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["from-hf", str(checkpoint_dir), "--out", str(tmp_path / "export"),
              "--with-tokenizer"])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err.strip() == (f"error: tokenizer: {checkpoint_dir} holds no"
                                             " tokenizer.json")
  assert not (tmp_path / "export").exists()


def test_unexportable_layer_pattern(tmp_path):
  config = get_model_config("lalte-tiny")
  config = config.replace(layer_pattern=("gdn", "lte", "gdn", "attention"),
                          attention=get_model_config("gdn_swa-tiny").attention)
  with pytest.raises(ValueError, match="model.layer_pattern: the mixers"):
    write_checkpoint(config, tmp_path / "hf")
