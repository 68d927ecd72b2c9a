"""Tokenizers loaded from a local file: HF `tokenizers` JSON, SentencePiece `.model`, or bytes.

`load_tokenizer(path)` picks the kind from the path: `None` -> byte-level; a `.json` file or a
directory holding `tokenizer.json` -> HF `tokenizers`; a `.model` file -> SentencePiece. Every
tokenizer has `encode(text) -> list[int]` (no special tokens added: the packer adds BOS itself,
§8.2), `encode_batch(texts)`, `decode(ids) -> str`, `vocab_size`, `bos_id`, `eos_id` (None when the
vocabulary has none) and `name` (recorded in the data metadata). Nothing here touches the network.

`train_bpe` trains a byte-level BPE tokenizer (specials `<s>` = 0 and `</s>` = 1) on texts and
writes it as `tokenizer.json` + `tokenizer_config.json`; `copy_tokenizer` copies such files (a
prepared corpus and a training run's export keep them, see `TOKENIZER_FILES`), and
`tokenizer_for_checkpoint` picks the tokenizer of an exported model: the one named, else the
export's own `tokenizer.json`, else bytes.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Iterable, Protocol, Sequence

# Special-token spellings tried, in order, when a HF tokenizer does not name its BOS/EOS.
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|endoftext|>")
# The files of a HF tokenizer, copied together (tokenizer.json is the one required).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model")
HF_TOKENIZER_FILE = TOKENIZER_FILES[0]
HF_TOKENIZER_CONFIG_FILE = TOKENIZER_FILES[1]


class Tokenizer(Protocol):
  name: str
  vocab_size: int
  bos_id: int | None
  eos_id: int | None

  def encode(self, text: str) -> list[int]: ...

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then BOS = 256 and EOS = 257 (vocab_size 258)."""
  name = "byte"
  vocab_size = 258
  bos_id = 256
  eos_id = 257

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.encode(text) for text in texts]

  def decode(self, ids: Sequence[int]) -> str:
    # Special ids carry no text; a cut multi-byte character decodes to U+FFFD, not an error.
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A HF `tokenizers` JSON file. BOS/EOS: the given tokens, else `tokenizer_config.json` beside
  the file, else the first of the usual spellings found in the vocabulary."""

  def __init__(self, path: pathlib.Path, *, bos_token: str | None = None,
               eos_token: str | None = None):
    try:
      import tokenizers  # pylint: disable=import-outside-toplevel
    except ImportError as error:
      raise ImportError(f"loading {path} needs the `tokenizers` package (pip install tokenizers)"
                        ) from error
    self.name = str(path)
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception for any unreadable file
      raise ValueError(f"tokenizer file {path} cannot be read by `tokenizers`: {error}") from None
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    configured = _read_hf_special_tokens(path.parent / "tokenizer_config.json")
    self.bos_id = self._special_id(bos_token or configured.get("bos_token"), _BOS_CANDIDATES, "BOS")
    self.eos_id = self._special_id(eos_token or configured.get("eos_token"), _EOS_CANDIDATES, "EOS")

  def _special_id(self, token: str | None, candidates: Sequence[str], role: str) -> int | None:
    if token is not None:
      token_id = self._tokenizer.token_to_id(token)
      if token_id is None:
        raise ValueError(f"{role} token {token!r} is not in the vocabulary of {self.name}")
      return token_id
    for candidate in candidates:
      token_id = self._tokenizer.token_to_id(candidate)
      if token_id is not None:
        return token_id
    return None

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    # The Rust side tokenizes the batch in parallel.
    encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [encoding.ids for encoding in encodings]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_hf_special_tokens(config_path: pathlib.Path) -> dict[str, str]:
  """bos_token / eos_token from a HF tokenizer_config.json (a string or {"content": ...})."""
  if not config_path.is_file():
    return {}
  config = json.loads(config_path.read_text(encoding="utf-8"))
  tokens = {}
  for field in ("bos_token", "eos_token"):
    value = config.get(field)
    if isinstance(value, dict):
      value = value.get("content")
    if isinstance(value, str):
      tokens[field] = value
  return tokens


class SentencePieceTokenizer:
  """A SentencePiece `.model` file; BOS/EOS as the model defines them (None when disabled)."""

  def __init__(self, path: pathlib.Path):
    try:
      import sentencepiece  # pylint: disable=import-outside-toplevel
    except ImportError as error:
      raise ImportError(f"loading {path} needs the `sentencepiece` package"
                        " (pip install sentencepiece)") from error
    self.name = str(path)
    self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    self.vocab_size = self._processor.get_piece_size()
    self.bos_id = self._processor.bos_id() if self._processor.bos_id() >= 0 else None
    self.eos_id = self._processor.eos_id() if self._processor.eos_id() >= 0 else None

  def encode(self, text: str) -> list[int]:
    return self._processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._processor.encode(list(texts), out_type=int)

  def decode(self, ids: Sequence[int]) -> str:
    return self._processor.decode([int(i) for i in ids])


def load_tokenizer(path: str | os.PathLike | None = None, *, bos_token: str | None = None,
                   eos_token: str | None = None) -> Tokenizer:
  """The tokenizer stored at `path` (see the module docstring); byte-level when `path` is None.

  `bos_token` / `eos_token` name the special tokens of a HF tokenizer whose files do not.
  Raises FileNotFoundError for a missing path and ValueError for an unknown kind of file.
  """
  if path is None:
    if bos_token is not None or eos_token is not None:
      raise ValueError("bos_token/eos_token apply to a HF tokenizer file; the byte-level tokenizer"
                       " has fixed ids (BOS 256, EOS 257)")
    return ByteTokenizer()
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"tokenizer file {path} does not exist")
  if path.is_dir():
    if not (path / "tokenizer.json").is_file():
      raise ValueError(f"tokenizer directory {path} has no tokenizer.json (a SentencePiece model"
                       " must be given as its .model file)")
    path = path / "tokenizer.json"
  if path.suffix == ".json":
    return HFTokenizer(path, bos_token=bos_token, eos_token=eos_token)
  if path.suffix == ".model":
    if bos_token is not None or eos_token is not None:
      raise ValueError("bos_token/eos_token cannot be set for a SentencePiece model: it defines"
                       " its own BOS/EOS ids")
    return SentencePieceTokenizer(path)
  raise ValueError(f"unknown tokenizer file {path}: expected a HF tokenizers .json file, a"
                   " directory holding tokenizer.json, or a SentencePiece .model file")


def encode_prompt(tokenizer: Tokenizer, text: str, *, vocab_size: int,
                  add_bos: bool = True) -> list[int]:
  """Token ids of a generation / evaluation prompt for a model with `vocab_size` ids.

  BOS is prepended (training packs every document as BOS + text, §8.2) when the tokenizer has one
  that the model's vocabulary holds: the byte tokenizer's BOS (256) does not exist in a 256-id
  tiny model, whose prompts then start with the text. Raises ValueError when a text id falls
  outside the model's vocabulary (a tokenizer that does not fit the model).
  """
  ids = tokenizer.encode(text)
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"tokenizer {tokenizer.name!r}: id {bad[0]} of the prompt is outside the"
                     f" model's vocabulary of {vocab_size}")
  bos = tokenizer.bos_id
  if add_bos and bos is not None and bos < vocab_size:
    return [bos] + ids
  return ids


def stop_ids(tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
  """The tokenizer's EOS as a generation stop id, when the model's vocabulary holds it."""
  eos = tokenizer.eos_id
  return (eos,) if eos is not None and eos < vocab_size else ()


def tokenizer_for_checkpoint(path: str | os.PathLike | None,
                             checkpoint: str | os.PathLike) -> Tokenizer:
  """The tokenizer at `path`; without one, the `tokenizer.json` an export holds (the trainer copies
  the corpus's there), else bytes. Missing files and unusable tokenizers raise ValueError."""
  if path is None and (pathlib.Path(checkpoint) / HF_TOKENIZER_FILE).is_file():
    path = checkpoint
  try:
    return load_tokenizer(path)
  except (FileNotFoundError, ImportError) as error:
    raise ValueError(f"tokenizer: {error}") from error


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | os.PathLike) -> HFTokenizer:
  """Trains a byte-level BPE tokenizer of at most `vocab_size` ids on `texts`, writes it into
  `directory` (tokenizer.json, and tokenizer_config.json naming BOS `<s>` and EOS `</s>`), and
  returns it loaded from there. Ids: `<s>` 0, `</s>` 1, the 256 byte symbols, then the merges, so
  any text encodes (no unknown token). The same texts give the same file."""
  if vocab_size < 258:
    raise ValueError(f"train_bpe: vocab_size {vocab_size} is below 258 (2 special tokens + 256"
                     " byte symbols)")
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError as error:
    raise ImportError("training a tokenizer needs the `tokenizers` package (pip install"
                      " tokenizers)") from error
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer=trainer)
  directory = pathlib.Path(directory)
  tokenizer.save(str(directory / HF_TOKENIZER_FILE))
  (directory / HF_TOKENIZER_CONFIG_FILE).write_text(
      json.dumps({"bos_token": "<s>", "eos_token": "</s>"}) + "\n", encoding="utf-8")
  return HFTokenizer(directory / HF_TOKENIZER_FILE)


def tokenizer_directory(source: str | os.PathLike) -> pathlib.Path:
  """The directory of the tokenizer files `source` names (ValueError without tokenizer.json)."""
  source = pathlib.Path(source)
  directory = source.parent if source.is_file() else source
  if (source.is_file() and source.name != HF_TOKENIZER_FILE) or \
      not (directory / HF_TOKENIZER_FILE).is_file():
    raise ValueError(f"tokenizer: {source} holds no {HF_TOKENIZER_FILE}")
  return directory


def copy_tokenizer(source: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
  """Copies the tokenizer files of `source` (a directory with tokenizer.json, or that file) into
  `out_dir`; returns their names. Raises ValueError when there is no tokenizer.json."""
  directory = tokenizer_directory(source)
  names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
  for name in names:
    shutil.copyfile(directory / name, pathlib.Path(out_dir) / name)
  return names


def copy_corpus_tokenizer(data_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
  """Copies the tokenizer files a prepared corpus keeps (lalte_jax/data/prepare.py) into
  `out_dir`, e.g. a model's export; returns their names ([] when the corpus has none)."""
  if not (pathlib.Path(data_dir) / HF_TOKENIZER_FILE).is_file():
    return []
  return copy_tokenizer(data_dir, out_dir)
