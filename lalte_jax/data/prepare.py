"""Tokenize local text files and pack them into ArrayRecord shards of fixed-length sequences.

  lalte-prepare-data --input corpus/ more.jsonl --output-dir data/corpus-4k \
      --seq-len 4096 --tokenizer tokenizer.json

Inputs: .txt (one document per file, or per non-empty line with --txt-document line), .jsonl (one
JSON object per line, text in --text-field), .parquet (column --text-field); a directory is
searched recursively for those suffixes, in sorted order. Documents are packed as
§8.2 says (BOS per document, no EOS, concatenated, cut into --seq-len sequences, tail dropped); the
format is described in lalte_jax/data/pretokenized.py. Read the result with
`lalte_jax.data.PretokenizedSource(output_dir)`.

On a machine that can reach the Hugging Face hub, a dataset can be streamed instead of read from
files (needs the `datasets` package; nothing is downloaded in full, and the tests never go online):

  lalte-prepare-data --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \
      --max-tokens 10_000_000_000 --output-dir data/fineweb_edu_4096 --tokenizer tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Iterator, Sequence

from lalte_jax.data.pretokenized import SequencePacker, ShardWriter, write_metadata
from lalte_jax.data.tokenizer import load_tokenizer

SUFFIXES = (".txt", ".jsonl", ".parquet")
_ENCODE_BATCH = 256  # documents tokenized per call (HF tokenizers parallelises a batch)


def expand_inputs(inputs: Sequence[str]) -> list[pathlib.Path]:
  """Files named on the command line, directories expanded (sorted); unknown suffixes refused."""
  files = []
  for name in inputs:
    path = pathlib.Path(name)
    if path.is_dir():
      found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
      if not found:
        raise ValueError(f"directory {path} holds no {'/'.join(SUFFIXES)} file")
      files.extend(found)
    elif path.is_file():
      if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported input type {path.suffix!r}; expected one of"
                         f" {', '.join(SUFFIXES)}")
      files.append(path)
    else:
      raise FileNotFoundError(f"input {path} does not exist")
  return files


def read_documents(path: pathlib.Path, *, text_field: str, txt_document: str) -> Iterator[str]:
  """The documents of one input file, in file order."""
  if path.suffix == ".txt":
    text = path.read_text(encoding="utf-8")
    if txt_document == "file":
      yield text
    else:
      yield from (line for line in text.splitlines() if line.strip())
  elif path.suffix == ".jsonl":
    with path.open(encoding="utf-8") as lines:
      for line_number, line in enumerate(lines, start=1):
        if not line.strip():
          continue
        record = json.loads(line)
        if text_field not in record:
          raise KeyError(f"{path}:{line_number}: no field {text_field!r} (use --text-field);"
                         f" fields: {sorted(record)}")
        yield record[text_field]
  else:
    import pyarrow.parquet  # pylint: disable=import-outside-toplevel
    parquet_file = pyarrow.parquet.ParquetFile(path)
    if text_field not in parquet_file.schema_arrow.names:
      raise KeyError(f"{path}: no column {text_field!r} (use --text-field); columns:"
                     f" {parquet_file.schema_arrow.names}")
    for batch in parquet_file.iter_batches(columns=[text_field]):
      yield from batch.column(0).to_pylist()


def stream_hf_documents(name: str, *, config: str | None, split: str,
                        text_field: str) -> Iterator[str]:
  """Texts of a Hugging Face dataset, streamed (`datasets.load_dataset(..., streaming=True)`)."""
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError("--hf-dataset needs the `datasets` package (pip install datasets)") from error
  for row in datasets.load_dataset(name, config, split=split, streaming=True):
    if text_field not in row:
      raise ValueError(f"--hf-dataset {name}: rows have no field {text_field!r} (fields:"
                       f" {sorted(row)}); choose one with --text-field")
    yield row[text_field]


def _batched(items: Iterator[str], size: int) -> Iterator[list[str]]:
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="lalte-prepare-data", description=__doc__.split("\n\n", 1)[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--input", nargs="+", help=".txt/.jsonl/.parquet files or directories")
  source.add_argument("--hf-dataset", help="a Hugging Face dataset name, streamed (online only)")
  parser.add_argument("--hf-config", default=None, help="its configuration (subset) name")
  parser.add_argument("--hf-split", default="train")
  parser.add_argument("--max-tokens", type=int, default=None,
                      help="stop once this many tokens are packed (for streamed corpora)")
  parser.add_argument("--output-dir", required=True, help="new (or empty) directory for the shards")
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--tokenizer", default=None,
                      help="HF tokenizer.json (or its directory) or SentencePiece .model;"
                           " byte-level when omitted")
  parser.add_argument("--bos-token", default=None, help="BOS token of a HF tokenizer, if not found")
  parser.add_argument("--text-field", default="text", help="JSONL field / parquet column")
  parser.add_argument("--txt-document", choices=("file", "line"), default="file",
                      help="a .txt file is one document, or each non-empty line is one")
  parser.add_argument("--sequences-per-shard", type=int, default=8192)
  parser.add_argument("--prefix", default="train", help="shard file name prefix")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return parser.parse_args(argv)


def _sources(args: argparse.Namespace,
             files: list[pathlib.Path]) -> Iterator[tuple[str, Iterator[str]]]:
  """(name, documents) per input: each local file, or the one streamed dataset."""
  if args.hf_dataset:
    yield args.hf_dataset, stream_hf_documents(args.hf_dataset, config=args.hf_config,
                                               split=args.hf_split, text_field=args.text_field)
  for path in files:
    yield path.name, read_documents(path, text_field=args.text_field,
                                    txt_document=args.txt_document)


def run(argv: Sequence[str] | None = None) -> dict:
  """Runs the CLI; returns the metadata written."""
  args = parse_args(argv)
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  if args.max_tokens is not None and args.max_tokens < args.seq_len:
    raise ValueError(f"--max-tokens {args.max_tokens} is less than one sequence ({args.seq_len})")
  files = expand_inputs(args.input) if args.input else []
  tokenizer = load_tokenizer(args.tokenizer, bos_token=args.bos_token)
  if tokenizer.bos_id is None:
    raise ValueError(f"tokenizer {tokenizer.name} has no BOS token; name it with --bos-token")
  output_dir = pathlib.Path(args.output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  if any(output_dir.iterdir()):
    raise FileExistsError(f"output directory {output_dir} is not empty")

  packer = SequencePacker(args.seq_len, tokenizer.bos_id)
  with ShardWriter(output_dir, args.seq_len, sequences_per_shard=args.sequences_per_shard,
                   prefix=args.prefix) as writer, \
       tqdm(unit=" docs", disable=args.no_progress, desc="tokenizing") as progress:
    for name, documents in _sources(args, files):
      progress.set_description_str(name)
      for texts in _batched(documents, _ENCODE_BATCH):
        for token_ids in tokenizer.encode_batch(texts):
          for sequence in packer.add_document(token_ids):
            writer.write(sequence)
        progress.update(len(texts))
        progress.set_postfix(tokens=packer.num_tokens, refresh=False)
        if args.max_tokens is not None and packer.num_tokens >= args.max_tokens:
          break
      if args.max_tokens is not None and packer.num_tokens >= args.max_tokens:
        break

  if not writer.shards:
    raise ValueError(f"the inputs hold {packer.num_tokens} tokens, fewer than one sequence of"
                     f" --seq-len {args.seq_len}")
  metadata = {
      "seq_len": args.seq_len,
      "vocab_size": tokenizer.vocab_size,
      "bos_id": tokenizer.bos_id,
      "eos_id": tokenizer.eos_id,
      "tokenizer": tokenizer.name,
      "num_sequences": sum(shard["num_sequences"] for shard in writer.shards),
      "num_documents": packer.num_documents,
      "num_tokens": packer.num_tokens,
      "num_dropped_tokens": packer.num_dropped_tokens,
      "shards": writer.shards,
      "inputs": ([os.fspath(path) for path in files] if files else
                 [f"hf:{args.hf_dataset}/{args.hf_config or ''}:{args.hf_split}"]),
  }
  write_metadata(output_dir, metadata)
  print(f"{metadata['num_sequences']} sequences of {args.seq_len} tokens from"
        f" {packer.num_documents} documents in {len(writer.shards)} shards -> {output_dir}",
        file=sys.stderr)
  return metadata


def main(argv: Sequence[str] | None = None) -> int:
  """`lalte-prepare-data` / `python -m lalte_jax.data.prepare`."""
  run(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
