"""Run metrics: a JSONL log, TensorBoard events, a progress bar with ETA, throughput, MFU, memory.

Only process 0 writes (`enabled=False` elsewhere). Scalars go to every sink (the progress bar
shows `BAR_METRICS`, held-out ones until the next evaluation); per-LTE-layer/head
arrays ([L_lte, Hkv]: lambda, retention count and its EMA) go to the JSONL log as nested lists and
to TensorBoard as one scalar per layer and head (`lte_lambda/layer03/head1`).

MFU = model FLOPs per second / (peak FLOP/s per device x devices), with model FLOPs per token
= 6 N + attention terms (forward + backward = 3x forward) and N the parameters that multiply
activations (the embedding table counts only when it doubles as the LM head). Attention terms use
the mean number of keys per query of each mixer; they are estimates of useful work (no remat,
no masked-out blocks), the usual convention for MFU. `peak_memory_gib` is the largest peak of the
process's own devices (process 0's in a multi-process run, whose devices hold equal shards).
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import numpy as np

from lalte_jax.config import ModelConfig
from lalte_jax.model import count_parameters

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity).
PEAK_FLOPS_BY_DEVICE_KIND = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
                             ("B200", 2250e12))


def _mean_keys(seq_len: int, window: int | None) -> float:
  """Mean over queries t < T of min(t + 1, window) (window None = full causal)."""
  if window is None or window >= seq_len:
    return (seq_len + 1) / 2
  return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Training FLOPs (forward + backward) per token of a [B, seq_len] batch (module doc)."""
  matmul_params = count_parameters(config)
  if not config.tie_embeddings:  # the lookup table is not a matmul; the separate head is
    matmul_params -= config.vocab_size * config.hidden_size
  forward_mixer = 0.0
  for kind in config.layer_pattern:
    if kind == "attention":
      a = config.attention
      forward_mixer += 4 * a.num_heads * a.head_dim * _mean_keys(seq_len, a.window_size)
    elif kind == "lte":  # window plus about `cap` kept tokens once the controller has converged
      e = config.lte
      keys = _mean_keys(seq_len, e.window_keys) + min(e.cap, max(seq_len - e.window_keys, 0))
      forward_mixer += 4 * e.num_heads * e.head_dim * keys
    elif kind == "nsa":
      n = config.nsa
      keys = (_mean_keys(seq_len, n.window_size) + n.block_count * n.block_size
              + seq_len / (2 * n.block_size))
      forward_mixer += 4 * n.num_heads * n.head_dim * keys
    elif kind == "gdn":  # chunked delta rule: state read/update + intra-chunk attention
      g = config.gdn
      forward_mixer += g.num_heads * (4 * g.head_dim * g.value_dim
                                      + 2 * g.chunk_size * (2 * g.head_dim + g.value_dim))
  return 6.0 * matmul_params + 3.0 * forward_mixer


def peak_flops_per_device(device_kind: str, override_tflops: float = 0.0) -> float | None:
  if override_tflops > 0:
    return override_tflops * 1e12
  for name, flops in PEAK_FLOPS_BY_DEVICE_KIND:
    if name.lower() in device_kind.lower():
      return flops
  return None  # CPU or unknown: MFU is not reported


def peak_memory_gib(devices) -> float | None:
  """The largest `peak_bytes_in_use` of `devices` since their process started, in GiB; None
  where the backend keeps no memory statistics (CPU)."""
  peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use") for device in devices]
  peaks = [peak for peak in peaks if peak is not None]
  return max(peaks) / 2**30 if peaks else None


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA running out of device memory (at compile or at run time)."""
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


# Shown on the progress bar: the training step's metrics, then the latest held-out evaluation's.
BAR_METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "eval_loss", "eval_perplexity",
               "eval_bits_per_byte", "eval_recall_accuracy")


def format_metrics(metrics: dict) -> str:
  """`name value` pairs of the scalar metrics, 4 significant digits (for log lines)."""
  return ", ".join(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"
                   for name, value in metrics.items())


def _to_python(value):
  array = np.asarray(value)
  if array.ndim == 0:
    return array.item()
  return array.tolist()


def _drop_records_after(path: pathlib.Path, step: int) -> None:
  """Keeps the records of steps <= `step`: a run resumed from a checkpoint at `step` redoes the
  later ones, so the log holds every step once (a torn last line from a kill is dropped too)."""
  if not path.exists():
    return
  kept = []
  for line in path.read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and record.get("step", 0) <= step:
      kept.append(line + "\n")
  temporary = path.with_suffix(".jsonl.tmp")
  temporary.write_text("".join(kept), encoding="utf-8")
  temporary.replace(path)


class MetricsLogger:
  """Writes `metrics.jsonl` (and TensorBoard events) under `output_dir`; drives the progress bar."""

  def __init__(self, output_dir: str | pathlib.Path, *, total_steps: int, initial_step: int = 0,
               tensorboard: bool = True, progress_bar: bool = True, enabled: bool = True):
    self.enabled = enabled
    self._jsonl = self._tb = self._bar = None
    self._postfix: dict[str, str] = {}
    if not enabled:
      return
    self.output_dir = pathlib.Path(output_dir)
    self.output_dir.mkdir(parents=True, exist_ok=True)
    jsonl_path = self.output_dir / "metrics.jsonl"
    _drop_records_after(jsonl_path, initial_step)
    self._jsonl = open(jsonl_path, "a", encoding="utf-8")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
        self._tb = SummaryWriter(str(self.output_dir / "tensorboard"))
      except ImportError:
        print("metrics: tensorboardX is not installed; no TensorBoard events are written")
    if progress_bar:
      try:
        from tqdm import tqdm  # pylint: disable=import-outside-toplevel
        self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                         smoothing=0.1)
      except ImportError:
        print("metrics: tqdm is not installed; no progress bar")

  def log(self, step: int, metrics: dict) -> None:
    """One record: scalars and [L, H] arrays (numpy or jax, already on the host or not)."""
    if not self.enabled:
      return
    record = {"step": step, "time": time.time()}
    record.update({name: _to_python(value) for name, value in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for name, value in record.items():
        if name in ("step", "time"):
          continue
        array = np.asarray(value, dtype=np.float64)
        if array.ndim == 0:
          self._tb.add_scalar(name, float(array), step)
        elif array.ndim == 2:
          for layer, head in np.ndindex(array.shape):
            self._tb.add_scalar(f"{name}/layer{layer:02d}/head{head}", array[layer, head], step)
    if self._bar is not None:  # the newest value of each, held until it changes
      self._postfix.update({k: f"{record[k]:.3g}" for k in BAR_METRICS
                            if isinstance(record.get(k), float) and math.isfinite(record[k])})
      self._bar.set_postfix({k: self._postfix[k] for k in BAR_METRICS if k in self._postfix},
                            refresh=False)

  def advance(self, step: int) -> None:
    """Moves the bar to `step` (steps completed)."""
    if self._bar is not None and step > self._bar.n:
      self._bar.update(step - self._bar.n)

  def message(self, text: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    for sink in (self._bar, self._tb, self._jsonl):
      if sink is not None:
        sink.close()
    self._jsonl = self._tb = self._bar = None
