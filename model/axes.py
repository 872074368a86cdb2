"""Logical axis names: the bridge between model code and the device mesh.

Model code only names axes. Parameters carry their names as `out_sharding` metadata (`nnx.with_partitioning`,
through `param_init` below); activations pass through `constrain(x, names)`. Which mesh axis a logical name maps to
is decided by a rules table that `parallel/` supplies, in flax's format: a sequence of `(logical_name, mesh_axes)`
pairs where `mesh_axes` is a mesh axis name, a tuple of names, or None (replicated); earlier pairs take precedence
and a mesh axis is used at most once per array (flax `logical_to_mesh_axes` semantics).

How rules are supplied: `with model.axes.axis_rules(rules):` (the same thread-local context as
`flax.linen.logical_axis_rules`, which nnx also reads when it shards parameters at creation), together with
`with jax.set_mesh(mesh):`. `parallel.activate(mesh, rules)` enters both. Rules should name every logical name
in `LOGICAL_NAMES` (map unused ones to None): nnx keeps an unmapped parameter name as a literal mesh axis name.

Without rules or without a mesh, `constrain` is the identity and parameters are created unsharded.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
from flax import nnx
from flax.core import spmd as _core_spmd

BATCH = "batch"
LENGTH = "length"
KV_LENGTH = "kv_length"  # key/value length inside attention (default rules: not sharded, so K/V are gathered)
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"  # the stacked scan-over-layers dimension
EXPERTS = "experts"  # the expert dimension of MoE weights (expert parallelism)
LOGICAL_NAMES = (BATCH, LENGTH, KV_LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, LAYERS, EXPERTS)

Rules = Sequence[tuple[str, Any]]


def axis_rules(rules: Rules) -> contextlib.AbstractContextManager:
  """Context manager making `rules` (logical name -> mesh axes) current for `constrain` and parameter creation."""
  return nn.logical_axis_rules(tuple(rules))


def current_rules() -> tuple:
  """The active rules table (empty tuple when none is set)."""
  return tuple(_core_spmd.get_logical_axis_rules())


def _current_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def platform() -> str:
  """The platform ("cpu", "tpu", "gpu") the traced program is for: the current mesh's devices' (an ahead-of-time
  compile for a TPU topology on a CPU host traces under that topology's mesh), else JAX's default backend."""
  mesh = _current_mesh()
  device = getattr(mesh, "abstract_device", None) if mesh is not None else None
  return device.platform if device is not None else jax.default_backend()


def active() -> bool:
  """True when both a mesh (`jax.set_mesh`) and logical rules are current."""
  return bool(current_rules()) and _current_mesh() is not None


def spec(names: Sequence[str | None], rules: Rules | None = None) -> jax.sharding.PartitionSpec:
  """The mesh PartitionSpec for an array whose dimensions have these logical names."""
  return nn.logical_to_mesh_axes(tuple(names), tuple(current_rules() if rules is None else rules))


def mesh_size(name: str) -> int:
  """Devices that a dimension with logical `name` is split over under the active mesh and rules (1 without)."""
  if not active():
    return 1
  mesh_axes = spec((name,))[0]
  names = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
  shape = _current_mesh().shape
  size = 1
  for a in names:
    size *= shape[a]
  return size


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on activation `x` whose dims are named `names`; identity without mesh + rules."""
  if len(names) != x.ndim:
    raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of shape {x.shape}")
  if not active():
    return x
  mesh = _current_mesh()
  sharding = jax.sharding.NamedSharding(mesh, spec(names))
  if mesh.are_all_axes_explicit:
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def param_init(init: Callable, names: Sequence[str | None]) -> Callable:
  """Wraps an initializer so the created `nnx.Param` carries logical axis `names` (one per dimension)."""
  return nnx.with_partitioning(init, tuple(names))


def creation_context() -> contextlib.AbstractContextManager:
  """Context for creating parameters: sharded at creation only when a mesh and rules are active.

  nnx shards annotated parameters eagerly and fails without a mesh; this makes unsharded (single-device) model
  creation work while keeping eager sharding under `parallel.activate`.
  """
  return nnx.use_eager_sharding(active())
