"""Pipeline parallelism over the mesh's `stage` axis: GPipe and circular (interleaved) schedules (docs/pipeline.md).

One program, no shard_map: the S stages are a vmapped dimension sharded over `stage` (MaxText's formulation), so
the other mesh axes (data, fsdp, tensor, sequence) keep working inside each stage through the logical-axis rules.
Each iteration every stage runs its slice of the layer stack on one microbatch; the stage outputs then shift by
one stage (a slice + concatenate along the stage-sharded dimension, which XLA lowers to a collective-permute).

The layer stack is stored as the plain `[units, ...]` stack (units = layers, or MoE layer groups) with its leading
dimension split over `stage` in contiguous blocks, so checkpoints do not depend on S. With R repeats the stack is
viewed as `[R, S, per, ...]`: stage s runs units (r*S + s)*per .. +per on its r-th visit of a microbatch, so a
microbatch goes round the ring R times (layers in their plain order) and the bubble shrinks to (S-1)/(R*M+S-1).

Schedule (R repeats, S stages, M >= S microbatches, T = R*M + S - 1 iterations): at iteration t stage s works on
k = t - s (valid for 0 <= k < R*M), i.e. microbatch k mod M on repeat k // M. Stage 0 reads microbatch t mod M from
a loop buffer that starts as the inputs; the last stage writes its result for microbatch m back into slot m, where
stage 0 finds it M - S + 1 iterations later for the next repeat (hence M >= S), and which holds the final output
after the last repeat. Backward is autodiff through the iteration scan (GPipe: all forwards, then all backwards).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

AXIS = "stage"  # the mesh axis stages are split over


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How the layer stack is pipelined: S stages, M microbatches, R repeats (circular when R > 1).

  remat: checkpoint each stage visit (only the stage inputs of every iteration are kept for the backward pass;
  the stage's layers are recomputed), bounding activation memory to R*M+S-1 microbatch boundaries plus one
  visit's activations, instead of every layer's activations for every microbatch (plain GPipe through autodiff).
  Circular schedules (R > 1) always do this: their weights change per iteration, and keeping what the backward
  pass needs of them would hold a copy of the stage's weights per iteration.
  """
  stages: int
  microbatches: int
  repeats: int = 1
  remat: bool = False

  @property
  def iterations(self) -> int:
    """T = R*M + S - 1 schedule steps."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """Idle fraction of stage-iterations: (S-1) / (R*M + S - 1)."""
    return (self.stages - 1) / self.iterations


def check(schedule: Schedule, units: int, rows: int, row_shards: int, *, what_units: str, what_rows: str) -> None:
  """Raises ValueError naming the key when the schedule does not fit the stack or the batch.

  units: length of the scanned stack (layers, or MoE layer groups), described by `what_units` (the config keys);
  rows: batch rows reaching the model per call (batch_size / grad_accum), described by `what_rows`; row_shards:
  devices each microbatch's rows are split over (data x fsdp x expert).
  """
  S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
  if R < 1:
    raise ValueError(f"config.train.pipeline_repeats={R} must be >= 1")
  if M < 1:
    raise ValueError(f"config.train.pipeline_microbatches={M} must be >= 1 (0 = mesh.stage)")
  if M < S:
    raise ValueError(f"config.train.pipeline_microbatches={M} is smaller than config.mesh.stage={S}: a stage would "
                     "idle and the loop buffer needs M >= S; set train.pipeline_microbatches >= mesh.stage")
  if units % (S * R):
    raise ValueError(f"{what_units} gives {units} scanned units, not divisible by config.mesh.stage x "
                     f"config.train.pipeline_repeats = {S} x {R}: every stage visit runs the same number of layers; "
                     "change the stage count, the repeats or the depth")
  if rows % M or (rows // M) % row_shards:
    raise ValueError(f"{what_rows} = {rows} rows cannot be split into train.pipeline_microbatches={M} microbatches "
                     f"of a multiple of {row_shards} rows (the batch shards); change the batch size or the "
                     "microbatch count")


def _constrain(x: jax.Array, spec: tuple) -> jax.Array:
  """Sharding constraint naming only `spec`'s entries; the remaining dimensions are left to the partitioner."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return x
  full = tuple(spec) + (PartitionSpec.UNCONSTRAINED,) * (x.ndim - len(spec))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*full)))


