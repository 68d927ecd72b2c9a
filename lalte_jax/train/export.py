"""Params-only export of a training run, in the layout `lalte_jax.inference.checkpoint` loads.

`python -m lalte_jax.train.export --run_dir DIR [--step N] --out OUT [--dtype bfloat16]` reads the train
checkpoint of step N (default: the newest complete one) in `DIR/checkpoints`, and writes its model
parameters with the full ModelConfig (custom overrides included) to OUT, which
`python -m lalte_jax.generate --checkpoint OUT` and `lalte_jax.inference.checkpoint.load_model`
read. An existing OUT is an error, unless `--overwrite` is given and OUT is a params export
(anything else is never deleted). Bad inputs exit 2 with a one-line error. The trainer also
exports automatically at the end of a run into `<run_dir>/export`, in
`TrainConfig.export_dtype`: float32 by default, i.e. the master weights themselves, so the export
loses nothing (the model still computes in its `dtype`); bfloat16 halves the files. A run on a
corpus that keeps a tokenizer.json gets a copy of its tokenizer files in the export.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import sys


from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # before JAX creates a backend

import jax  # pylint: disable=wrong-import-position

from lalte_jax import cli_boundary  # pylint: disable=wrong-import-position
from lalte_jax.config import ModelConfig  # pylint: disable=wrong-import-position
from lalte_jax.data import tokenizer as tokenizer_files  # pylint: disable=wrong-import-position
from lalte_jax.inference import checkpoint as params_checkpoint  # pylint: disable=wrong-import-position

RUN_EXPORT_DIR = "export"


def export_state_params(params: dict, model_config: ModelConfig, out: str | pathlib.Path, *,
                        dtype: str = "float32") -> str:
  """Writes a train state's `params` (nnx pure dict, any sharding) to `out`, replacing what is
  there; every process calls it. Returns the absolute path."""
  out = pathlib.Path(out).absolute()
  if jax.process_index() == 0 and out.exists():
    shutil.rmtree(out)
  if jax.process_count() > 1:  # nobody writes before process 0 has cleared the directory
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(f"export:{out}")
  params_checkpoint.save_param_dict(params, model_config, out, dtype)
  return str(out)


def check_out(out: str | pathlib.Path, overwrite: bool) -> None:
  """Raises ValueError unless `out` is free, or may be replaced: `overwrite` and a params export."""
  out = pathlib.Path(out)
  if not out.exists():
    return
  if not overwrite:
    raise ValueError(f"export: --out {out} already exists (--overwrite replaces a params export)")
  try:
    params_checkpoint.read_config_name(out)
  except ValueError:
    raise ValueError(f"export: --out {out} exists and is not a params export; not replacing it"
                     ) from None


def export_checkpoint(run_dir: str | pathlib.Path, out: str | pathlib.Path, *,
                      step: int | None = None, dtype: str = "float32",
                      overwrite: bool = False) -> str:
  """Exports the parameters of the train checkpoint `step` (default: newest) of `run_dir`.
  An existing `out` is replaced only with `overwrite` and only if it is a params export."""
  # Imported here: they pull in the trainer's config and model code.
  from lalte_jax.train import checkpointing, sharding  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.step import init_train_state  # pylint: disable=import-outside-toplevel
  check_out(out, overwrite)
  directory = pathlib.Path(run_dir) / checkpointing.CHECKPOINT_DIR
  if not directory.is_dir():
    raise ValueError(f"export: run_dir {run_dir} has no {checkpointing.CHECKPOINT_DIR}/ directory"
                     " (expected the output_dir of a training run)")
  checkpoints = checkpointing.RunCheckpoints(directory, keep=1, read_only=True)
  if step is not None and step not in checkpoints.all_steps():
    raise ValueError(f"export: --step {step}: {directory} holds no complete checkpoint of that"
                     f" step (steps {checkpoints.all_steps()})")
  step = checkpoints.latest_step() if step is None else step
  if step is None:
    raise ValueError(f"export: {directory} holds no complete checkpoint")
  config = checkpoints.restore_config(step)
  model_config = config.model_config()
  shapes = jax.eval_shape(functools.partial(init_train_state, model_config, config),
                          jax.random.key(0))
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  state = checkpoints.restore(
      checkpointing.abstract_like(shapes, sharding.train_state_shardings(shapes, mesh)),
      step=step)
  checkpoints.close()
  path = export_state_params(state.params, model_config, out, dtype=dtype)
  export_corpus_tokenizer(config, path)
  return path


def export_corpus_tokenizer(config, out: str | pathlib.Path) -> list[str]:
  """Copies the tokenizer files of the run's corpus (a TrainConfig's `data_dir`, when it keeps a
  tokenizer.json) into the export `out`, where generation and evaluation find them."""
  if config.data != "pretokenized":
    return []
  return tokenizer_files.copy_corpus_tokenizer(config.data_dir, out)


@cli_boundary.reports_bad_input
def main(argv: list[str] | None = None) -> int:
  parser = cli_boundary.ArgumentParser(
      prog="python -m lalte_jax.train.export", description=__doc__.splitlines()[0],
      example="python -m lalte_jax.train.export --run_dir runs/readme_demo --out"
              " runs/readme_demo/export_bf16 --dtype bfloat16")
  parser.add_argument("--run_dir", required=True, help="the run's output_dir")
  parser.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
  parser.add_argument("--out", required=True, help="directory to write (must not exist)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace --out if it is a params export")
  parser.add_argument("--dtype", choices=params_checkpoint.PARAM_DTYPES, default="float32",
                      help="stored parameter dtype (loading always gives float32)")
  args = parser.parse_args(argv)
  path = export_checkpoint(args.run_dir, args.out, step=args.step, dtype=args.dtype,
                           overwrite=args.overwrite)
  print(f"exported {args.dtype} parameters to {path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
