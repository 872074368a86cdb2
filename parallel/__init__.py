"""Mesh, logical-axis rules, multi-host start-up and sharding helpers (see docs/parallel.md).

`activate(mesh, rules)` makes a mesh and a rules table current: models created and functions traced inside it
shard their parameters and activations by the rules (the model reads them through `model.axes`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import flax.linen as nn
import jax

from parallel import distributed, mesh, rules, sharding  # noqa: F401  (public submodules)


@contextlib.contextmanager
def activate(mesh_: jax.sharding.Mesh, rules_: rules.Rules, *, inside_jit: bool = False) -> Iterator[None]:
  """Context manager making `mesh` and the logical-axis `rules` current (flax's thread-local rules context).

  Outside jit it enters `jax.set_mesh(mesh)`, so eagerly created parameters land sharded on the devices.
  `jax.set_mesh` is refused inside a jitted function: there pass `inside_jit=True`, which enters the mesh's
  abstract form (enough for sharding constraints and for creating parameters under `jax.jit`).
  """
  mesh_ctx = jax.sharding.use_abstract_mesh(mesh_.abstract_mesh) if inside_jit else jax.set_mesh(mesh_)
  with mesh_ctx, nn.logical_axis_rules(tuple(rules_)):
    yield
