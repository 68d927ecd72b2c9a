"""CLI: `python -m lalte_jax.train --config lalte_jax/configs/<exp>.py [--set key=value ...]`.

Multi-process: pass --coordinator_address host:port --num_processes N --process_id i (or set
LALTE_COORDINATOR_ADDRESS / LALTE_NUM_PROCESSES / LALTE_PROCESS_ID) on every process.
If a process dies the others abort (exit status 134) within --heartbeat_timeout_s seconds
(default 100; lalte_jax/train/distributed.py).
The run saves checkpoints in <output_dir>/checkpoints and resumes from the newest complete one
when started again with the same output_dir (see lalte_jax/train/checkpointing.py); at the end it exports
the parameters for inference into <output_dir>/export. SIGTERM or SIGINT (Ctrl-C) saves the
current step and exits 0; running the same command again continues from there.
Exit codes: 0 done (or stopped by a signal after saving), 2 bad configuration, 3 stopped after
too many non-finite-gradient steps, 4 no step finished within step_timeout_s (lalte_jax/train/watchdog.py).
"""

from __future__ import annotations

import argparse
import os
import sys

# XLA:CPU in jaxlib 0.10.2 can deadlock (every thread idle, block_until_ready never returns) when
# its XNNPACK fusions run on a small thread pool, as on 2-core machines; seen with the tiny laLTE
# train step. The flag only affects the CPU backend. Set before JAX creates its backends.
if "xla_cpu_use_xnnpack" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_xnnpack=false"
                             ).strip()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="lalte-train", description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="experiment file exposing get_config()")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="KEY=VALUE", help="override a TrainConfig field (repeatable)")
  parser.add_argument("--coordinator_address", default=None)
  parser.add_argument("--num_processes", type=int, default=None)
  parser.add_argument("--process_id", type=int, default=None)
  parser.add_argument("--heartbeat_timeout_s", type=int, default=None,
                      help="multi-process: seconds after which a silent peer counts as dead"
                           " and every process aborts (default: LALTE_HEARTBEAT_TIMEOUT_S or 100)")
  args = parser.parse_args(argv)

  from lalte_jax.train import distributed  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.config import load_config  # pylint: disable=import-outside-toplevel
  try:
    config = load_config(args.config, args.overrides)
  except (ValueError, FileNotFoundError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  distributed.initialize_distributed(args.coordinator_address, args.num_processes,
                                     args.process_id,
                                     heartbeat_timeout_seconds=args.heartbeat_timeout_s)

  import jax  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.checkpointing import RunCheckpoints  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.step import TooManySkippedSteps  # pylint: disable=import-outside-toplevel
  from lalte_jax.train.trainer import Trainer  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    print(f"{config.model_name}: {jax.device_count()} devices on {jax.process_count()}"
          f" process(es), {config.steps} steps of {config.global_batch_size} x {config.seq_len}"
          f" tokens, output in {config.run_dir}", flush=True)
  checkpoints = RunCheckpoints.for_run(config)
  try:
    try:
      trainer = Trainer(config, checkpoints=checkpoints)
    except ValueError as error:
      print(f"error: {error}", file=sys.stderr)
      return 2
    try:
      summary = trainer.run()
    except TooManySkippedSteps as error:
      trainer.logger.close()
      print(f"error: {error}", file=sys.stderr)
      return 3
  finally:
    checkpoints.close()  # waits for saves still being written
  if jax.process_index() == 0:
    if "stopped_at" in summary:
      print(f"stopped by {summary['signal']} after step {summary['stopped_at']}; checkpoint"
            f" {summary['checkpoint']}; run the same command again to resume", flush=True)
      return 0
    if "eval_recall_accuracy" in summary:
      print(f"held-out recall accuracy {summary['eval_recall_accuracy']:.3f} on"
            f" {summary['eval_scored_tokens']} queries", flush=True)
    print(f"checkpoint: {summary['checkpoint']}\nexported parameters: {summary['export']}"
          f" (python -m lalte_jax.generate --checkpoint {summary['export']} ...)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
