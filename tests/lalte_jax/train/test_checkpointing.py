"""Train checkpoints in-process: atomicity, the data position, keep-N, stop signals, the export."""

import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lalte_jax.data import MQARSource, make_dataset
from lalte_jax.inference import checkpoint as params_checkpoint
from lalte_jax.presets import preset_names
from lalte_jax.train import checkpointing, export
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.step import init_train_state, model_graphdef
from tests import damage


def _iterator():
  source = MQARSource(num_examples=512, seq_len=16, vocab_size=64, num_kv_pairs=2, seed=3)
  return make_dataset(source, batch_size_per_process=4, seed=3, shuffle=True, process_index=0,
                      process_count=1)


def _state(step: int) -> dict:
  """A small train-state-like pytree whose values depend on `step`."""
  return {"step": jnp.asarray(step, jnp.int32),
          "params": {"w": jnp.full((4, 3), float(step), jnp.float32),
                     "layers": {0: jnp.arange(5, dtype=jnp.float32) * step}},
          "rng": jnp.asarray([step, 7], jnp.uint32)}


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _equal(a, b) -> bool:
  return all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_leftover_of_a_killed_save_is_ignored_and_harmless(tmp_path):
  iterator = _iterator()
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=3, config_json={"seed": 3})
  for _ in range(2):
    next(iterator)
  assert checkpoints.save(2, _state(2), iterator, wait=True)
  expected_batch = next(iterator)
  checkpoints.close()
  # What a save of step 4 killed before its commit leaves: Orbax's temporary directory (named
  # like the real ones: <step>.orbax-checkpoint-tmp-<n>) with partial items.
  partial = tmp_path / "4.orbax-checkpoint-tmp-1795310000000000"
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "_METADATA").write_text("{trunc")
  (partial / "data").mkdir()

  reader = checkpointing.RunCheckpoints(tmp_path, keep=1, read_only=True)
  assert reader.latest_step() == 2 and partial.exists()  # ignored, and a reader leaves it alone
  with pytest.raises(ValueError, match="read-only"):
    reader.save(5, _state(5))
  reader.close()
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=3)
  assert checkpoints.latest_step() == 2 and checkpoints.all_steps() == [2]
  restored_iterator = _iterator()
  restored = checkpoints.restore(_abstract(_state(0)), restored_iterator)
  assert _equal(restored, _state(2))
  assert np.array_equal(next(restored_iterator)["tokens"], expected_batch["tokens"])
  # The next save of that step works and becomes the newest.
  assert checkpoints.save(4, _state(4), restored_iterator, wait=True)
  assert checkpoints.latest_step() == 4 and not partial.exists()
  assert _equal(checkpoints.restore(_abstract(_state(0))), _state(4))
  checkpoints.close()


def test_keeps_the_newest_and_restores_a_chosen_step(tmp_path):
  iterator = _iterator()
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=2)
  batches = {}
  for step in (1, 2, 3):
    batches[step] = next(iterator)["tokens"]
    checkpoints.save(step, _state(step), iterator)  # asynchronous
  assert not checkpoints.save(3, _state(99), iterator, wait=True)  # already saved: a no-op
  assert checkpoints.all_steps() == [2, 3]
  later = _iterator()
  assert _equal(checkpoints.restore(_abstract(_state(0)), later, step=2), _state(2))
  assert np.array_equal(next(later)["tokens"], batches[3])  # the batch after step 2's
  with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 1"):
    checkpoints.restore(_abstract(_state(0)), step=1)
  checkpoints.close()


def test_keep_every_also_keeps_the_steps_it_divides(tmp_path):
  iterator = _iterator()
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=1, keep_every=4)
  for step in (2, 4, 6, 8, 10):
    checkpoints.save(step, _state(step), iterator, wait=True)
  assert checkpoints.all_steps() == [4, 8, 10]
  assert _equal(checkpoints.restore(_abstract(_state(0)), step=4), _state(4))
  checkpoints.close()
  with pytest.raises(ValueError, match="checkpoint_keep_every: must be 0 or a positive multiple"
                                       " of checkpoint_every=100, got 50"):
    TrainConfig(checkpoint_keep_every=50)


