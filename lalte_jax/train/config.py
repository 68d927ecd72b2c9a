"""The trainer's configuration: one frozen, validated dataclass, and `--set key=value` overrides.

An experiment file `lalte_jax/configs/<exp>.py` exposes `get_config() -> TrainConfig`; the CLI applies
`--set` overrides on top with `apply_overrides`, which converts each value to the field's type and
raises `ValueError` naming any key that is not a field (a typo must never be silently ignored).

Custom models: `model_overrides` changes fields of the preset's ModelConfig, by dotted name
(`{"hidden_size": 128, "lte.window": 32}` in a config file, or `--set model.lte.window=32` on the
command line, the value read as a Python literal: `--set model.layer_pattern="('gdn','lte')"`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import sys
import typing

from lalte_jax.config import REMAT_POLICIES, ModelConfig
from lalte_jax.data import curricula, pretokenized
from lalte_jax.presets import SIZES, VARIANTS, get_model_config
from lalte_jax.train import model_overrides as overrides_lib

DATA_KINDS = ("mqar", "passkey", "pretokenized")
DTYPES = ("float32", "bfloat16")
MODEL_OVERRIDE_PREFIX = "model."


def _require(condition: bool, field: str, message: str) -> None:
  if not condition:
    raise ValueError(f"TrainConfig.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run needs; a run is reproducible from this and nothing else."""
  # Model: the preset "<variant>-<size>" (lalte_jax.presets), compute dtype, remat, scan.
  variant: str = "lalte"
  size: str = "tiny"
  model_dtype: str = "bfloat16"  # activations/matmuls; parameters stay float32 (master weights)
  remat: str = "none"
  scan_layers: bool = True
  # Changes to the preset's ModelConfig by dotted field name, e.g. {"lte.window": 32}; a dict in
  # config files, stored as sorted (name, value) pairs so that the config stays hashable.
  model_overrides: tuple = ()
  # Data. "mqar"/"passkey" are generated on the fly from (index, seed); "curriculum:<name>" mixes
  # them as the named curriculum of lalte_jax/data/curricula.py does (reading the mqar_* fields);
  # "pretokenized" reads the ArrayRecord shards that lalte_jax/data/prepare.py writes into
  # `data_dir`, trains on its training split and evaluates its held-out documents
  # (lalte_jax/data/heldout.py); the model's vocabulary is then the corpus's unless
  # `model.vocab_size` is set (`with_data_vocab`).
  data: str = "mqar"
  data_dir: str = ""
  seq_len: int = 256
  mqar_num_kv_pairs: int = 8
  mqar_min_gap: int = 0
  mqar_prefix_len: int = 0  # filler tokens before the key-value region
  num_train_examples: int = 1_000_000
  num_eval_examples: int = 256
  # Batch: `global_batch_size` sequences per optimizer step over all devices, split into
  # `grad_accum_steps` micro-batches that run one after the other.
  global_batch_size: int = 16
  grad_accum_steps: int = 1
  # Cross-entropy over chunks of this many of a micro-batch's B*T positions, the logits of one
  # chunk at a time, recomputed in the backward pass (lalte_jax/loss.py): saves the float32
  # [B, T, V] logits and their gradient for a second head matmul. Any N > 0 works (a last chunk
  # that N does not fill is padded with unscored positions); 0 = the whole logits at once.
  loss_chunk_tokens: int = 0
  # Optimisation (§8.1).
  steps: int = 200
  warmup_steps: int = 20
  lr: float = 3e-4
  lr_min_ratio: float = 0.1
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-15
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  max_consecutive_skips: int = 10
  # End the process (exit 4) when no step finishes for this long (0: off); for multi-host runs,
  # where a stuck but living peer would otherwise hang every process (lalte_jax/train/watchdog.py).
  step_timeout_s: float = 0.0
  # True: GPU results repeat to the last bit, run after run and in any process layout (one process
  # over N GPUs, or N processes), at a cost in step time (lalte-0.4b on 4 H200s: 0.34 s a step
  # against 0.19 s): XLA's deterministic ops and every all-reduce through NCCL
  # (lalte_jax.xla_flags.REPRODUCIBLE_GPU). The CLI sets those flags before JAX starts; a program
  # that builds a Trainer itself must put them in XLA_FLAGS before its first JAX call.
  reproducible: bool = False
  # LTE sparsity controller (§4.6).
  lte_lambda_init: float = 1e-9
  lte_lambda_min: float = 1e-9
  lte_lambda_max: float = 1.0
  lte_alpha_up: float = 1.5
  lte_alpha_down: float = 2.0  # lambda is divided by this when the count is below target
  lte_update_every: int = 32
  lte_tolerance_low: float = 0.95
  lte_tolerance_high: float = 1.0
  # Router warm-up (the reference's `routing_freeze_steps`, 0 in the paper's runs): for the first
  # N steps every token is kept and the router gets no gradient; the controller then starts from
  # its initial state (lalte_jax/train/router_warmup.py). With `lte_routing_freeze_learns` the
  # router learns during those N steps from the straight-through gradient of reads that see
  # every token (still every token kept, no sparsity loss). With `lte_routing_freeze_anneal` as
  # well, an evicted token stays visible with a probability that falls linearly from 1 at the
  # first step to 0 at the end of the warm-up, so the switch to routing comes gradually. With
  # `lte_router_frozen_after_warmup` the routers stop learning when a learning warm-up ends (no
  # update, no gradient through the scores): the model then trains on the selection function
  # the warm-up learned. With `lte_router_sparsity_only_after_warmup` they keep learning after it,
  # from the sparsity loss alone (no straight-through gradient of the task loss), so the
  # controller still holds their count at the cap. With `lte_router_threshold_rate` r > 0 and
  # frozen routers, each router's output bias (its keep threshold) moves after every step by
  # -r ln(c / b) (c: the step's retention count of that layer and head, b: the cap), so the
  # count settles at the cap while the frozen router's order of tokens stays.
  lte_routing_freeze_steps: int = 0
  lte_routing_freeze_learns: bool = False
  lte_routing_freeze_anneal: bool = False
  lte_router_frozen_after_warmup: bool = False
  lte_router_sparsity_only_after_warmup: bool = False
  lte_router_threshold_rate: float = 0.0
  # Parallelism: mesh axis sizes; -1 on `mesh_data` takes all remaining devices.
  mesh_data: int = -1
  mesh_fsdp: int = 1
  mesh_tensor: int = 1
  # Run.
  seed: int = 42
  output_dir: str = ""  # "" = runs/<variant>-<size>
  log_every: int = 10
  # Held-out evaluation (recall on synthetic tasks; loss, perplexity and bits per byte on a corpus's
  # validation data) on `eval_batches` micro-batches, every `eval_every` steps (and before the
  # first step) when positive, and always at the end; eval_batches=0 evaluates nothing.
  eval_every: int = 0
  eval_batches: int = 4
  tensorboard: bool = True
  progress_bar: bool = True
  peak_tflops_per_device: float = 0.0  # for MFU; 0 = look up from the device kind
  # Checkpoints in <run_dir>/checkpoints (lalte_jax/train/checkpointing.py): every
  # `checkpoint_every` steps (0 = only at the end and on SIGTERM/SIGINT), the newest
  # `checkpoint_keep` kept. `resume` continues from the newest intact one (damaged ones are skipped
  # and moved to checkpoints/damaged; the model must be the one they were saved with, see
  # lalte_jax/train/resume.py). resume=False refuses to start where checkpoints exist and moves or
  # deletes nothing: to start afresh, use a new output_dir. At the end the parameters are exported
  # for inference into <run_dir>/export in `export_dtype` (float32 = the master weights, lossless).
  # `checkpoint_keep_every` > 0 also keeps every checkpoint whose step it divides (a multiple of
  # `checkpoint_every`), e.g. a point to start other runs from.
  checkpoint_every: int = 100
  checkpoint_keep: int = 3
  checkpoint_keep_every: int = 0
  # False: the run writes only its metrics (no checkpoint, no export) and resumes nothing, e.g.
  # for benchmarks; the CLI then refuses an output_dir that holds checkpoints.
  save_checkpoints: bool = True
  # Multi-process runs agree on a SIGTERM/SIGINT every `stop_check_every` steps (the agreement is a
  # collective that waits for the step in flight, so checking every step would stall dispatch).
  # One process checks its own flag every step.
  stop_check_every: int = 10
  resume: bool = True
  export_dtype: str = "float32"

  def __post_init__(self):
    try:
      normalised = overrides_lib.normalise(self.model_overrides)
    except ValueError as error:
      raise ValueError(f"TrainConfig.model_overrides: {error}") from None
    object.__setattr__(self, "model_overrides", normalised)
    _require(self.variant in VARIANTS, "variant", f"{self.variant!r} is not one of {VARIANTS}")
    _require(self.size in SIZES, "size", f"{self.size!r} is not one of {SIZES}")
    _require(self.model_dtype in DTYPES, "model_dtype", f"{self.model_dtype!r} not in {DTYPES}")
    _require(self.remat in REMAT_POLICIES, "remat",
             f"{self.remat!r} is not one of {REMAT_POLICIES}")
    try:
      curriculum = curricula.curriculum_name(self.data)
    except ValueError as error:
      raise ValueError(f"TrainConfig.data: {error}") from None
    _require(curriculum is not None or self.data in DATA_KINDS, "data",
             f"{self.data!r} is not one of {DATA_KINDS} or"
             f" {curricula.CURRICULUM_PREFIX}<one of {sorted(curricula.CURRICULA)}>")
    _require(self.data != "pretokenized" or bool(self.data_dir), "data_dir",
             "data='pretokenized' needs the directory that lalte_jax/data/prepare.py wrote")
    for name in ("seq_len", "mqar_num_kv_pairs", "num_train_examples", "num_eval_examples",
                 "global_batch_size", "grad_accum_steps", "steps", "warmup_steps", "lr",
                 "adam_eps", "clip_norm", "max_consecutive_skips", "lte_lambda_init",
                 "lte_lambda_min", "lte_lambda_max", "lte_alpha_up", "lte_alpha_down",
                 "lte_update_every", "mesh_fsdp", "mesh_tensor", "log_every"):
      _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)!r}")
    _require(self.mqar_min_gap >= 0 and self.mqar_prefix_len >= 0, "mqar_min_gap",
             f"gap and prefix must be >= 0, got {self.mqar_min_gap}, {self.mqar_prefix_len}")
    _require(0 <= self.lte_routing_freeze_steps <= self.steps, "lte_routing_freeze_steps",
             f"must be in [0, steps={self.steps}], got {self.lte_routing_freeze_steps}")
    _require(not self.lte_routing_freeze_learns or self.lte_routing_freeze_steps > 0,
             "lte_routing_freeze_learns", "needs a warm-up (lte_routing_freeze_steps > 0)")
    for name in ("lte_routing_freeze_anneal", "lte_router_frozen_after_warmup",
                 "lte_router_sparsity_only_after_warmup"):
      _require(not getattr(self, name) or self.lte_routing_freeze_learns, name,
               "needs a learning warm-up (lte_routing_freeze_learns)")
    _require(not (self.lte_router_frozen_after_warmup
                  and self.lte_router_sparsity_only_after_warmup),
             "lte_router_sparsity_only_after_warmup",
             "excludes lte_router_frozen_after_warmup (a frozen router learns from nothing)")
    _require(self.lte_router_threshold_rate >= 0.0, "lte_router_threshold_rate",
             f"must be >= 0 (0 = off), got {self.lte_router_threshold_rate!r}")
    _require(not self.lte_router_threshold_rate or self.lte_router_frozen_after_warmup,
             "lte_router_threshold_rate",
             "needs lte_router_frozen_after_warmup (it sets the threshold of frozen routers)")
    _require(self.loss_chunk_tokens >= 0, "loss_chunk_tokens",
             f"must be >= 0 (0 = no chunking), got {self.loss_chunk_tokens!r}")
    _require(self.step_timeout_s >= 0, "step_timeout_s",
             f"must be >= 0 (0 disables the watchdog), got {self.step_timeout_s!r}")
    _require(self.mesh_data == -1 or self.mesh_data > 0, "mesh_data",
             f"must be positive or -1 (all remaining devices), got {self.mesh_data}")
    _require(self.warmup_steps < self.steps, "warmup_steps",
             f"{self.warmup_steps} must be below steps={self.steps} (the cosine needs a decay)")
    _require(0.0 <= self.lr_min_ratio <= 1.0, "lr_min_ratio", f"{self.lr_min_ratio} not in [0,1]")
    _require(0.0 <= self.adam_b1 < 1.0 and 0.0 <= self.adam_b2 < 1.0, "adam_b1",
             f"betas must lie in [0, 1), got ({self.adam_b1}, {self.adam_b2})")
    _require(self.weight_decay >= 0.0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
    _require(self.global_batch_size % self.grad_accum_steps == 0, "grad_accum_steps",
             f"{self.grad_accum_steps} does not divide global_batch_size={self.global_batch_size}")
    _require(self.lte_lambda_min <= self.lte_lambda_init <= self.lte_lambda_max, "lte_lambda_init",
             f"need lambda_min <= lambda_init <= lambda_max, got {self.lte_lambda_min},"
             f" {self.lte_lambda_init}, {self.lte_lambda_max}")
    _require(0.0 < self.lte_tolerance_low <= self.lte_tolerance_high, "lte_tolerance_low",
             f"need 0 < low <= high, got ({self.lte_tolerance_low}, {self.lte_tolerance_high})")
    _require(0 <= self.seed < 2**32, "seed", f"must be in [0, 2**32), got {self.seed}")
    _require(self.eval_every >= 0, "eval_every",
             f"must be >= 0 (0 = only at the end), got {self.eval_every}")
    _require(self.eval_batches >= 0, "eval_batches",
             f"must be >= 0 (0 = no evaluation), got {self.eval_batches}")
    _require(self.checkpoint_every >= 0, "checkpoint_every",
             f"must be >= 0 (0 = only at the end), got {self.checkpoint_every}")
    _require(self.stop_check_every > 0, "stop_check_every",
             f"must be positive, got {self.stop_check_every}")
    _require(self.checkpoint_keep > 0, "checkpoint_keep",
             f"must be positive, got {self.checkpoint_keep}")
    _require(self.checkpoint_keep_every == 0 or (
        self.checkpoint_keep_every > 0 and self.checkpoint_every > 0
        and self.checkpoint_keep_every % self.checkpoint_every == 0), "checkpoint_keep_every",
             f"must be 0 or a positive multiple of checkpoint_every={self.checkpoint_every},"
             f" got {self.checkpoint_keep_every}")
    _require(self.export_dtype in DTYPES, "export_dtype", f"{self.export_dtype!r} not in {DTYPES}")
    model = self.model_config()  # the preset must exist (e.g. pure_lte has no 1.4b) and validate
    _require(self.lte_routing_freeze_steps == 0 or model.num_lte_layers > 0,
             "lte_routing_freeze_steps", f"model {model.name!r} has no LTE layer to warm up")

  @property
  def model_name(self) -> str:
    return f"{self.variant}-{self.size}"

  @property
  def run_dir(self) -> str:
    """Where logs (and later checkpoints) go: `output_dir`, or runs/<variant>-<size>."""
    return self.output_dir or f"runs/{self.model_name}"

  @property
  def curriculum(self) -> str | None:
    """The curriculum name of `data` = "curriculum:<name>", else None."""
    return curricula.curriculum_name(self.data)

  @property
  def micro_batch_size(self) -> int:
    """Sequences per micro-batch over all devices."""
    return self.global_batch_size // self.grad_accum_steps

  @property
  def tokens_per_step(self) -> int:
    return self.global_batch_size * self.seq_len

  def model_config(self) -> ModelConfig:
    try:
      base = get_model_config(self.model_name)
    except ValueError as error:
      raise ValueError(f"TrainConfig.variant/size: {error}") from None
    try:
      base = overrides_lib.apply(base, self.model_overrides)
    except ValueError as error:
      raise ValueError(f"TrainConfig.model_overrides {dict(self.model_overrides)}: {error}"
                       ) from None
    return base.replace(dtype=self.model_dtype, remat=self.remat, scan_layers=self.scan_layers,
                        max_position_embeddings=max(base.max_position_embeddings, self.seq_len))

  def replace(self, **changes) -> TrainConfig:
    return dataclasses.replace(self, **changes)

  def with_data_vocab(self) -> TrainConfig:
    """This config with `model.vocab_size` set to the vocabulary in the corpus's metadata.json
    when the data is pretokenized and the override is not set; otherwise the config itself.
    `load_config` (when the corpus exists) and the Trainer apply it, so the checkpoints of a run
    record the resolved size."""
    if self.data != "pretokenized" or "vocab_size" in dict(self.model_overrides):
      return self
    try:
      vocab_size = pretokenized.read_metadata(self.data_dir)["vocab_size"]
    except (OSError, ValueError) as error:
      raise ValueError(f"TrainConfig.data_dir: {error}") from None
    return self.replace(model_overrides={**dict(self.model_overrides), "vocab_size": vocab_size})


def _parse_value(key: str, text: str, annotation) -> object:
  """Converts `text` to the field type (`int`, `float`, `bool`, `str`)."""
  if annotation is bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
      return True
    if lowered in ("0", "false", "no", "off"):
      return False
    raise ValueError(f"--set {key}={text}: expected a boolean (true/false)")
  try:
    if annotation is int:
      return int(text.replace("_", ""))
    if annotation is float:
      return float(text)
  except ValueError:
    raise ValueError(f"--set {key}={text}: expected {annotation.__name__}") from None
  return text


def apply_overrides(config: TrainConfig, assignments: typing.Sequence[str]) -> TrainConfig:
  """`config` with each "key=value" applied; unknown keys and bad values raise ValueError."""
  field_types = typing.get_type_hints(TrainConfig)
  changes, model_changes = {}, dict(config.model_overrides)
  for assignment in assignments:
    key, sep, text = assignment.partition("=")
    key = key.strip()
    if not sep:
      raise ValueError(f"--set {assignment!r}: expected key=value")
    if key.startswith(MODEL_OVERRIDE_PREFIX):
      model_changes[key[len(MODEL_OVERRIDE_PREFIX):]] = _parse_literal(text)
      continue
    if key not in field_types or key == "model_overrides":
      raise ValueError(f"--set: unknown config key {key!r}; valid keys:"
                       f" {sorted(set(field_types) - {'model_overrides'})} and"
                       f" {MODEL_OVERRIDE_PREFIX}<ModelConfig field>")
    changes[key] = _parse_value(key, text, field_types[key])
  if model_changes != dict(config.model_overrides):
    changes["model_overrides"] = model_changes
  return config.replace(**changes)


def _parse_literal(text: str):
  """A Python literal (number, bool, None, tuple...); anything else is taken as a string."""
  try:
    return ast.literal_eval(text.strip())
  except (ValueError, SyntaxError):
    return text.strip()


def config_from_dict(data: dict) -> TrainConfig:
  """The TrainConfig of `dataclasses.asdict(config)` (e.g. read back from a checkpoint's JSON)."""
  names = {field.name for field in dataclasses.fields(TrainConfig)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(f"TrainConfig: unknown fields {unknown} (saved by another version?)")
  return TrainConfig(**data)


SHIPPED_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
  """Names of the experiment configs shipped in `lalte_jax/configs` (`repro/capacity` style)."""
  return sorted(str(p.relative_to(SHIPPED_CONFIGS).with_suffix("")) for p in
                SHIPPED_CONFIGS.rglob("*.py") if p.name != "__init__.py")


def resolve_config_path(text: str) -> pathlib.Path:
  """A config file from a path, or from the name of a shipped config (`readme_demo`)."""
  path = pathlib.Path(text)
  if path.is_file():
    return path
  shipped = SHIPPED_CONFIGS / f"{text.removesuffix('.py')}.py"
  if shipped.is_file():
    return shipped
  raise FileNotFoundError(f"config {text!r} is neither a file nor a shipped config (shipped:"
                          f" {', '.join(shipped_configs())})")


def load_config(path: str | pathlib.Path, overrides: typing.Sequence[str] = ()) -> TrainConfig:
  """Imports the experiment file at `path`, calls its `get_config()`, applies `overrides`, and
  takes the model's vocabulary from a pretokenized corpus that exists (`with_data_vocab`).

  `path` is a file or the name of a shipped config (`readme_demo`, `repro/capacity`). It may end in
  `:<arg>` (`repro/capacity:lalte`): the file's `get_config(arg)` is then called with that string,
  so that one file can hold a family of experiments.
  """
  argument = None
  text = str(path)
  if ":" in text and not pathlib.Path(text).is_file():
    text, argument = text.rsplit(":", 1)
  path = resolve_config_path(text)
  spec = importlib.util.spec_from_file_location(f"_train_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  # Registered while it runs: dataclasses defined in the file look their module up by name.
  sys.modules[spec.name] = module
  try:
    spec.loader.exec_module(module)
  except SyntaxError as error:  # the user's file; other exceptions in it keep their traceback
    raise ValueError(f"config file {str(path)!r}: {error.msg} (line {error.lineno})") from None
  finally:
    del sys.modules[spec.name]
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {str(path)!r} has no get_config() function")
  config = module.get_config() if argument is None else module.get_config(argument)
  if not isinstance(config, TrainConfig):
    raise ValueError(f"{path}: get_config() returned {type(config).__name__}, not TrainConfig")
  config = apply_overrides(config, overrides)
  # A config may be loaded before its corpus exists (to inspect it); the Trainer resolves the
  # vocabulary then, and needs the corpus.
  if (pathlib.Path(config.data_dir) / pretokenized.METADATA_FILENAME).is_file():
    config = config.with_data_vocab()
  return config
