"""The run loop: builds the mesh, the sharded state, the data and the jitted step, then trains.

`Trainer(config).run()` trains `config.steps` optimizer steps from `state.step`, logs every
`log_every` steps, stops with `TooManySkippedSteps` after `max_consecutive_skips` non-finite
gradients in a row, evaluates held-out data every `eval_every` steps and at the end (`evaluate`:
recall on synthetic tasks; loss, perplexity and bits per byte on a corpus's validation data),
and returns a summary.
`callbacks` are called as `callback(trainer, step)` after each step. SIGTERM/SIGINT end the loop
after the step in flight (the summary then holds `stopped_at`).

With `checkpoints` (a `lalte_jax.train.checkpointing.RunCheckpoints`, as the CLI passes) the run is
resumable: it starts from the newest intact checkpoint (`config.resume`; damaged ones are skipped
and a changed model is refused, see `lalte_jax.train.resume`), saves every
`checkpoint_every` steps and at the end, saves the current step when a signal stops it, and
finally exports the parameters for inference into `<run_dir>/export`. Without it nothing
is written besides the metrics.
"""

from __future__ import annotations

import functools
import json
import pathlib
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lalte_jax import xla_flags
from lalte_jax.data import IGNORE_LABEL, MQARSource, PasskeySource, curricula, heldout, make_dataset
from lalte_jax.eval.perplexity import nll_metrics
from lalte_jax.loss import masked_cross_entropy_sum
from lalte_jax.train import checkpointing, export, resume, sharding
from lalte_jax.train.config import TrainConfig
from lalte_jax.train.metrics import (MetricsLogger, flops_per_token, format_metrics,
                                     is_out_of_memory, peak_flops_per_device, peak_memory_gib)
from lalte_jax.train.step import (TrainState, check_skipped_steps, init_train_state, make_train_step,
                        model_graphdef)
from lalte_jax.train.watchdog import StepWatchdog

# Written into the run directory when training reaches its last step (not when stopped early).
SUMMARY_FILE = "summary.json"


def make_source(config: TrainConfig, *, split: str):
  """The data source of `split` ("train" or "eval"): synthetic eval examples come from another
  seed; a corpus's are its held-out documents (`lalte_jax.data.heldout`; None when it has none)."""
  vocab_size = config.model_config().vocab_size
  seed = config.seed if split == "train" else config.seed + 1
  num_examples = config.num_train_examples if split == "train" else config.num_eval_examples
  if config.curriculum is not None:
    shape = curricula.TaskShape(seq_len=config.seq_len, vocab_size=vocab_size,
                                num_kv_pairs=config.mqar_num_kv_pairs,
                                min_gap=config.mqar_min_gap, prefix_len=config.mqar_prefix_len)
    return curricula.curriculum_source(config.curriculum, shape, split=split, seed=seed,
                                       num_examples=num_examples)
  if config.data == "mqar":
    return MQARSource(num_examples=num_examples, seq_len=config.seq_len, vocab_size=vocab_size,
                      num_kv_pairs=config.mqar_num_kv_pairs, min_gap=config.mqar_min_gap,
                      prefix_len=config.mqar_prefix_len, seed=seed)
  if config.data == "passkey":
    return PasskeySource(num_examples=num_examples, seq_len=config.seq_len,
                         vocab_size=vocab_size, seed=seed)
  if split == "eval":
    source = heldout.validation_source(config.data_dir)
    if source is None:
      return None
  else:
    source = heldout.training_source(config.data_dir)
  if source.seq_len != config.seq_len:
    raise ValueError(f"TrainConfig.seq_len: {config.seq_len}, but the sequences of"
                     f" {config.data_dir} hold {source.seq_len} tokens; set"
                     f" seq_len={source.seq_len}")
  if source.vocab_size > vocab_size:
    raise ValueError(f"TrainConfig.model_overrides: model.vocab_size={vocab_size} is smaller than"
                     f" the vocabulary of {config.data_dir} ({source.vocab_size} ids); set"
                     f" model.vocab_size={source.vocab_size} (or more), or leave it unset to take"
                     " the data's")
  return source