def test_empty_directory_has_no_step(tmp_path):
  checkpoints = checkpointing.RunCheckpoints(tmp_path / "none", keep=1)
  assert checkpoints.latest_step() is None
  with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
    checkpoints.restore(_abstract(_state(0)))
  with pytest.raises(ValueError, match="keep must be positive"):
    checkpointing.RunCheckpoints(tmp_path, keep=0)


def _big_state(step: int) -> dict:
  """A state with an array large enough to get a data file of its own (small values are stored
  inside OCDBT's tree nodes, which TensorStore checks itself)."""
  values = np.random.default_rng(step).standard_normal((64, 64)).astype(np.float32)
  return {"step": jnp.asarray(step, jnp.int32), "w": jnp.asarray(values)}


def _damage(step_dir, kind: str) -> None:
  if kind == "truncated array file":
    damage.truncate(damage.largest_array_file(step_dir / "state"))
  elif kind == "garbage in an array file":
    damage.overwrite_middle(damage.largest_array_file(step_dir / "state"))
  elif kind == "deleted state metadata":
    (step_dir / "state" / "_METADATA").unlink()
  elif kind == "deleted data position":
    (step_dir / "data" / "process_0-of-1.json").unlink()
  else:
    (step_dir / "config" / "metadata").write_text("{trunc")


# What `problem` says for each damage (regular expressions).
FOUND_BY_CHECKSUMS = {
    "truncated array file": r"state/ocdbt\.process_0/d/\w+ has \d+ bytes, \d+ were written",
    "garbage in an array file": r"state/ocdbt\.process_0/d/\w+ differs from what was written",
    "deleted state metadata": r"state/_METADATA is missing",
    "deleted data position": r"data/process_0-of-1.json is missing",
    "unreadable config": r"config/metadata has 6 bytes",
}
# What reading says when the checksum record is absent (garbage is then not found at all).
FOUND_BY_READING = {
    "truncated array file": "OUT_OF_RANGE: Error reading",
    "deleted state metadata": "state/_METADATA is missing",
    "deleted data position": "no data iterator state",
    "unreadable config": "config: JSONDecodeError",
}


@pytest.mark.parametrize("kind", FOUND_BY_CHECKSUMS)
def test_damage_is_found_before_reading_and_restore_says_so_in_one_line(tmp_path, kind):
  reason = FOUND_BY_CHECKSUMS[kind]
  iterator = _iterator()
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=3, config_json={"seed": 3})
  for step in (1, 2):
    checkpoints.save(step, _big_state(step), iterator, wait=True)
  assert (tmp_path / "2" / "checksums.json").is_file()  # committed with the checkpoint
  _damage(tmp_path / "2", kind)
  assert re.match(reason, checkpoints.problem(2))
  with pytest.raises(checkpointing.DamagedCheckpoint, match=f"step 2 in {tmp_path} is damaged: "
                     + reason) as raised:
    checkpoints.restore(_abstract(_big_state(0)), _iterator(), step=2)
  assert "\n" not in str(raised.value)
  assert checkpoints.problem(1) is None
  assert _equal(checkpoints.restore(_abstract(_big_state(0)), step=1), _big_state(1))
  # Set aside, the damaged step is out of every listing and is saved afresh.
  assert checkpoints.set_aside([2]) == tmp_path / "damaged" and checkpoints.all_steps() == [1]
  assert (tmp_path / "damaged" / "2" / "state").is_dir()
  assert checkpoints.save(2, _big_state(2), iterator, wait=True)
  assert checkpoints.problem(2) is None and checkpoints.all_steps() == [1, 2]
  checkpoints.close()


