"""Evaluation records -> JSON and markdown tables.

A record is one (task, length) measurement: {"task", "length" (None for tasks without a target
length), "metric", "value", ...details}. Tables pivot records: one row per value of `row_key`
(e.g. the task, or the model in a comparison), one column per (task, length).
"""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil
import time
from collections.abc import Sequence


def format_value(value) -> str:
  if value is None:
    return "–"
  if isinstance(value, float):
    # "#": trailing zeros stay, so 2.0 prints as 2.00 (an accuracy or loss, not an integer count).
    return f"{value:.1f}" if abs(value) >= 10 or value == 0 else f"{value:#.3g}"
  return str(value)


def column_label(record: dict) -> str:
  length = record.get("length")
  return record["task"] if length is None else f"{record['task']} @{length}"


def task_table(records: Sequence[dict]) -> str:
  """One row per task, one column per length (length-free tasks in a "–" column)."""
  lengths = sorted({r["length"] for r in records if r.get("length") is not None})
  has_free = any(r.get("length") is None for r in records)
  headers = ["task", "metric"] + [str(n) for n in lengths] + (["–"] if has_free else [])
  rows: dict[tuple[str, str], dict] = {}
  for record in records:
    rows.setdefault((record["task"], record["metric"]), {})[record.get("length")] = record["value"]
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  for (task, metric), by_length in rows.items():
    cells = [format_value(by_length.get(n)) for n in lengths]
    if has_free:
      cells.append(format_value(by_length.get(None)))
    lines.append("| " + " | ".join([task, metric] + cells) + " |")
  return "\n".join(lines)


def comparison_table(records: Sequence[dict], row_key: str = "model",
                     extra_columns: Sequence[str] = ()) -> str:
  """One row per `record[row_key]` (first-seen order), one column per (task, length)."""
  columns: list[str] = []
  rows: dict[str, dict] = {}
  for record in records:
    label = column_label(record)
    if label not in columns:
      columns.append(label)
    row = rows.setdefault(record[row_key], {})
    row[label] = record["value"]
    for name in extra_columns:
      row.setdefault(name, record.get(name))
  headers = [row_key] + list(extra_columns) + columns
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  for name, row in rows.items():
    cells = [format_value(row.get(c)) for c in list(extra_columns) + columns]
    lines.append("| " + " | ".join([str(name)] + cells) + " |")
  return "\n".join(lines)


def check_output_dir(output_dir: str | pathlib.Path) -> pathlib.Path:
  """`output_dir` as a Path; ValueError if it exists and is not a directory."""
  output_dir = pathlib.Path(output_dir)
  if output_dir.exists() and not output_dir.is_dir():
    raise ValueError(f"output_dir: {output_dir} exists and is not a directory")
  return output_dir


def write_report(output_dir: str | pathlib.Path, payload: dict, markdown: str,
                 stem: str = "results") -> tuple[pathlib.Path, pathlib.Path]:
  """Writes this run's `<stem>-<UTC time>.json` (payload) and `.md` (markdown) under `output_dir`,
  never replacing an earlier run's files (a `-2`, `-3`... suffix if the second is taken), and
  copies them to `<stem>.json` / `<stem>.md`, which always hold the newest run. Returns the run's
  two paths."""
  output_dir = check_output_dir(output_dir)
  output_dir.mkdir(parents=True, exist_ok=True)
  run_stem = f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
  text = json.dumps(payload, indent=2, default=str) + "\n"
  for attempt in itertools.count(1):
    name = run_stem if attempt == 1 else f"{run_stem}-{attempt}"
    json_path, markdown_path = output_dir / f"{name}.json", output_dir / f"{name}.md"
    try:
      with json_path.open("x", encoding="utf-8") as file:  # claims the name, even against a
        file.write(text)                                     # concurrent run
      break
    except FileExistsError:
      continue
  markdown_path.write_text(markdown.rstrip() + "\n", encoding="utf-8")
  for path in (json_path, markdown_path):
    shutil.copyfile(path, output_dir / f"{stem}{path.suffix}")
  return json_path, markdown_path
