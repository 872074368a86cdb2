"""Sharding helpers: NamedShardings from logical names, and global batches from per-process data."""
from __future__ import annotations

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
