"""TrainConfig, --set overrides, experiment files and the metrics sinks."""

import json
import pathlib

import pytest

from lalte_jax.train.config import TrainConfig, apply_overrides, load_config
from lalte_jax.train.metrics import MetricsLogger, flops_per_token, peak_memory_gib

CONFIGS = pathlib.Path(__file__).resolve().parents[3] / "lalte_jax" / "configs"


def test_overrides_convert_types():
  config = apply_overrides(TrainConfig(), ["steps=1_000", "lr=1e-3", "tensorboard=false",
                                           "variant=gdn_swa", "size=0.4b"])
  assert (config.steps, config.lr, config.tensorboard) == (1000, 1e-3, False)
  assert config.model_config().name == "gdn_swa-0.4b"


@pytest.mark.parametrize("assignment,match", [
    ("stepz=3", "unknown config key 'stepz'"),
    ("steps=abc", "steps=abc: expected int"),
    ("progress_bar=maybe", "expected a boolean"),
    ("steps", "expected key=value"),
    ("variant=gpt", "TrainConfig.variant"),
    ("warmup_steps=500", "warmup_steps"),
    ("grad_accum_steps=3", "does not divide global_batch_size"),
])
def test_bad_overrides_raise_naming_the_key(assignment, match):
  with pytest.raises(ValueError, match=match):
    apply_overrides(TrainConfig(), [assignment])


def test_paper_recipes():
  small = load_config(CONFIGS / "paper_0_4b.py", ["variant=gdn_attn"])
  assert small.model_name == "gdn_attn-0.4b" and small.model_dtype == "bfloat16"
  assert (small.steps, small.warmup_steps, small.seq_len) == (20_480, 1024, 4096)
  assert small.tokens_per_step == 524_288 and small.lr == 3e-4 and small.lr_min_ratio == 0.1
  big = load_config(CONFIGS / "paper_1_4b.py")
  assert (big.steps, big.warmup_steps, big.tokens_per_step) == (30_720, 512, 1_048_576)
  assert big.micro_batch_size == 16
  with pytest.raises(ValueError, match="pure_lte"):
    load_config(CONFIGS / "paper_1_4b.py", ["variant=pure_lte"])  # exists only at 0.4b
  tiny = load_config(CONFIGS / "tiny_mqar.py")
  assert tiny.model_name == "lalte-tiny" and tiny.data == "mqar"


def test_flops_estimate_is_dominated_by_6n():
  config = TrainConfig(variant="lalte", size="0.4b", seq_len=4096).model_config()
  flops = flops_per_token(config, 4096)
  assert 6 * 3.4e8 < flops < 6 * 3.4e8 * 1.6  # 360M params, of which 33M tied embedding


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_peak_memory_is_the_largest_device_peak_where_known():
  devices = [_Device({"peak_bytes_in_use": 2**30}), _Device(None),
             _Device({"peak_bytes_in_use": 3 * 2**29, "bytes_in_use": 2**31})]
  assert peak_memory_gib(devices) == 1.5
  assert peak_memory_gib([_Device(None), _Device({})]) is None  # CPU: no statistics


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
  logger = MetricsLogger(tmp_path, total_steps=10, progress_bar=True, tensorboard=True)
  logger.log(5, {"loss": 1.5, "lte_lambda": [[0.0, 1e-9]]})
  logger.advance(5)
  logger.close()
  record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
  assert record["step"] == 5 and record["loss"] == 1.5 and record["lte_lambda"] == [[0.0, 1e-9]]
  assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_cli_rejects_unknown_key_before_any_work(capsys):
  from lalte_jax.train.cli import main  # pylint: disable=import-outside-toplevel
  code = main(["--config", str(CONFIGS / "tiny_mqar.py"), "--set", "learning_rate=1"])
  assert code == 2
  assert "unknown config key 'learning_rate'" in capsys.readouterr().err


def test_config_file_with_argument_selects_one_experiment_of_a_family():
  config = load_config("repro/capacity:lalte_warmup", ["steps=30000"])
  assert config.variant == "lalte" and config.steps == 30000
  assert config.model_config().layer_pattern == ("gdn", "lte")
  assert config.lte_routing_freeze_steps == 24000
  with pytest.raises(ValueError, match="mamba"):
    load_config("repro/capacity:mamba")


def test_metrics_log_drops_the_records_a_resumed_run_redoes(tmp_path):
  logger = MetricsLogger(tmp_path, total_steps=5, tensorboard=False, progress_bar=False)
  for step in range(1, 6):
    logger.log(step, {"loss": float(step)})
  logger.close()
  with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as torn:
    torn.write('{"step": 6, "lo')  # a kill in the middle of a write
  resumed = MetricsLogger(tmp_path, total_steps=5, initial_step=3, tensorboard=False,
                          progress_bar=False)
  resumed.log(4, {"loss": 40.0})
  resumed.close()
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
