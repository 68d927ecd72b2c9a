"""tools/repro.py --smoke and tools/plot_results.py end to end on the CPU (one model at two
learning rates, trained as two child processes, 3 steps each)."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def load_tool(name):
  spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_smoke_study_writes_results_and_figures(tmp_path):
  args = ["--smoke", "--models", "lalte", "--out", str(tmp_path), "--num-examples", "2",
          "--batch-size", "2", "--lrs", "3e-3,1e-2", "--setting", "small_state_8"]
  payload = load_tool("repro").main(args + ["--parallel", "2"])
  stored = json.loads((tmp_path / "results.json").read_text())
  assert stored["results"] == json.loads(json.dumps(payload["results"]))
  assert [(r["task"], r["length"]) for r in stored["results"]] == [("mqar_long_gap", 64),
                                                                   ("passkey", 64)]
  assert all(r["model"] == "lalte" and 0 <= r["value"] <= 100 for r in stored["results"])
  assert [r["lr"] for r in stored["all_runs"]] == [3e-3, 3e-3, 1e-2, 1e-2]
  best = max(stored["all_runs"], key=lambda r: r["train_recall"])
  assert {r["lr"] for r in stored["results"]} == {best["lr"]}  # chosen by held-out train recall
  for lr in ("0.003", "0.01"):
    assert (tmp_path / "runs" / f"lalte_lr{lr}" / "export" / "model.json").is_file()
  retention = json.loads((tmp_path / "lalte" / "retention.json").read_text())
  assert len(retention["rate_oow"]) == 1 and len(retention["rate_oow"][0]) == 2  # [L_lte, Hkv]
  assert "| lalte |" in (tmp_path / "results.md").read_text()
  assert stored["setting"] == "small_state_8" and "setting small_state_8" in (
      tmp_path / "results.md").read_text()
  model = json.loads((tmp_path / "runs" / "lalte_lr0.003" / "export" / "model.json").read_text())
  assert json.dumps(model).count('"num_heads": 8') == 1  # the setting's GDN reached the child
  # --report-only rebuilds the same results from the run directories, training nothing
  (tmp_path / "results.json").unlink()
  rebuilt = load_tool("repro").main(args + ["--report-only"])
  assert rebuilt["results"] == payload["results"] and rebuilt["all_runs"] == payload["all_runs"]
  pytest.importorskip("matplotlib")
  written = load_tool("plot_results").main(["--results", str(tmp_path)])
  assert sorted(p.name for p in written) == ["accuracy_vs_length.png", "lte_controller.png",
                                             "retention_heatmap.png", "training_loss.png"]
  assert all(p.stat().st_size > 1000 for p in written)


def test_study_settings_change_pairs_and_gdn_state_only():
  common = load_tool("repro").load_common()
  base = common.repro_config("gdn_swa")
  small = common.repro_config("gdn_swa", setting="small_state")
  assert (base.mqar_num_kv_pairs, small.mqar_num_kv_pairs) == (8, 16)
  base_model, small_model = base.model_config(), small.model_config()
  assert (base_model.gdn.num_heads, base_model.gdn.head_dim) == (2, 32)
  assert (small_model.gdn.num_heads, small_model.gdn.head_dim) == (8, 8)
  assert small_model.replace(gdn=base_model.gdn) == base_model  # nothing else differs
  transformer = common.repro_config("transformer", setting="small_state_8").model_config()
  assert transformer == common.repro_config("transformer").model_config()
  with pytest.raises(ValueError, match="setting: 'huge'"):
    common.repro_config("lalte", setting="huge")
