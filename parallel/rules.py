"""The one table mapping the model's logical axis names to mesh axes, and the checks that a model fits a mesh.

Default layout: batch over data+fsdp+expert (outside MoE layers the expert axis is more data parallelism); embed over fsdp for parameters (FSDP / ZeRO-3: gradients and
optimizer state follow the parameters, so ZeRO-1/2 savings come with it); heads, kv_heads, mlp, vocab over
tensor (Megatron); the expert dimension of MoE weights over expert; the scanned layer stack over stage when
mesh.stage > 1 (pipeline parallelism, parallel/pipeline.py); length over sequence for activations, with kv_length unsharded so that under sequence
parallelism attention gathers K/V while queries stay split. `config.mesh.rules` overrides entries.

The table is ordered and read with flax `logical_to_mesh_axes` semantics (`model.axes.spec`): when two dimensions
of one array map to the same mesh axis (an activation [batch, length, embed] would use fsdp twice), the earlier
rule wins and the later dimension stays unsharded. Every logical name has an entry (None = replicated), because
nnx keeps an unmapped parameter name as a literal mesh axis name.
"""
from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from parallel import mesh as mesh_lib

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),  # expert: MoE layers gather the tokens of an expert group
    ("length", "sequence"),
    ("kv_length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("experts", "expert"),
    ("layers", None),  # the scanned layer stack; "stage" (contiguous blocks per pipeline stage) when mesh.stage > 1
)


def _as_axes(value: Any, where: str) -> MeshAxes:
  if value is None or value == "" or value == "none" or value == "None":
    return None
  axes = (value,) if isinstance(value, str) else tuple(value)
  for a in axes:
    if a not in mesh_lib.AXES:
      raise ValueError(f"{where}: unknown mesh axis {a!r}; mesh axes are {', '.join(mesh_lib.AXES)}")
  return axes[0] if len(axes) == 1 else axes


def logical_rules(mesh_cfg) -> Rules:
  """The logical -> mesh axis table with `config.mesh.rules` overrides applied (same order as DEFAULT_RULES).

  With `config.mesh.stage` > 1 the layer stack maps to `stage` (pipeline parallelism, parallel/pipeline.py).
  `config.mesh.rules` is a sequence of (logical_name, mesh_axis | (mesh_axes...) | None) pairs; an unknown
  name on either side raises ValueError naming it.
  """
  table = dict(DEFAULT_RULES)
  if int(mesh_cfg.get("stage", 1)) > 1:  # pipeline stages own contiguous blocks of the layer stack
    table["layers"] = "stage"
  overrides = mesh_cfg.get("rules", ()) or ()
  for i, entry in enumerate(overrides):
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      raise ValueError(f"config.mesh.rules[{i}]={entry!r}: each rule is a pair (logical_name, mesh_axes)")
    name, value = entry
    if name not in table:
      raise ValueError(f"config.mesh.rules[{i}]: unknown logical axis {name!r}; known: {', '.join(table)}")
    table[name] = _as_axes(value, f"config.mesh.rules[{i}] ({name})")
  return tuple(table.items())