def with_labels(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Adds next-token labels (labels[t] = tokens[t+1], last position ignored) when absent."""
  if "labels" in batch:
    return batch
  tokens = batch["tokens"]
  labels = np.concatenate([tokens[:, 1:], np.full_like(tokens[:, :1], IGNORE_LABEL)], axis=1)
  return {"tokens": tokens, "labels": labels}


class StepOutOfMemory(RuntimeError):
  """The training step needs more device memory than there is (at compile or at run time)."""


def out_of_memory_advice(config: TrainConfig, batch_devices: int, error: BaseException) -> str:
  """What ran out of memory and the settings that trade speed for memory, with XLA's first line."""
  per_device = config.micro_batch_size / batch_devices
  less_recompute = {"none": "'dots_attention' (recomputes elementwise work only) or 'block'",
                    "dots": "'dots_attention' or 'block'", "attention": "'block'",
                    "dots_attention": "'block' (recomputes each layer group)"}.get(config.remat)
  remat = (f", or remat={less_recompute} instead of {config.remat!r}" if less_recompute
           else "")
  return (f"train step: out of memory on the device at {per_device:g} sequences of"
          f" {config.seq_len} tokens per device per micro-batch (global_batch_size"
          f" {config.global_batch_size} / grad_accum_steps {config.grad_accum_steps} /"
          f" {batch_devices} data x fsdp devices) with remat={config.remat!r}. Fewer sequences"
          f" per micro-batch: a larger grad_accum_steps (it divides global_batch_size){remat};"
          f" or more devices on the fsdp axis. XLA: {str(error).strip().splitlines()[0][:300]}")


class Trainer:

  def __init__(self, config: TrainConfig, *, mesh: jax.sharding.Mesh | None = None,
               state: TrainState | None = None, logger: MetricsLogger | None = None,
               checkpoints: checkpointing.RunCheckpoints | None = None,
               train_source=None, eval_source=None):
    """`state` (host or device arrays of any layout) is placed on this mesh's shardings; without
    it the state comes from the newest intact checkpoint in `checkpoints` (when `config.resume`),
    read directly into this mesh's layout, or else is initialised from `config.seed`.

    `train_source` / `eval_source` (random-access sources, see `lalte_jax.data`) replace the
    config's own (`make_source(config, split=...)`); a source with `read_in_order` set (a staged
    curriculum) is read in order, any other is shuffled. Checkpoints save the position in the
    training source, so a resumed run must be given the same one. A pretokenized corpus sets the
    model's vocabulary unless `model.vocab_size` does (`TrainConfig.with_data_vocab`)."""
    config = config.with_data_vocab()
    unset = config.reproducible and xla_flags.missing(*xla_flags.REPRODUCIBLE_GPU)
    if unset and jax.default_backend() == "gpu":
      raise ValueError(f"TrainConfig.reproducible: XLA_FLAGS lacks {' '.join(unset)}; XLA reads it"
                       " once, so set it before the first JAX call (python -m lalte_jax.train"
                       " does)")
    self.config = config
    self.model_config = config.model_config()
    self.mesh = mesh or sharding.make_mesh(config.mesh_data, config.mesh_fsdp, config.mesh_tensor)
    rows = sharding.batch_devices(self.mesh)
    if config.micro_batch_size % rows:
      raise ValueError(f"micro-batch of {config.micro_batch_size} sequences (global_batch_size"
                       f" / grad_accum_steps) does not split over {rows} data x fsdp devices")
    if config.global_batch_size % jax.process_count():
      raise ValueError(f"global_batch_size {config.global_batch_size} does not split over"
                       f" {jax.process_count()} processes")
    self.graphdef = model_graphdef(self.model_config)
    init = functools.partial(init_train_state, self.model_config, config)
    key = jax.random.key(config.seed)
    state_shapes = jax.eval_shape(init, key)
    self.state_shardings = sharding.train_state_shardings(state_shapes, self.mesh)
    if train_source is None:
      train_source = make_source(config, split="train")
    self.eval_source = make_source(config, split="eval") if eval_source is None else eval_source
    self.data_iterator = make_dataset(
        train_source, batch_size_per_process=config.global_batch_size // jax.process_count(),
        seed=config.seed, shuffle=not getattr(train_source, "read_in_order", False),
        process_index=jax.process_index(), process_count=jax.process_count())
    self.checkpoints = checkpoints
    self.resumed_from = None
    if state is None and checkpoints is not None and checkpoints.latest_step() is not None:
      if not config.resume:
        raise ValueError(f"TrainConfig.resume: {checkpoints.directory} holds checkpoints (steps"
                         f" {checkpoints.all_steps()}) but resume=False; delete them or choose"
                         " another output_dir")
      self.resumed_from, state = resume.restore_newest_intact(
          checkpoints, config, checkpointing.abstract_like(state_shapes, self.state_shardings),
          self.data_iterator)
    if state is None:
      self.state = jax.jit(init, out_shardings=self.state_shardings)(key)
    else:
      self.state = jax.device_put(state, self.state_shardings)
    step_fn = make_train_step(self.graphdef, self.model_config, config,
                              micro_batch_sharding=sharding.micro_batch_sharding(self.mesh))
    batch_sh = sharding.batch_sharding(self.mesh)
    self.step_fn = sharding.MeshJit(
        step_fn, self.mesh, in_shardings=(self.state_shardings, batch_sh),
        out_shardings=(self.state_shardings, sharding.replicated(self.mesh)), donate_argnums=0)
    self.eval_fn = sharding.MeshJit(functools.partial(_eval_sums, self.graphdef), self.mesh)
    self.logger = logger or MetricsLogger(
        config.run_dir, total_steps=config.steps,
        initial_step=int(sharding.to_host(self.state.step)),
        tensorboard=config.tensorboard, progress_bar=config.progress_bar,
        enabled=jax.process_index() == 0)
    self.callbacks: list[Callable[[Trainer, int], None]] = []
    self.flops_per_token = flops_per_token(self.model_config, config.seq_len)
    self.peak_flops = peak_flops_per_device(jax.devices()[0].device_kind,
                                            config.peak_tflops_per_device)

  def train_step(self, local_batch: dict[str, np.ndarray]) -> dict:
    """One optimizer step on this process's rows; returns the step's metrics (device arrays).
    Raises StepOutOfMemory when the step does not fit the devices' memory."""
    batch = sharding.global_batch(with_labels(local_batch), self.mesh)
    with warnings.catch_warnings():  # CPU cannot donate buffers; harmless there
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      try:
        self.state, metrics = self.step_fn(self.state, batch)
      except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
          raise
        raise StepOutOfMemory(out_of_memory_advice(
            self.config, sharding.batch_devices(self.mesh), error)) from error
    return metrics

  def run(self) -> dict:
    """Trains to `config.steps`; returns the summary. SIGTERM/SIGINT end the loop after the step
    in flight: the run returns {"stopped_at": step, "signal": name, ...}, after saving that step
    when it has `checkpoints` (without them the caller still holds the state, e.g. to evaluate)."""
    config = self.config
    start_step = int(sharding.to_host(self.state.step))
    if self.resumed_from is not None:
      self.logger.message(f"resumed from {self.checkpoints.directory}/{self.resumed_from}")
    if self.eval_source is None and config.data == "pretokenized":
      self.logger.message(f"no validation data in {config.data_dir} (one shard, prepared without"
                          " --val-fraction): nothing is evaluated")
    with checkpointing.StopSignals() as signals:
      summary = self._train_steps(start_step, signals)
    if "stopped_at" in summary:
      if self.checkpoints is not None:
        self.checkpoints.save(summary["stopped_at"], self.state, self.data_iterator, wait=True)
        summary["checkpoint"] = str(self.checkpoints.directory / str(summary["stopped_at"]))
      self.logger.message("stopped: " + json.dumps(summary))
      self.logger.close()
      return summary
    if self.checkpoints is not None:
      final_step = int(sharding.to_host(self.state.step))
      self.checkpoints.save(final_step, self.state, self.data_iterator, wait=True)
      summary["checkpoint"] = str(self.checkpoints.directory / str(final_step))
      summary["export"] = export.export_state_params(
          self.state.params, self.model_config,
          pathlib.Path(config.run_dir) / export.RUN_EXPORT_DIR, dtype=config.export_dtype)
      if jax.process_index() == 0:
        export.export_corpus_tokenizer(config, summary["export"])
    self.logger.message("summary: " + json.dumps(summary))
    if jax.process_index() == 0:
      path = pathlib.Path(config.run_dir)
      path.mkdir(parents=True, exist_ok=True)
      (path / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    self.logger.close()
    return summary

  def _train_steps(self, start_step: int, stop: checkpointing.StopSignals | None) -> dict:
    """The loop from `start_step` to `config.steps` (or to a stop signal); the summary so far,
    with the final evaluation when the run reached `config.steps`. Evaluations are logged with
    the step they follow (step 0: before the first step)."""
    config = self.config
    previous = None
    interval_start, interval_steps, wall_start = None, 0, time.perf_counter()
    host, evaluation = {}, None
    if config.eval_every and start_step == 0:
      initial = self.evaluate()
      if initial:
        self._log_evaluation(0, initial, initial)
    with StepWatchdog(config.step_timeout_s) as watchdog:
      for step in range(start_step + 1, config.steps + 1):
        metrics = self.train_step(next(self.data_iterator))
        # Check the previous step while this one runs: no device sync per step on the hot path.
        if previous is not None:
          check_skipped_steps(sharding.to_host(previous["skipped_consecutive"]), step - 1,
                              config.max_consecutive_skips)
        previous = metrics
        if interval_start is None:  # time from the end of the first (compiling) step
          jax.block_until_ready(metrics["loss"])
          interval_start = time.perf_counter()
        else:
          interval_steps += 1
        evaluate_now = step == config.steps or (config.eval_every
                                                and step % config.eval_every == 0)
        if step % config.log_every == 0 or evaluate_now:
          host = sharding.to_host(metrics)
          check_skipped_steps(host["skipped_consecutive"], step, config.max_consecutive_skips)
          host.update(self._throughput(interval_steps, time.perf_counter() - interval_start))
          memory_gib = peak_memory_gib(jax.local_devices())
          if memory_gib is not None:
            host["peak_memory_gib"] = memory_gib
          evaluation = self.evaluate() if evaluate_now else None
          self._log_evaluation(step, {**host, **(evaluation or {})}, evaluation)
          interval_start, interval_steps = time.perf_counter(), 0
        for callback in self.callbacks:
          callback(self, step)
        self.logger.advance(step)
        if (self.checkpoints is not None and config.checkpoint_every
            and step % config.checkpoint_every == 0 and step < config.steps):
          # Asynchronous; the end of the run saves anyway.
          self.checkpoints.save(step, self.state, self.data_iterator)
        watchdog.feed()
        if stop is not None and stop.stop_now(step, config.stop_check_every):
          return {"stopped_at": step, "started_at": start_step,
                  "signal": stop.signal_name or "another process",
                  "elapsed_s": time.perf_counter() - wall_start}
    if previous is not None:
      check_skipped_steps(sharding.to_host(previous["skipped_consecutive"]), config.steps,
                          config.max_consecutive_skips)
    if start_step >= config.steps:  # a finished run: evaluated (and logged) when it ended
      evaluation = self.evaluate()
    return {"steps": config.steps, "elapsed_s": time.perf_counter() - wall_start,
            "final_loss": float(host["loss"]) if host else None,
            "skipped_total": int(sharding.to_host(self.state.skipped_total)), **evaluation}

  def _log_evaluation(self, step: int, record: dict, evaluation: dict | None) -> None:
    """Logs `record` at `step`, and the evaluation (if any) as a line of its own."""
    self.logger.log(step, record)
    if evaluation:
      self.logger.message(f"step {step}: {format_metrics(evaluation)}")

  def _throughput(self, steps: int, seconds: float) -> dict:
    if steps == 0 or seconds <= 0:
      return {}
    tokens_per_s = steps * self.config.tokens_per_step / seconds
    result = {"tokens_per_s": tokens_per_s, "step_time_s": seconds / steps}
    if self.peak_flops is not None:
      result["mfu"] = (tokens_per_s * self.flops_per_token
                       / (self.peak_flops * jax.device_count()))
    return result

  def evaluate(self) -> dict:
    """Held-out metrics on the first `eval_batches` micro-batches of the eval source, read in
    order (the same rows at every evaluation). Synthetic tasks: recall accuracy (fraction of
    labelled positions predicted exactly, as `lalte_jax.data.score_recall`) and the CE on those
    positions. A corpus (a source with `bytes_per_token`): the next-token CE `eval_loss` (nats)
    and its perplexity and bits per byte (`lalte_jax.eval.perplexity.nll_metrics`, the bytes
    being the scored tokens times the split's mean bytes per token). {} without an eval source
    or with `eval_batches` 0."""
    config = self.config
    source = self.eval_source
    if source is None or config.eval_batches == 0:
      return {}
    rows = min(config.micro_batch_size, len(source))
    rows -= rows % max(sharding.batch_devices(self.mesh), jax.process_count())
    iterator = make_dataset(source, batch_size_per_process=rows // jax.process_count(),
                            seed=config.seed, shuffle=False, num_epochs=1,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())
    correct = scored = ce_sum = 0.0
    for index, local_batch in enumerate(iterator):
      if index >= config.eval_batches:
        break
      batch = sharding.global_batch(with_labels(local_batch), self.mesh)
      c, s, ce = sharding.to_host(self.eval_fn(self.state.params, batch))
      correct, scored, ce_sum = correct + float(c), scored + float(s), ce_sum + float(ce)
    if scored == 0:
      return {}
    if not hasattr(source, "bytes_per_token"):
      return {"eval_recall_accuracy": correct / scored, "eval_loss": ce_sum / scored,
              "eval_scored_tokens": int(scored)}
    num_bytes = None if source.bytes_per_token is None else scored * source.bytes_per_token
    text = nll_metrics(ce_sum, scored, num_bytes)
    return {"eval_loss": text["nll_per_token"], "eval_perplexity": text["perplexity"],
            **({"eval_bits_per_byte": text["bits_per_byte"]} if num_bytes else {}),
            "eval_scored_tokens": int(scored)}


def _eval_sums(graphdef, params, batch):
  """(correct argmax predictions, scored positions, summed CE) of one labelled batch."""
  logits_BTV = nnx.merge(graphdef, params)(batch["tokens"])
  scored_BT = batch["labels"] != IGNORE_LABEL
  correct = jnp.sum((jnp.argmax(logits_BTV, axis=-1) == batch["labels"]) & scored_BT)
  return correct, jnp.sum(scored_BT), masked_cross_entropy_sum(logits_BTV, batch["labels"])
