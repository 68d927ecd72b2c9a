"""`python -m lalte_jax.convert from-hf DIR --out EXPORT_DIR` and `to-hf EXPORT_DIR --out DIR`.

from-hf: an authors' Hugging Face checkpoint directory (config.json + safetensors, one file or
  shards with their index) -> our params export, which `lalte_jax.inference.checkpoint.load_model`,
  `python -m lalte_jax.generate` and `python -m lalte_jax.eval` read. `--dtype` is the stored
  parameter dtype (loading gives float32 either way); `--with-tokenizer` copies tokenizer.json
  (and tokenizer_config.json, special_tokens_map.json, tokenizer.model if present) into the
  export, so `--tokenizer EXPORT_DIR` works.
to-hf: a params export (ours, or one made by from-hf) -> a directory the authors' code and FLA
  load with `from_pretrained`; `--tokenizer PATH` copies a tokenizer into it.
Bad inputs exit 2 with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from lalte_jax import cli_boundary


def build_parser() -> argparse.ArgumentParser:
  parser = cli_boundary.ArgumentParser(
      prog="python -m lalte_jax.convert", description=__doc__.splitlines()[0],
      example="python -m lalte_jax.convert from-hf ckpt/gated-deltanet-lte-0.4B-10B --out"
              " ckpt/lalte-0.4b --with-tokenizer")
  commands = parser.add_subparsers(dest="command", required=True)
  from_hf = commands.add_parser("from-hf", help="Hugging Face checkpoint -> params export")
  from_hf.add_argument("source", help="directory with config.json and safetensors weights")
  from_hf.add_argument("--out", required=True, help="export directory to create")
  from_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                       help="stored parameter dtype (loading always gives float32)")
  from_hf.add_argument("--with-tokenizer", action="store_true",
                       help="copy the source's tokenizer files into the export (error if absent)")
  to_hf = commands.add_parser("to-hf", help="params export -> Hugging Face checkpoint")
  to_hf.add_argument("source", help="params export directory (model.json + params/)")
  to_hf.add_argument("--out", required=True, help="checkpoint directory to create")
  to_hf.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="dtype of the stored tensors")
  to_hf.add_argument("--tokenizer", help="tokenizer.json or a directory holding it, copied in")
  to_hf.add_argument("--max-shard-gb", type=float, default=5.0,
                     help="larger checkpoints are split into shards with an index")
  return parser


def from_hf(args) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  from lalte_jax.convert import api  # pylint: disable=import-outside-toplevel
  from lalte_jax.inference import checkpoint  # pylint: disable=import-outside-toplevel
  source, out = pathlib.Path(args.source), pathlib.Path(args.out)
  if args.with_tokenizer:  # checked before anything is written
    api.tokenizer_directory(source)
  if out.exists():
    raise ValueError(f"out: {out} already exists")
  config, params, _ = api.read_hf(source)
  checkpoint.save_param_dict(jax.tree.map(jax.numpy.asarray, params), config, out, args.dtype)
  (out / api.SOURCE_CONFIG_FILE).write_text(json.dumps(api.read_hf_config(source), indent=2))
  copied = api.copy_tokenizer(source, out) if args.with_tokenizer else []
  count = sum(x.size for x in jax.tree.leaves(params))
  layers = ",".join(sorted(set(config.layer_pattern)))
  return (f"converted {source} ({count:,} parameters; {config.num_layers} layers: {layers}) to"
          f" {out.absolute()} ({args.dtype}" + (f"; tokenizer: {', '.join(copied)})" if copied
                                                else ")"))


def to_hf(args) -> str:
  from lalte_jax.convert import api  # pylint: disable=import-outside-toplevel
  if args.max_shard_gb <= 0:
    raise ValueError(f"--max-shard-gb: must be positive, got {args.max_shard_gb}")
  out = api.save_hf(args.source, args.out, dtype=args.dtype, tokenizer=args.tokenizer,
                    max_shard_bytes=int(args.max_shard_gb * 1024**3))
  files = sorted(p.name for p in out.iterdir())
  return f"wrote {out.absolute()}: {', '.join(files)}"


@cli_boundary.reports_bad_input
def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  print((from_hf if args.command == "from-hf" else to_hf)(args))
  return 0
