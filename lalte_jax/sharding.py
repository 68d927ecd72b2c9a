"""Mesh axis names, and kernels run per shard.

The trainer's mesh has the axes ("data", "fsdp", "tensor") (`lalte_jax/train/sharding.py` holds the
parameter rules). Batches are split over data x fsdp; "tensor" may split attention and GDN heads.

Why `per_shard`: XLA's SPMD partitioner cannot split a Pallas (Triton) custom call. Given
batch-sharded operands it gathers them and runs the whole batch on every device (or refuses), so
an FSDP run would do N times the attention and delta-rule work. Under a mesh context
(`jax.set_mesh(mesh)`, which the trainer enters around its jitted functions), `per_shard` runs the
kernel inside `jax.shard_map`, each device on its own rows and, where the "tensor" axis divides
every operand's head axis, on its own heads. Without a mesh, or when the batch does not divide
over the batch axes, it calls the kernel directly (one device, or XLA's own partitioning).

`per_batch_shard` is the same for kernels that take whole (replicated) operands such as weights
and whose results depend on the global row (the LTE router: k and v with its weights, its dropout
hashing global rows).

The operands of every kernel the mixers call through `per_shard` share one layout: batch at axis
0 and heads at axis 2 (q/k/v [B, T, H, D], gates [B, T, H], LTE kept flags [B, T, Hkv], NSA gates
[B, T, H, 3]); GQA stays consistent because query heads and KV heads are split into the same
number of contiguous blocks, so query head j and its KV head j // G land on the same device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
TENSOR_AXIS = "tensor"
HEAD_AXIS = 2  # of every kernel operand and output (module docstring)


def _axis_size(mesh, names) -> int:
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def per_shard(kernel: Callable[..., jax.Array], *operands: jax.Array) -> jax.Array:
  """`kernel(*operands)`, run per shard of the current mesh (module docstring).

  `kernel` maps arrays laid out [B, T, H, ...] to one array of that layout, computing each batch
  row (and head) independently of the others.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return kernel(*operands)
  batch_size = operands[0].shape[0]
  batch_shards = _axis_size(mesh, BATCH_AXES)
  tensor_shards = mesh.shape[TENSOR_AXIS]
  if batch_shards * tensor_shards == 1 or batch_size % batch_shards:
    return kernel(*operands)
  split_heads = tensor_shards > 1 and all(
      x.ndim > HEAD_AXIS and x.shape[HEAD_AXIS] % tensor_shards == 0 for x in operands)
  head_spec = TENSOR_AXIS if split_heads else None

  def spec(ndim: int) -> P:
    return P(BATCH_AXES, *([None, head_spec] + [None] * (ndim - 3))[:ndim - 1])

  out_ndim = jax.eval_shape(kernel, *operands).ndim
  # check_vma=False: Pallas calls and custom_vjp rules carry no varying-axes annotations.
  return jax.shard_map(kernel, mesh=mesh, in_specs=tuple(spec(x.ndim) for x in operands),
                       out_specs=spec(out_ndim), check_vma=False)(*operands)


def per_batch_shard(kernel: Callable[..., jax.Array], batched: tuple[jax.Array, ...],
                    whole: tuple[jax.Array, ...], *, batch_axis: int) -> jax.Array:
  """`kernel(*batched, *whole, row_offset=...)` per batch shard of the current mesh: the `batched`
  operands and the output split along `batch_axis` over the batch axes, the `whole` operands
  (arrays or pytrees of them, None included) on every device, and `row_offset` the global index
  of the shard's first row (int32; 0 unsharded), for kernels whose results depend on it (the LTE
  router's dropout masks hash the global row).
  The "tensor" axis splits nothing here (each of its devices computes the same rows). Without a
  mesh, or when the batch does not divide over the batch axes, the kernel is called directly."""
  mesh = jax.sharding.get_abstract_mesh()
  direct = lambda: kernel(*batched, *whole, row_offset=jnp.int32(0))
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return direct()
  batch_shards = _axis_size(mesh, BATCH_AXES)
  if batch_shards == 1 or batched[0].shape[batch_axis] % batch_shards:
    return direct()
  local_rows = batched[0].shape[batch_axis] // batch_shards

  def per_shard_kernel(*operands):
    row_offset = jax.lax.axis_index(BATCH_AXES).astype(jnp.int32) * local_rows
    return kernel(*operands, row_offset=row_offset)

  spec = lambda ndim: P(*[BATCH_AXES if axis == batch_axis else None for axis in range(ndim)])
  out_ndim = jax.eval_shape(direct).ndim
  return jax.shard_map(per_shard_kernel, mesh=mesh,
                       in_specs=tuple(spec(x.ndim) for x in batched) + (P(),) * len(whole),
                       out_specs=spec(out_ndim), check_vma=False)(*batched, *whole)
