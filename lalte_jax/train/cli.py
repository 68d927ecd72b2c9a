"""CLI: `python -m lalte_jax.train --config lalte_jax/configs/<exp>.py [--set key=value ...]`.

Multi-process: pass --coordinator_address host:port --num_processes N --process_id i (or set
LALTE_COORDINATOR_ADDRESS / LALTE_NUM_PROCESSES / LALTE_PROCESS_ID) on every process.
If a process dies the others abort (exit status 134) within --heartbeat_timeout_s seconds
(default 100; lalte_jax/train/distributed.py).
The run saves checkpoints in <output_dir>/checkpoints and resumes from the newest complete one
when started again with the same output_dir (see lalte_jax/train/checkpointing.py); at the end it exports
the parameters for inference into <output_dir>/export (`--set save_checkpoints=false`: neither,
only the metrics). SIGTERM or SIGINT (Ctrl-C) saves the
current step and exits 0; running the same command again continues from there.
Exit codes: 0 done (or stopped by a signal after saving), 2 bad input (a one-line error naming
it: config file, field, value, path, flag; lalte_jax/cli_boundary.py), 3 stopped after too many
non-finite-gradient steps, 4 no step finished within step_timeout_s (lalte_jax/train/watchdog.py).
`--list-fields` prints every field a config may set (lalte_jax/train/config_fields.py).
SIGUSR1 prints every thread's Python stack to stderr (for a process that seems stuck) and the
run goes on.
"""

from __future__ import annotations

import argparse
import faulthandler
import pathlib
import signal
import sys


from lalte_jax import xla_flags  # pylint: disable=wrong-import-position

xla_flags.apply_workarounds()  # before JAX creates a backend

from lalte_jax import cli_boundary  # pylint: disable=wrong-import-position


def build_parser() -> argparse.ArgumentParser:
  from lalte_jax.train.config import shipped_configs  # pylint: disable=import-outside-toplevel
  parser = cli_boundary.ArgumentParser(
      prog="python -m lalte_jax.train", description=__doc__.splitlines()[0],
      notes=[f"shipped configs (--config NAME): {', '.join(shipped_configs())}; or the path of a"
             " Python file whose get_config() returns a TrainConfig.",
             "config fields: --set NAME=VALUE sets any TrainConfig field, --set model.NAME=VALUE"
             " any field of the model preset (model.lte.window=32); --list-fields prints them all"
             " with their types, defaults and descriptions."],
      exit_codes={0: "done, or stopped by SIGTERM/SIGINT after saving",
                  3: "too many non-finite steps in a row (max_consecutive_skips)",
                  4: "no step finished within step_timeout_s (watchdog)",
                  5: "the step does not fit the devices' memory (the message names the"
                     " settings that save memory)",
                  134: "multi-process: a peer died"},
      example="python -m lalte_jax.train --config readme_demo --set output_dir=runs/demo"
              " --set steps=100")
  parser.add_argument("--config", help="a shipped config's name or an experiment file exposing"
                      " get_config() (required unless --list-fields)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override a TrainConfig field (repeatable)")
  parser.add_argument("--list-fields", action="store_true",
                      help="print every field a config may set, and exit")
  parser.add_argument("--coordinator_address", default=None)
  parser.add_argument("--num_processes", type=int, default=None)
  parser.add_argument("--process_id", type=int, default=None)
  parser.add_argument("--heartbeat_timeout_s", type=int, default=None,
                      help="multi-process: seconds after which a silent peer counts as dead"
                           " and every process aborts (default: LALTE_HEARTBEAT_TIMEOUT_S or 100)")
  return parser


@cli_boundary.reports_bad_input
def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.list_fields:
    from lalte_jax.train.config_fields import describe_fields  # pylint: disable=import-outside-toplevel
    print(describe_fields())
    return 0
  if args.config is None:
    parser.error("the following arguments are required: --config")
  if sys.__stderr__ is not None:  # the process's own stderr, also when sys.stderr is replaced
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)

  from lalte_jax.train import distributed  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.config import load_config  # pylint: disable=import-outside-toplevel
  config = load_config(args.config, args.overrides)
  if config.reproducible:  # XLA reads its flags when the first backend starts, just below
    xla_flags.apply(*xla_flags.REPRODUCIBLE_GPU, replace=True)
  if pathlib.Path(config.run_dir).exists() and not pathlib.Path(config.run_dir).is_dir():
    raise ValueError(f"TrainConfig.output_dir: {config.run_dir} exists and is not a directory")
  distributed.initialize_distributed(args.coordinator_address, args.num_processes,
                                     args.process_id,
                                     heartbeat_timeout_seconds=args.heartbeat_timeout_s)

  import jax  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.checkpointing import CHECKPOINT_DIR, RunCheckpoints  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.step import TooManySkippedSteps  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import StepOutOfMemory, Trainer  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    print(f"{config.model_name}: {jax.device_count()} devices on {jax.process_count()}"
          f" process(es), {config.steps} steps of {config.global_batch_size} x {config.seq_len}"
          f" tokens, output in {config.run_dir}", flush=True)
  checkpoints = None
  if config.save_checkpoints:
    checkpoints = RunCheckpoints.for_run(config)
  elif (pathlib.Path(config.run_dir) / CHECKPOINT_DIR).exists():  # its metrics would be cut
    raise ValueError(f"TrainConfig.save_checkpoints: False, but {config.run_dir} holds a run's"
                     " checkpoints; choose another output_dir")
  try:
    trainer = Trainer(config, checkpoints=checkpoints)
    try:
      summary = trainer.run()
    except (TooManySkippedSteps, StepOutOfMemory) as error:
      trainer.logger.close()
      print(f"error: {error}", file=sys.stderr)
      return 3 if isinstance(error, TooManySkippedSteps) else 5
  finally:
    if checkpoints is not None:
      checkpoints.close()  # waits for saves still being written
  if jax.process_index() == 0:
    if "stopped_at" in summary:
      saved = (f"checkpoint {summary['checkpoint']}; run the same command again to resume"
               if "checkpoint" in summary else "nothing saved (save_checkpoints=false)")
      print(f"stopped by {summary['signal']} after step {summary['stopped_at']}; {saved}",
            flush=True)
      return 0
    if "eval_recall_accuracy" in summary:
      print(f"held-out recall accuracy {summary['eval_recall_accuracy']:.3f} on"
            f" {summary['eval_scored_tokens']} queries", flush=True)
    if "export" in summary:
      print(f"checkpoint: {summary['checkpoint']}\nexported parameters: {summary['export']}"
            f" (python -m lalte_jax.generate --checkpoint {summary['export']} ...)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
