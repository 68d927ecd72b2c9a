"""Tokenize local text files and pack them into ArrayRecord shards of fixed-length sequences.

  lalte-prepare-data --input corpus/ more.jsonl --output-dir data/corpus-4k \
      --seq-len 4096 --tokenizer tokenizer.json --val-fraction 0.01

Inputs: text files (.txt, and the suffixes named with --text-suffix, e.g. .md or .py: one document
per file, or per non-empty line with --txt-document line), .jsonl (one JSON object per line, text
in --text-field), .parquet (column --text-field); a directory is searched recursively for those
suffixes, in sorted order. Documents are packed as §8.2 says (BOS per document, no EOS,
concatenated, cut into --seq-len sequences, tail dropped); the format is described in
lalte_jax/data/pretokenized.py. Read the result with
`lalte_jax.data.PretokenizedSource(output_dir)`.

--val-fraction F holds out about a fraction F of the documents, chosen by a hash of their index
(lalte_jax/data/heldout.py), and packs them into validation shards of their own, which the trainer
evaluates. --train-tokenizer V trains a byte-level BPE tokenizer of at most V ids on the training
documents (HF `tokenizers`; the same inputs give the same tokenizer) instead of using --tokenizer.
A HF tokenizer, trained or given, is kept beside the shards (tokenizer.json); training runs copy it
into their export, where generation and evaluation find it.

On a machine that can reach the Hugging Face hub, a dataset can be streamed instead of read from
files (needs the `datasets` package; nothing is downloaded in full, and the tests never go online):

  lalte-prepare-data --hf-dataset HuggingFaceFW/fineweb-edu --hf-config sample-10BT \
      --max-tokens 10_000_000_000 --output-dir data/fineweb_edu_4096 --tokenizer tokenizer.json

Bad inputs (a missing file or tokenizer, an empty directory, a non-empty output directory, too
little text for one sequence...) end with one line `error: ...` on stderr and exit status 2; the
output directory is then left as it was found (empty or absent).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
from typing import Iterator, Sequence

from lalte_jax import cli_boundary
from lalte_jax.data import heldout
from lalte_jax.data.pretokenized import SequencePacker, ShardWriter, write_metadata
from lalte_jax.data.tokenizer import (HF_TOKENIZER_CONFIG_FILE, HF_TOKENIZER_FILE, HFTokenizer,
                                      copy_tokenizer, load_tokenizer, train_bpe)

TEXT_SUFFIX = ".txt"
RECORD_SUFFIXES = (".jsonl", ".parquet")
VALIDATION_PREFIX = "validation"
_ENCODE_BATCH = 256  # documents tokenized per call (HF tokenizers parallelises a batch)


def expand_inputs(inputs: Sequence[str],
                  text_suffixes: Sequence[str] = (TEXT_SUFFIX,)) -> list[pathlib.Path]:
  """Files named on the command line, directories expanded (sorted); unknown suffixes refused."""
  suffixes = tuple(text_suffixes) + RECORD_SUFFIXES
  files = []
  for name in inputs:
    path = pathlib.Path(name)
    if path.is_dir():
      found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
      if not found:
        raise ValueError(f"--input: directory {path} holds no {'/'.join(suffixes)} file (read"
                         " other text files with --text-suffix)")
      files.extend(found)
    elif path.is_file():
      if path.suffix not in suffixes:
        raise ValueError(f"--input: {path}: unsupported input type {path.suffix!r}; expected one"
                         f" of {', '.join(suffixes)}, or name it with --text-suffix"
                         f" {path.suffix or '<suffix>'} to read it as text")
      files.append(path)
    else:
      raise FileNotFoundError(f"--input: {path} does not exist")
  return files


def read_documents(path: pathlib.Path, *, text_field: str, txt_document: str) -> Iterator[str]:
  """The documents of one input file, in file order (.jsonl / .parquet records, else text)."""
  if path.suffix == ".jsonl":
    with path.open(encoding="utf-8") as lines:
      for line_number, line in enumerate(lines, start=1):
        if not line.strip():
          continue
        try:
          record = json.loads(line)
        except json.JSONDecodeError as error:
          raise ValueError(f"{path}:{line_number}: not a JSON object ({error})") from None
        if not isinstance(record, dict) or text_field not in record:
          fields = sorted(record) if isinstance(record, dict) else type(record).__name__
          raise ValueError(f"{path}:{line_number}: no field {text_field!r} (use --text-field);"
                           f" fields: {fields}")
        yield record[text_field]
  elif path.suffix == ".parquet":
    import pyarrow.parquet  # pylint: disable=import-outside-toplevel
    parquet_file = pyarrow.parquet.ParquetFile(path)
    if text_field not in parquet_file.schema_arrow.names:
      raise ValueError(f"{path}: no column {text_field!r} (use --text-field); columns:"
                       f" {parquet_file.schema_arrow.names}")
    for batch in parquet_file.iter_batches(columns=[text_field]):
      yield from batch.column(0).to_pylist()
  else:
    text = path.read_text(encoding="utf-8")
    if txt_document == "file":
      yield text
    else:
      yield from (line for line in text.splitlines() if line.strip())


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


def _batched(items: Iterator, size: int) -> Iterator[list]:
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = cli_boundary.ArgumentParser(
      prog="lalte-prepare-data", description=__doc__.split("\n\n", 1)[0],
      example="python -m lalte_jax.data.prepare --input docs --text-suffix .md --output-dir runs/text_data"
              " --seq-len 256 --train-tokenizer 2048 --val-fraction 0.1")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--input", nargs="+", help="text/.jsonl/.parquet files or directories")
  source.add_argument("--hf-dataset", help="a Hugging Face dataset name, streamed (online only)")
  parser.add_argument("--hf-config", default=None, help="its configuration (subset) name")
  parser.add_argument("--hf-split", default="train")
  parser.add_argument("--max-tokens", type=int, default=None,
                      help="stop once this many tokens are packed (for streamed corpora)")
  parser.add_argument("--output-dir", required=True, help="new (or empty) directory for the shards")
  parser.add_argument("--seq-len", type=int, default=4096)
  tokenizer = parser.add_mutually_exclusive_group()
  tokenizer.add_argument("--tokenizer", default=None,
                         help="HF tokenizer.json (or its directory) or SentencePiece .model;"
                              " byte-level when neither this nor --train-tokenizer is given")
  tokenizer.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE",
                         help="train a byte-level BPE tokenizer of at most VOCAB_SIZE ids (>= 258)"
                              " on the training documents")
  parser.add_argument("--bos-token", default=None, help="BOS token of a HF tokenizer, if not found")
  parser.add_argument("--val-fraction", type=float, default=0.0,
                      help="hold out about this fraction of the documents as a validation split"
                           " (0: none; the trainer then holds out the last shard)")
  parser.add_argument("--text-field", default="text", help="JSONL field / parquet column")
  parser.add_argument("--text-suffix", action="append", default=[], metavar="SUFFIX",
                      help="also read files with this suffix as text, like .txt (repeatable;"
                           " e.g. --text-suffix .md --text-suffix .py)")
  parser.add_argument("--txt-document", choices=("file", "line"), default="file",
                      help="a text file is one document, or each non-empty line is one")
  parser.add_argument("--sequences-per-shard", type=int, default=8192)
  parser.add_argument("--prefix", default="train", help="shard file name prefix")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return parser.parse_args(argv)


def _check_args(args: argparse.Namespace) -> None:
  """Refuses inconsistent options before anything is read or written."""
  if args.seq_len <= 0:
    raise ValueError(f"--seq-len must be positive, got {args.seq_len}")
  if args.sequences_per_shard <= 0:
    raise ValueError(f"--sequences-per-shard must be positive, got {args.sequences_per_shard}")
  if args.max_tokens is not None and args.max_tokens < args.seq_len:
    raise ValueError(f"--max-tokens {args.max_tokens} is less than one sequence ({args.seq_len})")
  if not 0.0 <= args.val_fraction < 1.0:
    raise ValueError(f"--val-fraction must lie in [0, 1), got {args.val_fraction}")
  if args.val_fraction and args.prefix == VALIDATION_PREFIX:
    raise ValueError(f"--prefix {VALIDATION_PREFIX!r} is the validation shards' prefix")
  for suffix in args.text_suffix:
    if not suffix.startswith(".") or len(suffix) < 2 or suffix in RECORD_SUFFIXES:
      raise ValueError(f"--text-suffix {suffix!r}: expected a file suffix such as .md, other than"
                       f" {', '.join(RECORD_SUFFIXES)}")
  if args.train_tokenizer is not None:
    if args.train_tokenizer < 258:
      raise ValueError(f"--train-tokenizer {args.train_tokenizer}: a byte-level BPE vocabulary"
                       " needs at least 258 ids (256 bytes, <s>, </s>)")
    if args.hf_dataset or args.bos_token:
      raise ValueError("--train-tokenizer trains on local --input files, with BOS <s>; it does not"
                       " combine with --hf-dataset or --bos-token")


def _documents(args: argparse.Namespace, files: list[pathlib.Path]) -> Iterator[tuple[str, str]]:
  """(source name, text) of every document: each local file's, or the streamed dataset's."""
  if args.hf_dataset:
    for text in stream_hf_documents(args.hf_dataset, config=args.hf_config, split=args.hf_split,
                                    text_field=args.text_field):
      yield args.hf_dataset, text
  for path in files:
    for text in read_documents(path, text_field=args.text_field, txt_document=args.txt_document):
      yield path.name, text


class _Split:
  """One split being packed: its sequence packer, its shards and the UTF-8 bytes of its text."""

  def __init__(self, output_dir: pathlib.Path, args: argparse.Namespace, prefix: str,
               bos_id: int):
    self.packer = SequencePacker(args.seq_len, bos_id)
    self.writer = ShardWriter(output_dir, args.seq_len,
                              sequences_per_shard=args.sequences_per_shard, prefix=prefix)
    self.num_bytes = 0

  def add(self, text: str, token_ids: Sequence[int]) -> None:
    self.num_bytes += len(text.encode("utf-8"))
    for sequence in self.packer.add_document(token_ids):
      self.writer.write(sequence)

  def summary(self) -> dict:
    """Its metadata fields (lalte_jax/data/pretokenized.py); closes the last shard."""
    shards = self.writer.close()
    return {"num_sequences": sum(shard["num_sequences"] for shard in shards),
            "num_documents": self.packer.num_documents, "num_tokens": self.packer.num_tokens,
            "num_dropped_tokens": self.packer.num_dropped_tokens, "num_bytes": self.num_bytes,
            "shards": shards}


def _tokenizer(args: argparse.Namespace, files: list[pathlib.Path], output_dir: pathlib.Path):
  """The tokenizer to pack with, trained or loaded; a HF one is written into `output_dir`."""
  if args.train_tokenizer is not None:
    training_texts = (text for index, (_, text) in enumerate(_documents(args, files))
                      if not heldout.held_out_document(index, args.val_fraction))
    return train_bpe(training_texts, args.train_tokenizer, output_dir)
  tokenizer = load_tokenizer(args.tokenizer, bos_token=args.bos_token)
  if isinstance(tokenizer, HFTokenizer):
    copy_tokenizer(args.tokenizer, output_dir)
    if args.bos_token is not None:  # the copy must find the same BOS
      config_path = output_dir / HF_TOKENIZER_CONFIG_FILE
      config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
      config_path.write_text(json.dumps({**config, "bos_token": args.bos_token}, indent=2) + "\n",
                             encoding="utf-8")
  return tokenizer


def _prepare(args: argparse.Namespace, files: list[pathlib.Path], output_dir: pathlib.Path) -> dict:
  """Writes the shards, the tokenizer files and metadata.json into `output_dir`; the metadata."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  tokenizer = _tokenizer(args, files, output_dir)
  if tokenizer.bos_id is None:
    raise ValueError(f"tokenizer {tokenizer.name} has no BOS token; name it with --bos-token")
  splits = {"train": _Split(output_dir, args, args.prefix, tokenizer.bos_id)}
  if args.val_fraction:
    splits["validation"] = _Split(output_dir, args, VALIDATION_PREFIX, tokenizer.bos_id)
  with contextlib.ExitStack() as stack:
    for split in splits.values():
      stack.enter_context(split.writer)
    progress = stack.enter_context(tqdm(unit=" docs", disable=args.no_progress, desc="tokenizing"))
    num_tokens = 0
    for batch in _batched(enumerate(_documents(args, files)), _ENCODE_BATCH):
      progress.set_description_str(batch[-1][1][0])
      encoded = tokenizer.encode_batch([text for _, (_, text) in batch])
      for (index, (_, text)), token_ids in zip(batch, encoded):
        held_out = heldout.held_out_document(index, args.val_fraction)
        splits["validation" if held_out else "train"].add(text, token_ids)
      num_tokens = sum(split.packer.num_tokens for split in splits.values())
      progress.update(len(batch))
      progress.set_postfix(tokens=num_tokens, refresh=False)
      if args.max_tokens is not None and num_tokens >= args.max_tokens:
        break
  summaries = {name: split.summary() for name, split in splits.items()}
  train = summaries["train"]
  if not train["shards"]:
    raise ValueError(f"the training documents hold {train['num_tokens']} tokens, fewer than one"
                     f" sequence of --seq-len {args.seq_len}")
  metadata = {
      "seq_len": args.seq_len,
      "vocab_size": tokenizer.vocab_size,
      "bos_id": tokenizer.bos_id,
      "eos_id": tokenizer.eos_id,
      "tokenizer": tokenizer.name,
      "tokenizer_file": HF_TOKENIZER_FILE if isinstance(tokenizer, HFTokenizer) else None,
      **train,
      "inputs": ([os.fspath(path) for path in files] if files else
                 [f"hf:{args.hf_dataset}/{args.hf_config or ''}:{args.hf_split}"]),
  }
  if args.train_tokenizer is not None:
    metadata["tokenizer_training"] = {"model": "byte-level BPE", "max_vocab_size":
                                      args.train_tokenizer, "documents": "the training split"}
  if "validation" in summaries:
    validation = summaries["validation"]
    if not validation["shards"]:
      raise ValueError(f"the validation split holds {validation['num_tokens']} tokens of"
                       f" {validation['num_documents']} documents, fewer than one sequence of"
                       f" --seq-len {args.seq_len}; raise --val-fraction or lower --seq-len")
    metadata["validation"] = {**validation, "fraction": args.val_fraction,
                              "selection": heldout.SELECTION}
  write_metadata(output_dir, metadata)
  return metadata


