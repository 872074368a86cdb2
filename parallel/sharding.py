"""Sharding helpers: NamedShardings from logical names, and global batches from per-process data."""
from __future__ import annotations

import pickle
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def logical_sharding(mesh: jax.sharding.Mesh, rules, names: Sequence[str | None]) -> NamedSharding:
  """NamedSharding on `mesh` for an array whose dimensions have logical `names` under `rules`."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(names), tuple(rules)))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def to_host(tree: Any) -> Any:
  """`tree` with every jax.Array as a numpy array of its whole (global) value, on every process: an array that
  spans other processes' devices is gathered first (a collective over its devices, so every process holding part
  of it must call this in the same order); other leaves pass through."""
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if not x.is_fully_addressable and x.is_fully_replicated:  # every process has it all: no collective
      return np.asarray(x.addressable_data(0))
    if not x.is_fully_addressable:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(one, tree)


def allgather_objects(obj: Any, mesh: jax.sharding.Mesh) -> list[Any]:
  """Every process's `obj` (picklable), in process order, on every process: its pickled bytes all-gathered over
  `mesh`'s devices (a collective: every process holding part of the mesh calls this at the same point)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  sizes = _allgather_rows(np.array([data.size], np.int64), mesh)[:, 0]
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = _allgather_rows(padded, mesh)
  return [pickle.loads(rows[p, :sizes[p]].tobytes()) for p in range(jax.process_count())]


def _allgather_rows(x: np.ndarray, mesh: jax.sharding.Mesh) -> np.ndarray:
  """[processes, *x.shape]: each process's `x` (all the same shape), gathered over `mesh`'s devices."""
  sharding = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))
  shape = (mesh.size,) + x.shape
  blocks = jax.make_array_from_callback(
      shape, sharding, lambda index: np.broadcast_to(x, (len(range(*index[0].indices(mesh.size))),) + x.shape))
  gathered = to_host(blocks)
  row_of = {}  # process -> a row one of its devices held
  for device, index in sharding.devices_indices_map(shape).items():
    row_of.setdefault(device.process_index, index[0].indices(mesh.size)[0])
  return np.stack([gathered[row_of[p]] for p in range(jax.process_count())])


def to_local(tree: Any, sharding: NamedSharding) -> Any:
  """`tree`'s jax.Arrays laid out by `sharding`, whose devices are all this process's: also from arrays spanning
  other processes (multi-controller JAX's device_put cannot change the device set there), read from a local device
  where this process holds the whole value (replicated), else gathered (`to_host`, a collective over the source's
  devices)."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = x.addressable_data(0) if x.is_fully_replicated else to_host(x)
    return jax.device_put(x, sharding)
  return jax.tree.map(one, tree)


def global_batch(local_batch: Mapping[str, Any], sharding: NamedSharding | Mapping[str, NamedSharding],
                 global_rows: int | None = None) -> dict[str, jax.Array]:
  """Assembles global jax.Arrays from this process's rows of each batch array.

  Args:
    local_batch: name -> numpy array [rows_per_process, ...]: the rows this process's devices hold under
      `sharding`. For meshes from `parallel.mesh.make_mesh` that is the p-th consecutive block of rows for
      process p (data/fsdp are the outer axes), which is what `data.pipeline` yields per process.
    sharding: the batch sharding (rows over data+fsdp), one for all arrays or one per name.
    global_rows: rows of the global batch; default rows_per_process * jax.process_count().
  Returns:
    name -> global jax.Array [global_rows, ...] laid out by `sharding`. With one process this is a sharded
    device_put of the same values.
  """
  out = {}
  for name, x in local_batch.items():
    x = np.asarray(x)
    s = sharding[name] if isinstance(sharding, Mapping) else sharding
    rows = global_rows if global_rows is not None else x.shape[0] * jax.process_count()
    out[name] = jax.make_array_from_process_local_data(s, x, (rows,) + x.shape[1:])
  return out


def check_rows_per_process(mesh, row_axes: Sequence[str]) -> None:
  """Raises ValueError unless every batch row lives on one process only (each process feeds its own rows).

  Batch rows are split over `row_axes` (data and fsdp under the default rules); every other mesh axis must stay
  inside a process, or two processes would hold the same rows and feed different data for them (JAX fails
  with "Invalid host data"). `mesh` needs `.devices` (an array of devices with `process_index`) and
  `.axis_names`. The message names the axes that span processes.
  """
  names = tuple(mesh.axis_names)
  process_ids = np.vectorize(lambda d: d.process_index, otypes=[int])(np.asarray(mesh.devices))
  if len(np.unique(process_ids)) < 2:
    return
  spanning = [a for i, a in enumerate(names)
              if a not in row_axes and np.any(process_ids != np.take(process_ids, [0], axis=i))]
  if spanning:
    sizes = " x ".join(f"{a}={process_ids.shape[names.index(a)]}" for a in spanning)
    raise ValueError(
        f"mesh axis {sizes} spans processes: processes would share batch rows (rows are split over "
        f"{' x '.join(row_axes)} only) and JAX rejects the data. Keep {', '.join(spanning)} inside one process "
        f"(its size must divide the {process_ids.size // len(np.unique(process_ids))} devices per process) and "
        "span processes with mesh.dcn_data / mesh.dcn_fsdp")
