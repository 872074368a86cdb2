"""`shard_map` wrappers that run per-device kernels (Pallas attention) under the current mesh.

A kernel such as splash attention is a single-device program: under a mesh it must see whole rows and whole heads
of its own shard, never a partitioned operand. `shard_heads` hands each device its batch rows and query heads
(and the kv heads those read) and reassembles the output with the same layout. The kernel is passed in as a
function, so this module knows nothing of the model.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

MeshAxes = str | tuple[str, ...] | None


def _flat(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _size(mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in _flat(axes))


def _fit(mesh, axes: MeshAxes, dim: int) -> MeshAxes:
  """`axes` when they split `dim` evenly, else None (that dimension replicated: shard_map needs even splits)."""
  return axes if _flat(axes) and dim % _size(mesh, axes) == 0 else None


def shard_heads(kernel: Callable, q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                segment_ids_BT: jax.Array, *replicated, batch: MeshAxes, heads: MeshAxes,
                kv_heads: MeshAxes, length: MeshAxes = None, tokens: tuple = ()) -> jax.Array:
  """`kernel(q_bThK, k_bSgK, v_bSgK, segment_ids_bT, *tokens_bT, *replicated) -> o_bThK` on each device's shard.

  Rows (B) are split over the mesh axes `batch`, query heads (H) over `heads`; the lengths T, S stay whole (a
  length split over the sequence axis is gathered) unless `length` names the axes that split them (context
  parallelism: the kernel then sees T / n consecutive rows and runs the collectives over those axes itself).
  `tokens` are further [B, T] operands split like the segment ids. Query head h reads kv head h // (H // G). When `kv_heads`
  names the same axes as `heads`, K/V are split the same way and each device's query heads read its own kv
  heads; otherwise (fewer kv heads than head shards, MQA) K/V come replicated over the head axes and each device
  slices the g = max(1, h / (H // G)) consecutive kv heads its h = H / shards query heads read. `replicated`
  operands (a traced window) reach every device whole. A dimension that the axes do not split evenly stays
  replicated. Returns o_BTHK with q's layout: rows over `batch`, heads over `heads`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  B, _, H, _ = q_BTHK.shape
  G = k_BSGK.shape[2]
  R = H // G  # query heads per kv head
  batch, heads = _fit(mesh, batch, B), _fit(mesh, heads, H)
  shards = _size(mesh, heads)
  h = H // shards  # query heads per device
  same = _flat(kv_heads) == _flat(heads) and G % shards == 0
  if not same and shards > 1 and h % R and R % h:
    raise ValueError(f"shard_heads: {h} query heads per device and {R} query heads per kv head: neither divides "
                     "the other, so a device's query heads do not read whole kv heads")
  T = q_BTHK.shape[1]
  if _flat(length) and T % _size(mesh, length):
    raise ValueError(f"shard_heads: length {T} does not divide over mesh axes {length} "
                     f"(size {_size(mesh, length)}); choose train.seq_len as a multiple of mesh.sequence")
  length = length if _flat(length) else None
  q_spec = P(batch, length, heads, None)
  kv_spec = P(batch, length, heads if same else None, None)

  def local(q_bThK, k_bSGK, v_bSGK, segment_ids_bT, *rest):  # rest: the tokens' operands, then the replicated
    if not same and shards > 1:
      g = max(1, h // R)
      first = jax.lax.axis_index(_flat(heads)) * h // R
      k_bSGK = jax.lax.dynamic_slice_in_dim(k_bSGK, first, g, axis=2)
      v_bSGK = jax.lax.dynamic_slice_in_dim(v_bSGK, first, g, axis=2)
    return kernel(q_bThK, k_bSGK, v_bSGK, segment_ids_bT, *rest)

  # check_vma=False: under the pipeline's vmap over stages (spmd_axis_name="stage") jax adds `stage` to the specs
  # but its varying-axes check compares against the unbatched out_specs.
  token_specs = (P(batch, length),) * (1 + len(tokens))
  return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, *token_specs, *(P() for _ in replicated)),
                       out_specs=q_spec, check_vma=False)(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, *tokens,
                                                          *replicated)