def run(argv: Sequence[str] | None = None) -> dict:
  """Runs the CLI; returns the metadata written. Bad inputs raise ValueError / OSError, and leave
  the output directory as it was (empty or absent)."""
  args = parse_args(argv)
  _check_args(args)
  text_suffixes = (TEXT_SUFFIX, *args.text_suffix)
  files = expand_inputs(args.input, text_suffixes) if args.input else []
  output_dir = pathlib.Path(args.output_dir)
  if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())):
    raise FileExistsError(f"--output-dir {output_dir} is not an empty directory; choose a new one")
  created = not output_dir.exists()
  output_dir.mkdir(parents=True, exist_ok=True)
  try:
    metadata = _prepare(args, files, output_dir)
  except BaseException:
    for path in output_dir.iterdir():  # all written here: the directory was empty
      path.unlink()
    if created:
      output_dir.rmdir()
    raise
  validation = metadata.get("validation")
  held_out = (f"; validation: {validation['num_sequences']} sequences from"
              f" {validation['num_documents']} documents" if validation else "")
  print(f"{metadata['num_sequences']} sequences of {args.seq_len} tokens from"
        f" {metadata['num_documents']} documents in {len(metadata['shards'])} shards{held_out}"
        f" -> {output_dir}", file=sys.stderr)
  return metadata


@cli_boundary.reports_bad_input
def main(argv: Sequence[str] | None = None) -> int:
  """`lalte-prepare-data` / `python -m lalte_jax.data.prepare`; exit status 2 for bad inputs."""
  run(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
