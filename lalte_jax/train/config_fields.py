"""What a training config may set, for `python -m lalte_jax.train --list-fields`.

Every TrainConfig field with its type, default and the comment that describes it in
lalte_jax/train/config.py (read from the source, so the listing cannot drift from it), then the
ModelConfig fields that `--set model.<field>=<value>` changes (lalte_jax/config.py; their values
come from the preset).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing

from lalte_jax.config import ModelConfig
from lalte_jax.train import model_overrides
from lalte_jax.train.config import MODEL_OVERRIDE_PREFIX, TrainConfig


@dataclasses.dataclass(frozen=True)
class FieldDoc:
  name: str
  type_name: str
  default: object  # dataclasses.MISSING when the field has none
  comment: str  # the comment at the end of the field's line, or ""
  group: str  # the comment block right above the field, or "" (it heads a group of fields)


def _type_name(annotation) -> str:
  return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace(
      "typing.", "").replace("lalte_jax.config.", "")


def field_docs(cls) -> list[FieldDoc]:
  """The fields of dataclass `cls` in order, with the comments of its source."""
  source = textwrap.dedent(inspect.getsource(cls))
  comments, whole_line = {}, set()  # line -> comment text; lines holding only a comment
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      comments[token.start[0]] = token.string.lstrip("#").strip()
      if token.line.strip() == token.string.strip():
        whole_line.add(token.start[0])
  lines = {node.target.id: (node.lineno, node.end_lineno)
           for node in ast.parse(source).body[0].body
           if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
  hints = typing.get_type_hints(cls)
  docs = []
  for field in dataclasses.fields(cls):
    first, last = lines[field.name]
    group = []
    line = first - 1
    while line in whole_line:  # the comment block right above the field
      group.insert(0, comments[line])
      line -= 1
    default = field.default
    if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
      default = field.default_factory()
    trailing = "" if last in whole_line else comments.get(last, "")
    docs.append(FieldDoc(field.name, _type_name(hints[field.name]), default, trailing,
                         " ".join(group)))
  return docs


def _model_field_docs(cls=ModelConfig, prefix: str = "") -> list[FieldDoc]:
  """ModelConfig's settable fields by dotted name (sub-configs expanded, TrainConfig-managed
  ones left out)."""
  docs = []
  for doc in field_docs(cls):
    if not prefix and doc.name in model_overrides.MANAGED_FIELDS:
      continue
    nested = [a for a in typing.get_args(typing.get_type_hints(cls)[doc.name])
              if dataclasses.is_dataclass(a)]
    if nested:
      docs += _model_field_docs(nested[0], f"{prefix}{doc.name}.")
    else:
      docs.append(dataclasses.replace(doc, name=prefix + doc.name, default=dataclasses.MISSING))
  return docs


def _field_line(doc: FieldDoc) -> str:
  text = f"  {doc.name}: {doc.type_name}"
  if doc.default is not dataclasses.MISSING:
    text += f" = {doc.default!r}"
  return text + (f"  # {doc.comment}" if doc.comment else "")


def describe_fields(width: int = 100) -> str:
  """The text that `--list-fields` prints."""
  out = ["TrainConfig fields (lalte_jax/train/config.py); set one with --set NAME=VALUE,",
         "or in a config file's get_config():"]
  for doc in field_docs(TrainConfig):
    if doc.group:
      out += [""] + textwrap.wrap(doc.group, width, initial_indent="# ", subsequent_indent="# ")
    out.append(_field_line(doc))
  out += ["", *textwrap.wrap(
      f"Model fields: --set {MODEL_OVERRIDE_PREFIX}NAME=VALUE changes a field of the preset"
      " (variant-size) by dotted name, the value read as a Python literal (--set"
      " model.hidden_size=128 --set model.lte.window=32 --set"
      " model.layer_pattern=\"('gdn','lte')\"); model_overrides={\"lte.window\": 32} in a config"
      " file does the same. Defaults are the preset's (lalte_jax/presets.py); a sub-config the"
      " preset lacks (e.g. nsa of lalte) cannot be changed. dtype, remat and scan_layers come"
      " from model_dtype, remat and scan_layers above.", width)]
  out += [_field_line(doc) for doc in _model_field_docs()]
  return "\n".join(out)
