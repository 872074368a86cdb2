"""The one device mesh: axes data, fsdp, tensor, sequence, expert, stage (pipeline stages, parallel/pipeline.py).

`config.mesh` gives each axis's size inside a slice (ICI; -1 = all remaining devices) and, for data and fsdp, a
size across slices or hosts (DCN: `dcn_data`, `dcn_fsdp`). Tensor and sequence parallelism stay inside a
slice/host, where the network is fast; data (and optionally fsdp) spans slices. Final axis size = ICI x DCN.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES = ("data", "fsdp", "tensor", "sequence", "expert", "stage")
DCN_AXES = ("data", "fsdp")  # the only axes allowed to span slices / hosts (config keys dcn_data, dcn_fsdp)
# Device placement order, slowest-network axis first: the innermost axes get the nearest devices.
# Stage sits inside data/fsdp: a process feeds the rows of its batch shards, which every stage reads, so stages
# stay within a process (one host's chips) while data/fsdp span hosts; inside a TPU slice all of it is ICI.
_PLACEMENT = ("data", "fsdp", "stage", "expert", "sequence", "tensor")


class MeshError(ValueError):
  """A mesh that cannot be built on the given devices; the message names the axis and both numbers."""


def _resolve(sizes: dict[str, int], total: int, what: str, prefix: str) -> dict[str, int]:
  """Replaces the (at most one) -1 in `sizes` so the product equals `total`; errors name the axis."""
  free = [a for a, n in sizes.items() if n == -1]
  for a, n in sizes.items():
    if n == 0 or n < -1:
      raise MeshError(f"config.mesh.{prefix}{a}={n}: axis sizes must be >= 1, or -1 for all remaining {what}")
  if len(free) > 1:
    raise MeshError(f"config.mesh: only one axis may be -1, got {', '.join(prefix + a for a in free)}; "
                    "give explicit sizes to all but one")
  fixed = math.prod(n for n in sizes.values() if n != -1)
  if free:
    if total % fixed:
      raise MeshError(f"config.mesh.{prefix}{free[0]}=-1: {total} {what} are not divisible by the product "
                      f"{fixed} of the other axes ({_describe(sizes, prefix)}); change the other axes")
    sizes = {**sizes, free[0]: total // fixed}
  product = math.prod(sizes.values())
  if product != total:
    largest = max((a for a in sizes if sizes[a] > 1), key=lambda a: sizes[a], default="data")
    raise MeshError(f"config.mesh: axes {_describe(sizes, prefix)} multiply to {product}, but there are {total} "
                    f"{what}; change an axis (e.g. config.mesh.{prefix}{largest}) or set one axis to -1")
  return sizes


def _describe(sizes: dict[str, int], prefix: str = "") -> str:
  return " x ".join(f"{prefix}{a}={n}" for a, n in sizes.items())


def _granules(devices: Sequence[Any]) -> tuple[str | None, int]:
  """How devices group across the slow network: TPU slices (hosts of one slice share ICI), else processes."""
  slices = {getattr(d, "slice_index", None) for d in devices}
  if None not in slices and len(slices) > 1:
    return "slice_index", len(slices)
  processes = {d.process_index for d in devices}
  if len(processes) > 1 and devices[0].platform != "tpu":
    return "process_index", len(processes)
  return None, 1


def mesh_shape(mesh_cfg, num_devices: int, num_granules: int = 1) -> tuple[dict[str, int], dict[str, int]]:
  """Resolves `config.mesh` into (ici, dcn) sizes per axis name (both ordered as AXES).

  `num_granules` is the number of slices (or hosts) the devices span. DCN sizes may be -1 (all remaining
  granules); with a DCN product of 1 the devices are treated as one flat group. Raises MeshError naming the
  axis when the sizes cannot match the device count.
  """
  dcn = {a: int(mesh_cfg[f"dcn_{a}"]) for a in DCN_AXES}
  if any(n == -1 for n in dcn.values()):
    dcn = _resolve(dcn, num_granules, "slices/hosts", "dcn_")
  elif math.prod(dcn.values()) not in (1, num_granules):
    _resolve(dcn, num_granules, "slices/hosts", "dcn_")  # raises with the message
  dcn_product = math.prod(dcn.values())
  if num_devices % dcn_product:
    raise MeshError(f"config.mesh: {num_devices} devices cannot be split into {dcn_product} slices/hosts "
                    f"({_describe(dcn, 'dcn_')})")
  ici = _resolve({a: int(mesh_cfg[a]) for a in AXES}, num_devices // dcn_product,
                 "devices" if dcn_product == 1 else "devices per slice/host", "")
  return ici, {a: dcn.get(a, 1) for a in AXES}


def _ordered_mesh(devices, attr, ici_placed, dcn_placed) -> np.ndarray:
  """[ici x dcn per placed axis] device array in (granule, id) order, each axis's DCN part outermost."""
  ordered = sorted(devices, key=lambda d: (getattr(d, attr) if attr else 0, d.id))
  n = len(ici_placed)
  grid = np.asarray(ordered, dtype=object).reshape(list(dcn_placed) + list(ici_placed))
  # (dcn_0..dcn_n-1, ici_0..ici_n-1) -> (dcn_0, ici_0, dcn_1, ici_1, ...) -> merge each pair.
  grid = np.transpose(grid, [k for i in range(n) for k in (i, n + i)])
  return grid.reshape([d * i for d, i in zip(dcn_placed, ici_placed)])