def run(stage_fn: Callable, weights: Any, x: jax.Array, side: Any, schedule: Schedule) -> tuple[jax.Array, Any]:
  """Runs `x` through the pipelined stack; returns (output like x, sum of stage_fn's stats over stage visits).

  Args:
    stage_fn: (weights with leading dim [per], x_b..., side_b...) -> (x_b..., stats pytree). One stage visit on
      one microbatch of b = rows/M rows; it must not mix rows.
    weights: pytree whose leaves have the leading stack dimension [units] (split over `stage`); integer leaves
      (e.g. per-layer windows) travel with their layers.
    x: [rows, ...] the stack's input (rows split over the batch axes, replicated over `stage`).
    side: pytree of [rows, ...] per-row inputs every stage reads for its current microbatch (segment ids,
      positions).
    schedule: the Schedule; stages must equal the mesh's `stage` size.
  Returns:
    (y [rows, ...], stats summed over the R*M*S valid stage visits; divide by that for the mean).
  """
  S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
  rows = x.shape[0]
  b = rows // M
  # Microbatch m = rows m, m+M, m+2M, ...: each batch shard's contiguous rows split evenly, no data moves.
  split = lambda a: jnp.swapaxes(a.reshape(b, M, *a.shape[1:]), 0, 1)
  x_M = split(x)
  side_M = jax.tree.map(split, side)
  units = jax.tree.leaves(weights)[0].shape[0]
  per = units // (S * R)
  weights_RS = jax.tree.map(lambda a: _constrain(a.reshape(R, S, per, *a.shape[1:]), (None, AXIS)), weights)

  def visit(weights_R, r, x_b, side_b):
    # One repeat: a static slice of the loop-invariant stack, which the iteration scan's backward pass reads
    # as it is. Several: the repeat's weights are picked per iteration, so the visit is recomputed (below)
    # rather than keeping a copy of the stage's weights (and whatever is derived from them) per iteration.
    w = jax.tree.map(lambda a: a[0] if R == 1 else a[r], weights_R)
    return stage_fn(w, x_b, side_b)

  if schedule.remat or R > 1:
    visit = jax.checkpoint(visit, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
  stages = jax.vmap(visit, in_axes=(1, 0, 0, 0), spmd_axis_name=AXIS)
  stats_shape = jax.eval_shape(lambda: stage_fn(jax.tree.map(lambda a: a[0, 0], weights_RS), x_M[0],
                                                jax.tree.map(lambda a: a[0], side_M))[1])
  stats0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)
  s_S = jnp.arange(S)

  def iteration(carry, t):
    prev_S, buf_M, stats = carry
    k_S = t - s_S
    valid_S = (k_S >= 0) & (k_S < R * M)
    m_S, r_S = jnp.mod(k_S, M), jnp.clip(k_S // M, 0, R - 1)
    # Stage 0 takes its microbatch from the loop buffer, stage s > 0 the output of stage s-1 (collective-permute).
    in_S = jnp.concatenate([buf_M[t % M][None], prev_S[:-1]], axis=0)
    in_S = _constrain(in_S, (AXIS,))
    side_S = jax.tree.map(lambda a: _constrain(a[m_S], (AXIS,)), side_M)
    out_S, stats_S = stages(weights_RS, r_S, in_S, side_S)
    out_S = _constrain(out_S, (AXIS,))
    k_last = t - (S - 1)
    m_last = jnp.mod(k_last, M)
    done = (k_last >= 0) & (k_last < R * M)
    buf_M = buf_M.at[m_last].set(jnp.where(done, out_S[-1], buf_M[m_last]))
    mask = lambda v: jnp.sum(jnp.where(valid_S.reshape((S,) + (1,) * (v.ndim - 1)), v, 0), axis=0)
    stats = jax.tree.map(lambda acc, v: acc + mask(v), stats, stats_S)
    return (out_S, buf_M, stats), None

  prev0 = _constrain(jnp.zeros((S,) + x_M.shape[1:], x.dtype), (AXIS,))
  (_, buf_M, stats), _ = jax.lax.scan(iteration, (prev0, x_M, stats0), jnp.arange(schedule.iterations))
  y = jnp.swapaxes(buf_M, 0, 1).reshape(x.shape)
  return y, stats
