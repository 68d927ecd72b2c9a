"""Device mesh and sharding rules: the one place that decides layouts.

Mesh: every device of every process (multi-process start-up: lalte_jax/train/distributed.py), axes
("data", "fsdp", "tensor"). Batches are split over data x fsdp; parameters and optimizer moments
are sharded over fsdp (each device holds a slice and XLA gathers them for the matmuls: ZeRO-3 /
FSDP) and optionally over "tensor".

Parameter rules (`param_partition_spec`), from the parameter's path and shape only:
- the leading [num_groups] axis of the scanned stack ("groups/...") is never sharded: the scan
  slices it every iteration;
- "tensor" (Megatron-style, optional): column-parallel for projections into a wider space
  (q/k/v/g/a/b, gate/up, the LM head's vocabulary, the embedding's vocabulary), row-parallel for
  the projections back to the residual stream (o_proj, down_proj) — only where the size divides;
- "fsdp": the largest remaining dimension divisible by the fsdp axis size; leaves with none stay
  replicated (norm weights of odd sizes, scalars).
Optimizer-state leaves carry their parameter's path as a suffix, so the same rules apply to them.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lalte_jax.sharding import BATCH_AXES, MESH_AXES
from lalte_jax.train import distributed

# (path regex, dimension sharded over "tensor"); first match wins.
TENSOR_RULES = (
    (r"(^|/)embed/embedding$", 0),
    (r"(^|/)lm_head$", -1),
    (r"(o_proj|down_proj)/kernel$", -2),
    (r"(q_proj|k_proj|v_proj|g_proj|a_proj|b_proj|gate_proj|up_proj)/kernel$", -1),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """Mesh over `devices` (default: all devices of all processes); `data=-1` takes the rest."""
  devices = jax.devices() if devices is None else list(devices)
  if data == -1:
    if len(devices) % (fsdp * tensor):
      raise ValueError(f"mesh: fsdp*tensor = {fsdp * tensor} does not divide the"
                       f" {len(devices)} devices")
    data = len(devices) // (fsdp * tensor)
  if data * fsdp * tensor != len(devices):
    raise ValueError(f"mesh: data*fsdp*tensor = {data}*{fsdp}*{tensor} != {len(devices)} devices")
  # Auto axes: the model code carries no sharding annotations; XLA propagates from the inputs.
  return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                       devices=devices)


def path_string(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def param_partition_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec of the parameter (or optimizer moment) at `path` with `shape` (module doc)."""
  spec: list = [None] * len(shape)
  first_free = 1 if re.search(r"(^|/)groups/", path) and len(shape) > 1 else 0
  tensor_size, fsdp_size = mesh.shape["tensor"], mesh.shape["fsdp"]
  if tensor_size > 1:
    for pattern, dim in TENSOR_RULES:
      if re.search(pattern, path):
        dim = dim % len(shape) if shape else None
        if dim is not None and dim >= first_free and shape[dim] % tensor_size == 0:
          spec[dim] = "tensor"
        break
  if fsdp_size > 1:
    free = [d for d in range(first_free, len(shape))
            if spec[d] is None and shape[d] % fsdp_size == 0]
    if free:
      spec[max(free, key=lambda d: (shape[d], -d))] = "fsdp"
  return P(*spec)


def param_shardings(tree, mesh: Mesh):
  """NamedShardings for a tree of parameters or optimizer state (arrays or ShapeDtypeStructs)."""
  def one(path, leaf):
    return NamedSharding(mesh, param_partition_spec(path_string(path), tuple(leaf.shape), mesh))
  return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def train_state_shardings(state_shapes, mesh: Mesh):
  """Shardings for a TrainState: params and optimizer state by the rules, the rest replicated."""
  rep = replicated(mesh)
  return state_shapes.replace(
      step=rep, rng=rep, skipped_total=rep, skipped_consecutive=rep,
      controller=jax.tree.map(lambda _: rep, state_shapes.controller),
      params=param_shardings(state_shapes.params, mesh),
      opt_state=param_shardings(state_shapes.opt_state, mesh))


class MeshJit:
  """A `jax.jit` function traced, compiled and run under `jax.set_mesh(mesh)`, so that the
  model's kernels run per shard (`lalte_jax.sharding.per_shard`) instead of being gathered.

  With several processes the first call compiles, then waits until every process has compiled
  (`distributed.wait_for_all_processes`), then sums one number per device over the whole mesh
  before running: the first collective over a set of devices must find the other processes
  within gloo's fixed 30 s (see lalte_jax/train/distributed.py), and the function's own first
  collective may come only after a long stretch of compute (the gradient all-reduce after the
  backward pass), by which time the processes can have drifted apart."""

  def __init__(self, fn, mesh: Mesh, **jit_kwargs):
    self.jitted = jax.jit(fn, **jit_kwargs)
    self.mesh = mesh
    self.name = getattr(fn, "__name__", "function")
    self._compiled_everywhere = False

  def __call__(self, *args):
    with jax.set_mesh(self.mesh):
      if not self._compiled_everywhere and jax.process_count() > 1:
        self.jitted.lower(*args).compile()  # the call below reuses this executable
        meet = _whole_mesh_sum(self.mesh)
        distributed.wait_for_all_processes(f"compiled {self.name}")
        jax.block_until_ready(meet())
      self._compiled_everywhere = True
      return self.jitted(*args)

  def lower(self, *args):
    with jax.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def _whole_mesh_sum(mesh: Mesh):
  """A compiled function that sums one number per device of `mesh` across all of them: run
  right after a barrier, it sets up the collectives of the whole device set while every process
  is there."""
  one_per_device = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  ones = jax.jit(lambda: jnp.ones(mesh.devices.size, jnp.float32),
                 out_shardings=one_per_device)
  total = jax.jit(jnp.sum, out_shardings=replicated(mesh))
  ones_compiled = ones.lower().compile()
  total_compiled = total.lower(jax.ShapeDtypeStruct((mesh.devices.size,), jnp.float32,
                                                    sharding=one_per_device)).compile()
  return lambda: total_compiled(ones_compiled())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[B, T] arrays: rows split over data x fsdp."""
  return NamedSharding(mesh, P(BATCH_AXES))


def micro_batch_sharding(mesh: Mesh) -> NamedSharding:
  """[A, B/A, T] micro-batch stacks: rows of each micro-batch split over data x fsdp."""
  return NamedSharding(mesh, P(None, BATCH_AXES))


def batch_devices(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over data x fsdp (works for 1 or N processes)."""
  sharding = batch_sharding(mesh)
  return {name: jax.make_array_from_process_local_data(sharding, np.asarray(value))
          for name, value in local_batch.items()}


def to_host(tree):
  """Numpy copies of replicated (or single-process) arrays. In a multi-process run a replicated
  array is not fully addressable, so `np.asarray` on it fails; any local shard holds it all."""
  def one(leaf):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      return np.asarray(leaf.addressable_data(0))
    return np.asarray(leaf)
  return jax.tree.map(one, tree)