def _flat(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def axis_size(mesh: jax.sharding.Mesh, axes: MeshAxes) -> int:
  """Number of devices a dimension mapped to `axes` is split over."""
  return math.prod(mesh.shape[a] for a in _flat(axes))


def fit_rules(rules: Rules, model_cfg, mesh: jax.sharding.Mesh) -> Rules:
  """Checks that the model's head counts fit the tensor axis; returns the rules to use for this model.

  num_heads must be divisible by the size of the mesh axes `heads` maps to. num_kv_heads either divides by it
  too, or (MQA / GQA with fewer kv heads than tensor shards, e.g. kv_heads=1) the tensor size must be a multiple
  of num_kv_heads: then the K/V projections are replicated across the tensor axis (kv_heads -> None), costing
  a little memory and duplicated K/V compute per shard. Raises ValueError naming the axis otherwise.
  """
  table = dict(rules)
  heads_size = axis_size(mesh, table.get("heads"))
  if model_cfg.num_heads % heads_size:
    raise ValueError(
        f"mesh axis {table['heads']!r} (size {heads_size}) does not divide config.model.num_heads="
        f"{model_cfg.num_heads}; choose config.mesh.tensor among the divisors of num_heads")
  kv_size = axis_size(mesh, table.get("kv_heads"))
  if model_cfg.num_kv_heads % kv_size:
    if kv_size % model_cfg.num_kv_heads:
      raise ValueError(
          f"mesh axis {table['kv_heads']!r} (size {kv_size}) and config.model.num_kv_heads="
          f"{model_cfg.num_kv_heads} neither divide each other; choose config.mesh.tensor dividing num_kv_heads "
          "or a multiple of it (then K/V heads are replicated)")
    table["kv_heads"] = None
  kv_local = model_cfg.num_kv_heads // axis_size(mesh, table.get("kv_heads"))
  _check_context(model_cfg, mesh, model_cfg.num_heads // heads_size, kv_local)
  return tuple(table.items())


def _check_context(model_cfg, mesh: jax.sharding.Mesh, local_heads: int, local_kv_heads: int) -> None:
  """ValueError naming the keys where model.context_parallel cannot run on this mesh (parallel/context.py)."""
  mode, shards = model_cfg.get("context_parallel", "all_gather"), mesh.shape.get("sequence", 1)
  if mode == "all_gather" or shards == 1:
    return
  if mesh.shape.get("stage", 1) > 1:
    raise ValueError(f"model.context_parallel={mode!r} with mesh.stage > 1: pipeline stages run attention with K/V "
                     "gathered over the sequence axis; use model.context_parallel='all_gather' or mesh.stage=1")
  if mode == "ulysses" and local_heads % shards:
    raise ValueError(f"model.context_parallel='ulysses' splits each tensor shard's {local_heads} query heads over "
                     f"mesh.sequence={shards}, which does not divide them; choose mesh.sequence dividing "
                     f"{local_heads} (num_heads / mesh.tensor) or model.context_parallel='ring'")
  per_kv = model_cfg.num_heads // model_cfg.num_kv_heads  # query heads reading one kv head
  per_device = local_heads // shards
  if mode == "ulysses" and local_kv_heads % shards and per_device % per_kv and per_kv % per_device:
    raise ValueError(f"model.context_parallel='ulysses' with {local_kv_heads} kv heads per tensor shard on "
                     f"mesh.sequence={shards}: a device's {per_device} query heads would read parts of kv heads "
                     f"(each serves {per_kv}); choose mesh.sequence dividing {local_kv_heads} or "
                     "model.context_parallel='ring'")
  if (mode == "ring" and model_cfg.get("context_layout") == "zigzag" and model_cfg.get("num_experts", 0)
      and model_cfg.get("capacity_factor", 0)):
    raise ValueError("model.capacity_factor > 0 drops expert assignments in token order, which the ring's zigzag "
                     "layout changes; use model.context_layout='contiguous' or capacity_factor=0 (dropless)")


def check_divisible(specs: Any, shapes: Any, mesh: jax.sharding.Mesh, what: str = "parameter") -> None:
  """Raises ValueError naming the array, dimension and mesh axis where a sharded dimension does not divide.

  `specs` and `shapes` are matching pytrees of PartitionSpec and objects with `.shape`.
  """
  flat_specs = jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
  flat_shapes = jax.tree.leaves(shapes)
  for (path, p), x in zip(flat_specs, flat_shapes):
    for dim, (axes, size) in enumerate(zip(p, x.shape)):
      n = axis_size(mesh, axes)
      if size % n:
        name = jax.tree_util.keystr(path)
        raise ValueError(f"{what} {name} dimension {dim} (size {size}) is sharded over mesh axis {axes!r} of size "
                         f"{n}, which does not divide it; change config.mesh (or config.mesh.rules) or the model size")
