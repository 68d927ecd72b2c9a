"""`python -m lalte_jax.eval` end to end on a tiny checkpoint: JSON and markdown reports."""

import json

import pytest
from flax import nnx

from lalte_jax.config import get_model_config
from lalte_jax.eval import cli
from lalte_jax.inference import checkpoint
from lalte_jax.model import HybridLM


@pytest.mark.slow
def test_eval_cli_writes_json_and_markdown(tmp_path):
  model = HybridLM(get_model_config("lalte-tiny").replace(dtype="float32"), rngs=nnx.Rngs(0))
  checkpoint.save_params(model, tmp_path / "ckpt")
  payload = cli.run(["--checkpoint", str(tmp_path / "ckpt"), "--tasks",
                     "mqar,mqar_long_gap,sniah1", "--lengths", "600",
                     "--num-examples", "2", "--batch-size", "2", "--sniah-max-new-tokens", "4",
                     "--mqar-num-kv-pairs", "4", "--output-dir", str(tmp_path / "out"),
                     "--no-progress"])
  stored = json.loads((tmp_path / "out" / "results.json").read_text())
  assert stored["model"] == "lalte-tiny"
  records = {r["task"]: r for r in stored["results"]}
  assert list(records) == ["mqar", "mqar_long_gap", "sniah1"]
  assert all(r["length"] == 600 and 0.0 <= r["value"] <= 100.0 for r in records.values())
  assert records["mqar_long_gap"]["min_gap"] == 24  # the tiny laLTE window
  assert records["mqar"]["num_queries"] == 8
  assert records["sniah1"]["max_prompt_tokens"] + 128 <= 600
  markdown = (tmp_path / "out" / "results.md").read_text()
  assert "| mqar_long_gap | accuracy |" in markdown and "| task | metric | 600 |" in markdown
  assert payload["results"] == stored["results"]


def test_bad_arguments_exit_with_a_one_line_error(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--checkpoint", str(tmp_path), "--tasks", "mqar,nope"])
  assert exit_info.value.code == 2
  assert "unknown ['nope']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main(["--checkpoint", str(tmp_path), "--tasks", "sniah2", "--lengths", "1024"])
  assert "haystack_dir" in capsys.readouterr().err
