"""A layer group's part of a stacked cache leaf, for the decode step to read and write in place.

Every leaf of a decode cache is stacked over the model's G layer groups ([G, ...], `caches.py`)
and the decode step scans over the groups with the stacked cache in its carry (`stack.py`). A
mixer's `decode` gets its cache with a `GroupSlot` in place of each leaf: the stacked array and the
group index. Ops that read a cache take both (`pallas_kernels.stacked`: kernels index the group
themselves, the XLA versions read it block by block); other writes go through `write` /
`scatter`, which change only the given elements of the stacked buffer (XLA does that in place on
the donated, loop-carried cache), and `read` / `take` are for small leaves and parts. So no
decode step copies a group's cache slice out and back (which cost temporaries of 0.75x the cache
for NSA and full attention, and a read and a write of it per token).

XLA keeps an update in place only if every other read of the buffer is known to come first (it
copies the whole stacked buffer otherwise): a step writes a slot before reading it, or reads only
what the write depends on.

`group_view` turns a layer's stacked cache into this form and `stacked` back; `read_group` and
`write_group` move a whole group's cache, for the prefill, which fills it anyway.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class GroupSlot:
  """Group `group`'s part of the stacked leaf `stacked` [G, ...]."""
  stacked: jax.Array
  group: jax.Array  # [] int32

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of one group's part."""
    return self.stacked.shape[1:]

  @property
  def dtype(self):
    return self.stacked.dtype

  def _starts(self, start: tuple) -> tuple:
    zero = jnp.zeros((), jnp.int32)
    starts = (self.group, *(jnp.asarray(i, jnp.int32) for i in start))
    return starts + (zero,) * (self.stacked.ndim - len(starts))

  def read(self, start: tuple = (), shape: tuple = ()) -> jax.Array:
    """The group's part as an array, or the block of `shape` at index `start` (both over leading
    axes; the other axes whole). A copy: for small leaves and parts."""
    sizes = (1, *shape, *self.shape[len(shape):])
    return jax.lax.dynamic_slice(self.stacked, self._starts(start), sizes)[0]

  def take(self, index: tuple) -> jax.Array:
    """`x[index]` of the group's part (NumPy indexing): reads only the indexed elements."""
    return self.stacked[(self.group, *index)]

  def write(self, update: jax.Array, start: tuple = ()) -> GroupSlot:
    """`update` stored at index `start` of the group's part (leading axes; the others from 0),
    cast to the leaf's dtype; nothing else changes."""
    return self.replace(stacked=jax.lax.dynamic_update_slice(
        self.stacked, update.astype(self.dtype)[None], self._starts(start)))

  def scatter(self, index: tuple, values: jax.Array) -> GroupSlot:
    """`x[index] = values` on the group's part (NumPy indexing; out-of-range indices are
    dropped, so a caller can skip an element by pointing it past the end)."""
    return self.replace(stacked=self.stacked.at[(self.group, *index)].set(
        values.astype(self.dtype), mode="drop"))


def _is_slot(x) -> bool:
  return isinstance(x, GroupSlot)


def group_view(cache, group: jax.Array):
  """`cache` (a layer cache whose leaves are stacked over the groups) with each leaf replaced by
  its `GroupSlot` of group `group`."""
  return jax.tree.map(lambda x: GroupSlot(stacked=x, group=group), cache)


def stacked(view):
  """The layer cache of stacked leaves behind a `group_view`."""
  return jax.tree.map(lambda slot: slot.stacked, view, is_leaf=_is_slot)


def read_group(view):
  """The group's layer cache as plain arrays."""
  return jax.tree.map(lambda slot: slot.read(), view, is_leaf=_is_slot)


def write_group(view, cache):
  """`view` with the group's whole layer cache replaced by `cache` (plain arrays)."""
  return jax.tree.map(lambda slot, x: slot.write(x), view, cache, is_leaf=_is_slot)


def view_of_plain(cache):
  """A plain layer cache (one layer's arrays, no group axis) as the `group_view` of a stack of one
  group: how a mixer's `decode` runs on one layer outside the model's scan."""
  return group_view(jax.tree.map(lambda x: x[None], cache), jnp.zeros((), jnp.int32))


def plain_of_view(view):
  """The plain layer cache behind a `view_of_plain` view."""
  return jax.tree.map(lambda x: x[0], stacked(view))
