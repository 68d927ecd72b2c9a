"""Every malformed input is refused with a message naming what is wrong."""

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lalte_jax.config import get_model_config
from lalte_jax.convert import cli, load_hf
from tests.cli_testing import check_bad_input
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


# CLI arguments -> what the one-line error must say; {hf} is a valid checkpoint, {tmp} the test's
# directory (it holds hf/, so it is not empty).
CLI_BAD_INPUTS = {
    "no subcommand": ([], "the following arguments are required: command"),
    "unknown subcommand": (["from_hf"], "invalid choice: 'from_hf'"),
    "missing source": (["from-hf", "{tmp}/missing", "--out", "{tmp}/out"],
                       "checkpoint {tmp}/missing: no config.json"),
    "source without weights": (["from-hf", "{tmp}/no_weights", "--out", "{tmp}/out"],
                               "no model.safetensors or model.safetensors.index.json"),
    "source config not JSON": (["from-hf", "{tmp}/bad_json", "--out", "{tmp}/out"],
                               "config.json: not valid JSON"),
    "from-hf out exists": (["from-hf", "{hf}", "--out", "{tmp}"], "out: {tmp} already exists"),
    "absent tokenizer": (["from-hf", "{hf}", "--out", "{tmp}/out", "--with-tokenizer"],
                         "tokenizer: {hf} holds no tokenizer.json"),
    "bad dtype": (["from-hf", "{hf}", "--out", "{tmp}/out", "--dtype", "int4"],
                  "argument --dtype: invalid choice: 'int4'"),
    "to-hf source not an export": (["to-hf", "{hf}", "--out", "{tmp}/out"],
                                   "lacks model.json or params/"),
    "to-hf out not empty": (["to-hf", "{tmp}/missing", "--out", "{tmp}"],
                            "out: {tmp} already exists and is not an empty directory"),
    "to-hf missing tokenizer": (["to-hf", "{tmp}/missing", "--out", "{tmp}/out", "--tokenizer",
                                 "{tmp}/missing"], "tokenizer: {tmp}/missing holds no tokenizer"),
    "to-hf shard size": (["to-hf", "{tmp}/missing", "--out", "{tmp}/out", "--max-shard-gb", "0"],
                         "--max-shard-gb: must be positive, got 0.0"),
}


@pytest.mark.parametrize("case", CLI_BAD_INPUTS)
def test_cli_bad_input_is_one_line_and_exit_2(case, checkpoint_dir, tmp_path, capsys):
  (tmp_path / "no_weights").mkdir()
  (tmp_path / "no_weights" / "config.json").write_text((checkpoint_dir / "config.json").read_text())
  (tmp_path / "bad_json").mkdir()
  (tmp_path / "bad_json" / "config.json").write_text("{")
  check_bad_input(cli.main, *CLI_BAD_INPUTS[case], capsys, hf=checkpoint_dir, tmp=tmp_path)
  assert not (tmp_path / "out").exists()


def test_unexportable_layer_pattern(tmp_path):
  config = get_model_config("lalte-tiny")
  config = config.replace(layer_pattern=("gdn", "lte", "gdn", "attention"),
                          attention=get_model_config("gdn_swa-tiny").attention)
  with pytest.raises(ValueError, match="model.layer_pattern: the mixers"):
    write_checkpoint(config, tmp_path / "hf")
