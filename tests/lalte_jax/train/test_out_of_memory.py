"""A training step that runs out of device memory stops with what ran out and the settings that
trade speed for memory; other XLA errors pass through unchanged."""

import jax
import pytest

from lalte_jax.train.config import TrainConfig
from lalte_jax.train.metrics import MetricsLogger
from lalte_jax.train.trainer import StepOutOfMemory, Trainer, out_of_memory_advice

XLA_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 88.03GiB with allocator"
           " GPU_0_bfc on device 0.\nmore lines of XLA's report")


def _config(**fields) -> TrainConfig:
  return TrainConfig(**{
      "variant": "gdn_swa", "size": "tiny", "model_dtype": "float32", "data": "mqar",
      "seq_len": 32, "mqar_num_kv_pairs": 2, "global_batch_size": 8, "grad_accum_steps": 2,
      "steps": 2, "warmup_steps": 1, "progress_bar": False, "tensorboard": False,
      "model_overrides": {"num_layers": 2, "layer_pattern": ("gdn", "attention")}, **fields})


def test_advice_names_the_micro_batch_and_the_settings_that_save_memory():
  advice = out_of_memory_advice(_config(remat="none"), 2, jax.errors.JaxRuntimeError(XLA_OOM))
  assert "out of memory" in advice  # bench_train's is_out_of_memory reads the chained text too
  assert ("2 sequences of 32 tokens per device per micro-batch (global_batch_size 8 /"
          " grad_accum_steps 2 / 2 data x fsdp devices) with remat='none'" in advice)
  assert "a larger grad_accum_steps" in advice
  assert "remat='dots_attention' (recomputes elementwise work only) or 'block'" in advice
  assert advice.endswith("XLA: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 88.03GiB"
                         " with allocator GPU_0_bfc on device 0.")
  block = out_of_memory_advice(_config(remat="block"), 1, jax.errors.JaxRuntimeError(XLA_OOM))
  assert "remat=" in block and "instead of" not in block  # nothing recomputes more than block


@pytest.mark.slow  # init of a tiny model
def test_train_step_turns_an_out_of_memory_error_into_advice():
  trainer = Trainer(_config(remat="none"), logger=MetricsLogger("", total_steps=2, enabled=False))
  batch = next(trainer.data_iterator)

  def step_out_of_memory(state, batch):
    raise jax.errors.JaxRuntimeError(XLA_OOM)

  trainer.step_fn = step_out_of_memory
  with pytest.raises(StepOutOfMemory, match="per device per micro-batch") as raised:
    trainer.train_step(batch)
  assert isinstance(raised.value.__cause__, jax.errors.JaxRuntimeError)

  def step_failing_otherwise(state, batch):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  trainer.step_fn = step_failing_otherwise
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
    trainer.train_step(batch)