def _spans_processes(placed: np.ndarray, axis: int) -> bool:
  """Whether moving along `axis` of the device array changes the process."""
  process_ids = np.vectorize(lambda d: d.process_index, otypes=[int])(placed)
  return bool(np.any(process_ids != np.take(process_ids, [0], axis=axis)))


def make_mesh(mesh_cfg, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
  """Builds the mesh with axes AXES (all `Auto`) from `config.mesh`.

  Args:
    mesh_cfg: `config.mesh` (sizes per axis, -1 = remaining devices; dcn_data / dcn_fsdp across slices).
    devices: the devices to use; default `jax.devices()`. May be abstract TPU devices from
      `jax.experimental.topologies` (for ahead-of-time compilation). Devices carrying distinct `slice_index`
      values (multi-slice TPU) or spanning several processes (multi-host GPU) form the DCN granules.
  Returns:
    A `jax.sharding.Mesh` whose axis sizes are ICI x DCN per axis.
  Raises:
    MeshError: the sizes do not multiply to the device count (the message gives both numbers).
  """
  devices = list(jax.devices() if devices is None else devices)
  if not devices:
    raise MeshError("make_mesh: no devices given")
  attr, num_granules = _granules(devices)
  ici, dcn = mesh_shape(mesh_cfg, len(devices), num_granules)
  order = [AXES.index(a) for a in _PLACEMENT]
  ici_placed = [ici[a] for a in _PLACEMENT]
  dcn_placed = [dcn[a] for a in _PLACEMENT]
  try:
    if math.prod(dcn_placed) > 1:
      placed = mesh_utils.create_hybrid_device_mesh(
          ici_placed, dcn_placed, devices, process_is_granule=(attr == "process_index"),
          allow_split_physical_axes=True)
    else:
      placed = mesh_utils.create_device_mesh(ici_placed, devices, allow_split_physical_axes=True)
  except (AssertionError, NotImplementedError, ValueError) as e:
    # No topology-aware layout for these devices (e.g. an AOT topology exposing two cores per TPU v4 chip):
    # fall back to device-id order, granules outermost; correct, possibly slower collectives.
    warnings.warn(f"mesh {_describe(ici)}: no topology-aware device layout for {len(devices)} "
                  f"{devices[0].platform} devices ({type(e).__name__}: {e}); placing devices in id order, which is "
                  "correct but may make collectives slower", RuntimeWarning, stacklevel=2)
    placed = _ordered_mesh(devices, attr, ici_placed, dcn_placed)
  if ici["stage"] > 1 and _spans_processes(placed, _PLACEMENT.index("stage")):
    # The topology-aware layout put stages on different hosts, which would then need the same batch rows (every
    # stage reads the whole batch shard); take devices in (process, id) order instead, so each host holds whole
    # stage groups. Inside a TPU slice every link is ICI; collectives may route less directly.
    placed = _ordered_mesh(devices, "process_index", ici_placed, dcn_placed)
  device_array = np.transpose(placed, np.argsort(order))  # placement order -> AXES order
  return jax.sharding.Mesh(device_array, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def describe(mesh: jax.sharding.Mesh) -> str:
  """One line for logs: 'data=2 fsdp=2 tensor=2 sequence=1 expert=1 stage=1 (8 devices)'."""
  return " ".join(f"{a}={n}" for a, n in mesh.shape.items()) + f" ({mesh.devices.size} devices)"
