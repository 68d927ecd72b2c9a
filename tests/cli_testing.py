"""What every command-line tool must do with a user's mistake: exit 2 with one line on stderr."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def assert_bad_input(code: int, stderr: str, message: str) -> None:
  """`code` is 2 and `stderr` is one `error: ...` line that holds `message`, no traceback."""
  lines = stderr.splitlines()
  assert code == 2, (code, stderr[-3000:])
  assert "Traceback" not in stderr, stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
  assert message in lines[0], lines[0]


def check_bad_input(main: Callable[[list[str]], int], argv: Sequence[str], message: str, capsys,
                    **paths) -> None:
  """Runs a CLI's `main(argv)` in this process and checks it reports a bad input holding
  `message`; `{name}` in `argv` and `message` stands for `paths[name]`."""
  def fill(text: str) -> str:
    for name, path in paths.items():
      text = text.replace(f"{{{name}}}", str(path))
    return text
  assert_bad_input(main([fill(a) for a in argv]), capsys.readouterr().err, fill(message))
