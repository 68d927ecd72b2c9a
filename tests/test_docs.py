"""The documentation holds together: the product speaks of itself, every `§x.y` / `Gnn` the code
cites exists in docs/model_spec.md, and every relative link of the docs points at a real file."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "model_spec.md"
# Directories that are never part of the product, for checkouts without git metadata.
NOT_PRODUCT = {".git", ".venv", ".cache", ".pytest_cache", "build", "runs", "__pycache__", ".whl"}

# Words about how the work was organised rather than about the product. Each pattern is built
# from pieces so that this file does not match itself.
FORBIDDEN = [re.compile(pattern, re.IGNORECASE) for pattern in (
    "sess" + r"ions? ?[0-9]",
    "iss" + r"ues? ?[0-9]",
    "device" + " call",
    r"\.\." + "/shared",
    r"\$" + "OUT",
    "carry=" + r"\[" + r'"\.whl"',
    r"\blo" + r"ans?\b",
    "REFERENCE" + "_SPEC",
)] + [re.compile(r"\bDESIGN" + r"\.md")]  # case-sensitive: docs/design.md is fine

SECTION = re.compile(r"(paper\s+)?§(\d+(?:\.\d+)*)", re.IGNORECASE)
GOTCHA = re.compile(r"\bG([0-9]{1,2})\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def tracked_files() -> list[pathlib.Path]:
  """The repository's tracked files (all files outside NOT_PRODUCT when git is unavailable)."""
  try:
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode()
    paths = [ROOT / name for name in listing.split("\0") if name]
  except (OSError, subprocess.CalledProcessError):
    paths = [path for path in ROOT.rglob("*")
             if not NOT_PRODUCT & set(path.relative_to(ROOT).parts[:-1])
             and not path.name.endswith(".egg-info")]
  return sorted(path for path in paths if path.is_file())


def read_text(path: pathlib.Path) -> str | None:
  """The file's text, or None for a binary file."""
  data = path.read_bytes()
  if b"\0" in data:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


@functools.cache
def all_text_files() -> dict[pathlib.Path, str]:
  """Every tracked text file (binary files left out) and its text, read once per test session."""
  texts = {path: read_text(path) for path in tracked_files()}
  return {path: text for path, text in texts.items() if text is not None}


def text_files(*suffixes: str) -> dict[pathlib.Path, str]:
  return {path: text for path, text in all_text_files().items()
          if not suffixes or path.suffix in suffixes}


def line_of(text: str, index: int) -> int:
  return text.count("\n", 0, index) + 1


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
  """Anchors a link can target in a markdown file: heading slugs and explicit `<a id=...>`."""
  headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", markdown, re.MULTILINE)
  return {slug(h) for h in headings} | set(re.findall(r"<a id=\"([^\"]+)\"", markdown))


def spec_targets() -> tuple[set[str], set[str]]:
  """(section numbers with a heading, gotcha numbers with an anchor) of docs/model_spec.md."""
  text = SPEC.read_text()
  sections = set(re.findall(r"^#{1,6}\s+(\d+(?:\.\d+)*)\s", text, re.MULTILINE))
  gotchas = set(re.findall(r"<a id=\"G(\d+)\"></a>", text))
  return sections, gotchas


def test_no_words_about_how_the_work_was_organised():
  hits = []
  for path, text in text_files().items():
    for pattern in FORBIDDEN:
      for match in pattern.finditer(text):
        hits.append(f"{path.relative_to(ROOT)}:{line_of(text, match.start())}:"
                    f" {match.group(0)!r}")
  assert not hits, "\n".join(hits)


def test_model_spec_numbers_are_unique_and_gotchas_complete():
  text = SPEC.read_text()
  numbers = re.findall(r"^#{1,6}\s+(\d+(?:\.\d+)*)\s", text, re.MULTILINE)
  assert len(numbers) == len(set(numbers)), sorted(n for n in numbers if numbers.count(n) > 1)
  _, gotchas = spec_targets()
  assert gotchas == {str(n) for n in range(1, 28)}


def test_every_cited_section_and_gotcha_exists():
  sections, gotchas = spec_targets()
  missing = []
  for path, text in text_files(".py", ".sh", ".md").items():
    name = path.relative_to(ROOT)
    missing += [f"{name}:{line_of(text, m.start())}: §{m.group(2)}"
                for m in SECTION.finditer(text) if not m.group(1) and m.group(2) not in sections]
    missing += [f"{name}:{line_of(text, m.start())}: G{m.group(1)}"
                for m in GOTCHA.finditer(text) if m.group(1) not in gotchas]
  assert not missing, "\n".join(missing)


@pytest.mark.parametrize("document", ["README.md"] + sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md")))
def test_relative_links_resolve(document):
  path = ROOT / document
  broken = []
  for target in LINK.findall(path.read_text()):
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
      continue  # http:, https:, mailto: ...
    file_part, _, fragment = target.partition("#")
    linked = (path.parent / file_part).resolve() if file_part else path
    if not linked.is_relative_to(ROOT) or not linked.exists():
      broken.append(f"{target}: no such file in the repository")
    elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
      broken.append(f"{target}: no heading or anchor #{fragment}")
  assert not broken, "\n".join(broken)
