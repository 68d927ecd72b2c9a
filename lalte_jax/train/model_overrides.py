"""Changes to a preset's ModelConfig by dotted field name, for custom models in train configs.

`TrainConfig.model_overrides` holds them: `{"hidden_size": 128, "gdn.head_dim": 64,
"lte.window": 32}` in a config file or `--set model.lte.window=32` on the command line.
`normalise` checks every name and value type against the config dataclasses (lists become
tuples) and sorts them, so that the TrainConfig stays hashable; `apply` rebuilds each changed
(sub-)config once with all of its changes, and the configs' own checks then validate the result.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from lalte_jax.config import ModelConfig

# ModelConfig fields that TrainConfig sets itself.
MANAGED_FIELDS = {"dtype": "model_dtype", "remat": "remat", "scan_layers": "scan_layers"}


def _check_type(value, annotation, where: str):
  """`value` checked against a config field's annotation (ints pass as floats); returns it."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    for option in args:
      try:
        return _check_type(value, option, where)
      except ValueError:
        pass
    raise ValueError(f"{where}={value!r} is not a {annotation}")
  if origin is typing.Literal:
    ok = value in args
  elif origin is tuple:
    ok = isinstance(value, tuple)
    if ok and args and args[-1] is Ellipsis:
      value = tuple(_check_type(v, args[0], where) for v in value)
  elif annotation is type(None):
    ok = value is None
  elif annotation is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif annotation is int:
    ok = isinstance(value, int) and not isinstance(value, bool)
  elif annotation in (bool, str):
    ok = isinstance(value, annotation)
  else:  # a nested config as a whole: set its fields one by one instead
    ok = False
  if not ok:
    raise ValueError(f"{where}={value!r} is not a {annotation}")
  return value


def _override_target(name: str):
  """(config class, field annotation) of the dotted ModelConfig field `name`; ValueError if none."""
  owner, parts = ModelConfig, name.split(".")
  for depth, part in enumerate(parts):
    hints = typing.get_type_hints(owner)
    if part not in hints:
      raise ValueError(f"{name!r} is not a ModelConfig field"
                       f" ({'.'.join(parts[:depth]) or 'ModelConfig'} has {sorted(hints)})")
    if depth == len(parts) - 1:
      return owner, hints[part]
    nested = [a for a in typing.get_args(hints[part]) if dataclasses.is_dataclass(a)]
    if not nested:
      raise ValueError(f"{'.'.join(parts[:depth + 1])!r} has no sub-fields")
    owner = nested[0]
  raise AssertionError("unreachable")


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def normalise(overrides) -> tuple:
  """A dict or (name, value) pairs -> sorted, type-checked pairs (lists become tuples)."""
  if isinstance(overrides, dict):
    overrides = tuple(overrides.items())
  if not isinstance(overrides, (tuple, list)):
    raise ValueError(f"must be a dict of ModelConfig fields, got {overrides!r} (on the command"
                     " line use --set model.<field>=<value>)")
  checked = {}
  for pair in overrides:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
      raise ValueError(f"expected (name, value) pairs, got {pair!r}")
    name, value = pair
    if name in MANAGED_FIELDS:
      raise ValueError(f"{name!r} is set by TrainConfig.{MANAGED_FIELDS[name]}; set that instead")
    _, annotation = _override_target(name)
    checked[name] = _check_type(_tuples(value), annotation, name)
  return tuple(sorted(checked.items()))


def apply(config: ModelConfig, overrides: tuple) -> ModelConfig:
  """`config` with the dotted fields replaced; each config is rebuilt once with all of its
  changes, so that fields which must agree (gdn heads x head_dim = hidden) can change together."""
  def rebuild(owner, changes: dict[str, object], where: str):
    direct = {name: value for name, value in changes.items() if "." not in name}
    nested: dict[str, dict] = {}
    for name, value in changes.items():
      if "." in name:
        head, rest = name.split(".", 1)
        nested.setdefault(head, {})[rest] = value
    for head, sub_changes in nested.items():
      child = direct.get(head, getattr(owner, head))
      if child is None:
        raise ValueError(f"{config.name} has no {where}{head!r} config to change")
      direct[head] = rebuild(child, sub_changes, f"{where}{head}.")
    return dataclasses.replace(owner, **direct)
  return rebuild(config, dict(overrides), "")


MIXER_CONFIGS = ("gdn", "attention", "lte", "nsa")


def implementation_overrides(config: ModelConfig, implementation: str | None) -> dict:
  """Overrides that make every token mixer of `config` use kernel `implementation` ("xla",
  "pallas", ...; None = the dispatch's platform default), e.g. to benchmark or debug one path."""
  return {f"{name}.implementation": implementation for name in MIXER_CONFIGS
          if getattr(config, name, None) is not None}
