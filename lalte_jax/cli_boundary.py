"""The command-line tools' boundary: a user's mistake becomes one line and exit status 2.

Inputs are checked where they are read (config fields, flags, paths, checkpoints), and a bad one
raises ValueError, or FileNotFoundError (or another OSError about a path) with a message naming
it. Each CLI's `main(argv) -> int` is wrapped in `reports_bad_input`, which turns exactly those
exceptions into `error: <message>` on stderr and returns `EXIT_BAD_INPUT`; any other exception is
a bug and keeps its traceback. `ArgumentParser` reports argparse's own errors (unknown flag, bad
choice, missing argument) the same way instead of printing its usage. `LALTE_TRACEBACK=1` prints
the traceback of a reported error too, to see where it was raised. Each tool's --help ends with
its exit codes and an example (`ArgumentParser(example=...)`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence

EXIT_BAD_INPUT = 2
ENV_TRACEBACK = "LALTE_TRACEBACK"
# OSError subclasses that always name a path the user gave (missing, a file where a directory is
# expected, ...); other OSErrors (disk full, I/O errors) are not input mistakes. ImportError: an
# optional package that the chosen input needs (tokenizers, sentencepiece, datasets), named with
# its install command where it is imported.
BAD_INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                    IsADirectoryError, PermissionError, ImportError)


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors raise ValueError (one line through `reports_bad_input`), not a usage
  dump and exit; its subcommand parsers are of this class too.

  With `example`, --help ends with `notes` (paragraphs), the exit codes (`exit_codes`: status ->
  meaning; 2 is added) and the example command.
  """

  def __init__(self, *args, example: str | None = None, exit_codes: dict[int, str] | None = None,
               notes: Sequence[str] = (), **kwargs):
    if example is not None:
      codes = {0: "done", **(exit_codes or {}),
               EXIT_BAD_INPUT: f"bad input (one line on stderr; {ENV_TRACEBACK}=1 adds the"
                               " traceback)"}
      listing = "; ".join(f"{code} {text}" for code, text in sorted(codes.items()))
      kwargs["epilog"] = help_epilog(*notes, f"exit codes: {listing}", f"example: {example}")
      kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message: str):
    raise ValueError(f"{message} (see {self.prog} --help)")


def help_epilog(*paragraphs: str, width: int = 79) -> str:
  """Paragraphs for the end of --help, each wrapped on its own with a hanging indent."""
  return "\n".join(textwrap.fill(text, width, subsequent_indent="  ", break_on_hyphens=False)
                   for text in paragraphs)


def one_line(error: BaseException) -> str:
  """The error's message on one line (an empty message gives the exception's type)."""
  return " ".join(str(error).split()) or type(error).__name__


def reports_bad_input(main: Callable[[Sequence[str] | None], int | None]
                      ) -> Callable[[Sequence[str] | None], int]:
  """Decorates a CLI's `main(argv)`: bad input -> `error: ...` on stderr and exit status 2."""

  @functools.wraps(main)
  def boundary(argv: Sequence[str] | None = None) -> int:
    try:
      return main(argv) or 0
    except BAD_INPUT_ERRORS as error:
      if os.environ.get(ENV_TRACEBACK, "").strip() not in ("", "0"):
        traceback.print_exc()
      print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
      return EXIT_BAD_INPUT
  return boundary