@pytest.mark.parametrize("kind", FOUND_BY_READING)
def test_without_checksums_reading_finds_the_damage(tmp_path, kind):
  """Checkpoints saved before checksum records existed are checked by reading them."""
  reason = FOUND_BY_READING[kind]
  checkpoints = checkpointing.RunCheckpoints(tmp_path, keep=3, config_json={"seed": 3})
  checkpoints.save(2, _big_state(2), _iterator(), wait=True)
  (tmp_path / "2" / "checksums.json").unlink()
  _damage(tmp_path / "2", kind)
  with pytest.raises(checkpointing.DamagedCheckpoint, match=reason) as raised:
    checkpoints.restore(_abstract(_big_state(0)), _iterator(), step=2)
  assert "\n" not in str(raised.value)
  checkpoints.close()


def test_config_round_trips_through_the_checkpoint(tmp_path):
  config = TrainConfig(output_dir=str(tmp_path), model_overrides={"lte.window": 20},
                       checkpoint_keep=2)
  checkpoints = checkpointing.RunCheckpoints.for_run(config)
  assert checkpoints.directory == tmp_path.absolute() / "checkpoints"
  checkpoints.save(1, _state(1), wait=True)
  assert checkpoints.restore_config(1) == config
  checkpoints.close()


def test_stop_signals_turn_sigterm_into_a_flag():
  previous = signal.getsignal(signal.SIGTERM)
  with checkpointing.StopSignals() as stop:
    assert not stop.stop_now()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.stop_now() and stop.signal_name == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is previous


def test_processes_agree_on_a_stop_only_every_check_every_steps(monkeypatch):
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  gathers = []

  def fake_allgather(flag):  # another process was signalled
    gathers.append(int(flag))
    return np.asarray([int(flag), 1])

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", fake_allgather)
  stop = checkpointing.StopSignals()
  assert [stop.stop_now(step, 10) for step in (7, 8, 9)] == [False] * 3 and not gathers
  assert stop.stop_now(10, 10) and gathers == [0]


@pytest.mark.parametrize("name", [n for n in preset_names() if n.endswith("tiny")] + ["custom"])
def test_model_config_json_round_trip(name):
  if name == "custom":
    config = TrainConfig(model_overrides={"lte.window": 20, "lte.router_dilations": (1, 1, 1),
                                          "num_layers": 2, "layer_pattern": ("gdn", "lte")},
                         model_dtype="float32").model_config()
  else:
    config = TrainConfig(variant=name.split("-")[0]).model_config()
  data = params_checkpoint.model_config_to_json(config)
  assert params_checkpoint.model_config_from_json(data) == config
  with pytest.raises(ValueError, match="unknown fields"):
    params_checkpoint.model_config_from_json(dict(data, colour="red"))


@pytest.mark.slow  # init + compile: tens of seconds on a loaded 2-core CPU
def test_exported_params_load_with_their_config_and_give_the_same_logits(tmp_path):
  # A custom model (not a preset): the export must carry the whole config. Attention only, to
  # keep the eager init and the compile short; the export does not depend on the mixers.
  config = TrainConfig(variant="transformer", model_dtype="float32", seq_len=32,
                       model_overrides={"num_layers": 2, "layer_pattern": ("attention",) * 2,
                                        "attention.window_size": 16})
  model_config = config.model_config()
  params = init_train_state(model_config, config, jax.random.key(1)).params
  graphdef = model_graphdef(model_config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 32)), jnp.int32)
  logits = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
  expected = logits(params, tokens)
  for dtype, tolerance in (("float32", 0.0), ("bfloat16", 3e-2)):
    path = export.export_state_params(params, model_config, tmp_path / dtype, dtype=dtype)
    model = params_checkpoint.load_model(path)
    assert model.config == model_config
    loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(loaded))
    np.testing.assert_allclose(logits(loaded, tokens), expected, atol=tolerance, rtol=0)
  # Exporting again replaces the directory.
  export.export_state_params(params, model_config, tmp_path / "float32", dtype="float32")
  with pytest.raises(ValueError, match="dtype 'int8'"):
    params_checkpoint.save_param_dict(params, model_config, tmp_path / "x", "int8")
