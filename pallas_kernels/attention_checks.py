"""Argument checks shared by the attention ops' public entries (masked, decode, NSA attention).

Each raises ValueError with one line that names the op and the argument. They run at trace time,
before any version is chosen, so every implementation sees checked inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax.numpy as jnp

__all__ = ["check_mask", "check_positive_int", "check_qkv"]


def check_qkv(op_name: str, q, k, v, *, names: Sequence[str], one_query: bool = False) -> None:
  """q [B, T, Hq, D] (one_query: [B, Hq, D], one query per row, for decoding), k [B, S, Hkv, D]
  and v [B, S, Hkv, Dv] with Hq a multiple of Hkv; with a T axis, the queries are the last T of
  the S positions, so T <= S. `names` are the three arguments' names as the caller spells them."""
  q_name, k_name, v_name = names
  if q.ndim != (3 if one_query else 4):
    layout = "3-D [B, Hq, D]" if one_query else "4-D [B, T, Hq, D]"
    raise ValueError(f"{op_name}: {q_name} must be {layout}, got shape {q.shape}")
  for name, array in ((k_name, k), (v_name, v)):
    if array.ndim != 4:
      raise ValueError(f"{op_name}: {name} must be 4-D [B, S, Hkv, D], got shape {array.shape}")
  batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
  _, key_len, num_kv_heads, key_dim = k.shape
  if k.shape[0] != batch:
    raise ValueError(f"{op_name}: {k_name} batch {k.shape[0]} != {q_name} batch {batch}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{op_name}: {v_name} shape {v.shape} must match {k_name} {k.shape} on"
                     " [B, S, Hkv]")
  if key_dim != head_dim:
    raise ValueError(f"{op_name}: {k_name} head dim {key_dim} != {q_name} head dim {head_dim}")
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(f"{op_name}: query heads ({num_q_heads}, {q_name}) must be a multiple of KV"
                     f" heads ({num_kv_heads}, {k_name})")
  if not one_query and q.shape[1] > key_len:
    raise ValueError(f"{op_name}: {q_name} has T={q.shape[1]} queries but {k_name} only"
                     f" S={key_len} keys; queries are the last T of the S positions, so T <= S")


def check_mask(op_name: str, name: str, array, shapes: dict[str, tuple[int, ...]], *,
               integer: bool = False) -> None:
  """A side input (mask or lengths) of one of `shapes` ({layout: shape}), bool or integer."""
  if array is None:
    return
  if tuple(array.shape) not in shapes.values():
    expected = " or ".join(f"{layout} = {shape}" for layout, shape in shapes.items())
    raise ValueError(f"{op_name}: {name} must have shape {expected}, got {array.shape}")
  if integer and not jnp.issubdtype(array.dtype, jnp.integer):
    raise ValueError(f"{op_name}: {name} must be integer, got {array.dtype}")
  if not integer and array.dtype != bool:
    raise ValueError(f"{op_name}: {name} must be bool, got {array.dtype}")


def check_positive_int(op_name: str, name: str, value, *, optional: bool = False) -> None:
  """value is a positive int (or None when optional)."""
  if optional and value is None:
    return
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
    none = " or None" if optional else ""
    raise ValueError(f"{op_name}: {name} must be a positive int{none}, got {value!r}")
