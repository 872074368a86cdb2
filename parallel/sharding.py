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
