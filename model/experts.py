"""The routed experts' computation: rows laid out by expert, the experts' FFN over them (grouped matmuls or the
`tiled` loops), and expert parallelism as an all-to-all exchange inside `jax.shard_map`.

Shapes: as model/moe.py (T tokens, K experts per token, A = T*K assignments, E experts, E_loc on this device, D, F),
plus R rows handed to the experts (the assignments on one device; the rows received under expert parallelism),
P rows of the expert-sorted buffer, G devices exchanging tokens, S send slots.

Layout: rows are packed by expert with a stable argsort. Rows move by gathers only, forward and backward
(`permute`: the transpose of a gather by a one-to-one map is the gather by its inverse), because XLA:CPU runs
scatters of rows one element at a time; only small integer maps are scattered. `tiled` runs the whole FFN in loops
over the experts and their rows' tiles (`tiles_ffn`), so its cost follows the real rows however large the buffer:
what XLA:CPU runs fastest (benchmarks/moe.py), and what the megablox kernels do on TPUs.

Expert parallelism (tokens split over the expert axes, as everywhere outside MoE layers): each device sends every
kept assignment to the device holding its expert, runs its E_loc experts on the rows it received, and a second
exchange returns each row to its token's device. Any device may send all its A assignments to one device, so the
receive buffer holds G*A rows (about A of them real) and nothing is ever dropped: on TPUs ragged_all_to_all moves
only the real rows into it; elsewhere all_to_all moves blocks of A slots per destination (XLA:CPU does not run the
ragged form), and the tile loops compute only the real rows.
Expert axes over which the tokens are replicated (not split) need no exchange: each device of such a group takes
its own experts' assignments and a psum adds the groups. D split over fsdp is all-gathered like FSDP weights; F
split over tensor gives partial sums, added by a psum.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from model import axes
from model import megablox
from model import remat
from model import splash
from model.axes import BATCH, EMBED, EXPERTS, LENGTH, MLP

# The exchange by platform: ragged_all_to_all (only real rows travel) where XLA runs it and it was compiled here
# (TPU, ahead of time); the dense all_to_all over worst-case buffers elsewhere (CPU; GPUs until run on one).
RAGGED_EXCHANGE = {"tpu": True}
# Rows per tile of the `tiled` expert FFN: whole tiles of TILE_ROWS, each expert's remainder in tiles of
# SMALL_TILE_ROWS (the fastest pair for one MoE layer on the 2-core CPU machine, benchmarks/moe.py).
TILE_ROWS, SMALL_TILE_ROWS = 256, 32
# Under expert parallelism the experts run inside this named scope + G: their buffer has room for G devices' rows
# and balanced routing fills 1/G of it, which the performance model (train/planning/predict.py) prices.
RECEIVED_SCOPE = "moe_rows_filled_1_of_"


@jax.custom_vjp
def permute(x_RD: jax.Array, idx_P: jax.Array, inv_R: jax.Array) -> jax.Array:
  """y[p] = x_RD[idx_P[p]] (a zero row where idx_P[p] is out of range) for a one-to-one map: inv_R[r] is the row
  that row r goes to (out of range: nowhere). inv_R makes the gradient a gather as well. Returns [P, ...]."""
  return jnp.take(x_RD, idx_P, axis=0, mode="fill", fill_value=0)


def _permute_fwd(x_RD, idx_P, inv_R):
  return permute(x_RD, idx_P, inv_R), (idx_P, inv_R)


def _permute_bwd(res, g_PD):
  idx_P, inv_R = res
  return jnp.take(g_PD, inv_R, axis=0, mode="fill", fill_value=0), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


class Layout(NamedTuple):
  """Where R rows go when packed by group. dest_R: row of each row in the packed order (`absent` when no group
  takes it); sizes_E: rows per group."""
  dest_R: jax.Array
  sizes_E: jax.Array


def layout(group_R: jax.Array, num_groups: int, absent: int) -> Layout:
  """Pack R rows by group (group_R == num_groups: a row no group takes), keeping their order within a group."""
  R, E = group_R.shape[0], num_groups
  order_R = jnp.argsort(group_R, stable=True)
  sizes_E = jnp.bincount(group_R, length=E + 1)[:E].astype(jnp.int32)
  dest_sorted_R = jnp.where(group_R[order_R] < E, jnp.arange(R, dtype=jnp.int32), absent)
  dest_R = jnp.zeros((R,), jnp.int32).at[order_R].set(dest_sorted_R)
  return Layout(dest_R, sizes_E)


def grouped_matmul(impl: str | megablox.MegabloxOptions, sizes_E: jax.Array) -> Callable[[jax.Array, jax.Array],
                                                                                         jax.Array]:
  """The grouped matmul `mm(a_PX, w_EXY) -> y_PY` of packed rows: group e is the sizes_E[e] rows after groups
  0 .. e-1, times w_EXY[e]; rows past sum(sizes_E) come out 0.

  impl: "ragged" (`jax.lax.ragged_dot`), or megablox: a MegabloxOptions (the Pallas TPU kernels,
  model/megablox.py), or "megablox" for its default tiles without interpret mode.
  """
  if impl == "ragged":
    return lambda a_PX, w_EXY: jax.lax.ragged_dot(a_PX, w_EXY, sizes_E)
  if impl == "megablox" or isinstance(impl, megablox.MegabloxOptions):
    opts = impl if isinstance(impl, megablox.MegabloxOptions) else megablox.MegabloxOptions()
    return lambda a_PX, w_EXY: megablox.gmm(a_PX, w_EXY, sizes_E, opts)
  raise ValueError(f"model.moe_impl={impl!r} is not one of ragged, tiled, megablox")


def _rows(a, r0, rows):
  return jax.lax.dynamic_slice_in_dim(a, r0, rows)


def _put(buf, r0, v):
  return jax.lax.dynamic_update_slice_in_dim(buf, v.astype(buf.dtype), r0, 0)


def _expert(w_EXY, e):
  return jax.lax.dynamic_index_in_dim(w_EXY, e, 0, keepdims=False)


def _over_tiles(start, end, fn, carry):
  """carry = fn(r0, rows, carry) over rows [start, end): whole TILE_ROWS tiles, then SMALL_TILE_ROWS tiles over the
  rest (the last may overhang `end`)."""
  n_big = (end - start) // TILE_ROWS
  carry = jax.lax.fori_loop(0, n_big, lambda i, c: fn(start + i * TILE_ROWS, TILE_ROWS, c), carry)
  rest = start + n_big * TILE_ROWS
  n_small = -(-(end - rest) // SMALL_TILE_ROWS)
  return jax.lax.fori_loop(0, n_small, lambda i, c: fn(rest + i * SMALL_TILE_ROWS, SMALL_TILE_ROWS, c), carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def tiles_ffn(x_PD: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array, sizes_E: jax.Array,
              act: Callable, keep_products: bool = True) -> jax.Array:
  """The expert FFN of packed rows (expert e: the sizes_E[e] rows after experts 0 .. e-1) as loops: over experts
  (each expert's weights sliced once), over its rows in tiles (run-time trip counts: a worst-case buffer costs
  only its real rows). A tile overhanging its expert's rows is overwritten by the next expert's tiles in the
  forward pass and masked out of the weight gradients, so experts need no padding; x_PD must have TILE_ROWS rows
  past the last expert's. keep_products: the gate and up products are saved residuals ([P, F] each); else the
  backward pass recomputes them tile by tile (for a worst-case buffer mostly empty, two F-wide buffers of P rows
  cost more than two more products over the real rows). Returns [P, D] (rows past the experts' undefined: the
  caller drops them)."""
  return _tiles_fwd(x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, act, keep_products)[0]


def _tiles_fwd(x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, act, keep_products):
  P, F = x_PD.shape[0], gate_EDF.shape[-1] if keep_products else 0
  end_E = jnp.cumsum(sizes_E)

  def per_expert(e, carry):
    w_gate, w_up, w_down = (_expert(w, e) for w in (gate_EDF, up_EDF, down_EFD))

    def tile(r0, rows, bufs):
      x_RD = _rows(x_PD, r0, rows)
      g_RF, u_RF = x_RD @ w_gate, x_RD @ w_up
      outs = ((act(g_RF) * u_RF) @ w_down, g_RF, u_RF) if keep_products else ((act(g_RF) * u_RF) @ w_down,)
      return tuple(_put(b, r0, v) for b, v in zip(bufs, outs))
    return _over_tiles(end_E[e] - sizes_E[e], end_E[e], tile, carry)
  zeros = lambda width: jnp.zeros((P, width), x_PD.dtype)
  init = (zeros(x_PD.shape[1]), zeros(F), zeros(F)) if keep_products else (zeros(x_PD.shape[1]),)
  out = jax.lax.fori_loop(0, gate_EDF.shape[0], per_expert, init)
  return out if keep_products else (out[0], None, None)


def _tiles_fwd_rule(x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, act, keep_products):
  y_PD, g_PF, u_PF = _tiles_fwd(x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, act, keep_products)
  return y_PD, (x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, g_PF, u_PF)


def _tiles_bwd_rule(act, keep_products, res, dy_PD):
  x_PD, gate_EDF, up_EDF, down_EFD, sizes_E, g_PF, u_PF = res
  end_E = jnp.cumsum(sizes_E)
  f32 = lambda a_RX, b_RY: jnp.matmul(a_RX.T, b_RY, preferred_element_type=jnp.float32)  # summed over rows

  def per_expert(e, carry):
    dx_PD, dgate, dup, ddown = carry
    w_gate, w_up, w_down = (_expert(w, e) for w in (gate_EDF, up_EDF, down_EFD))

    def tile(r0, rows, c):
      dx_PD, acc_gate, acc_up, acc_down = c
      x_RD, dy_RD = _rows(x_PD, r0, rows), _rows(dy_PD, r0, rows)
      if keep_products:
        g_RF, u_RF = _rows(g_PF, r0, rows), _rows(u_PF, r0, rows)
      else:
        g_RF, u_RF = x_RD @ w_gate, x_RD @ w_up
      dy_RD = jnp.where((r0 + jnp.arange(rows) < end_E[e])[:, None], dy_RD, 0)  # an overhang: the next expert's
      h_RF, h_vjp = jax.vjp(lambda g, u: act(g) * u, g_RF, u_RF)
      dg_RF, du_RF = h_vjp((dy_RD @ w_down.T).astype(h_RF.dtype))
      return (_put(dx_PD, r0, dg_RF @ w_gate.T + du_RF @ w_up.T), acc_gate + f32(x_RD, dg_RF),
              acc_up + f32(x_RD, du_RF), acc_down + f32(h_RF, dy_RD))
    f32_zeros = lambda w: jnp.zeros(w.shape, jnp.float32)
    dx_PD, *acc = _over_tiles(end_E[e] - sizes_E[e], end_E[e], tile,
                              (dx_PD, f32_zeros(w_gate), f32_zeros(w_up), f32_zeros(w_down)))
    put = lambda grad, a: jax.lax.dynamic_update_index_in_dim(grad, a.astype(grad.dtype), e, 0)
    return (dx_PD, *(put(g, a) for g, a in zip((dgate, dup, ddown), acc)))
  init = (jnp.zeros_like(x_PD), jnp.zeros_like(gate_EDF), jnp.zeros_like(up_EDF), jnp.zeros_like(down_EFD))
  return (*jax.lax.fori_loop(0, gate_EDF.shape[0], per_expert, init), None)


tiles_ffn.defvjp(_tiles_fwd_rule, _tiles_bwd_rule)


def _has_adapters(*kernels) -> bool:
  return any(hasattr(w, "einsum") for w in kernels)  # model.lora.SideKernel


def _adapted(mm: Callable, side_mm: Callable, a_PX: jax.Array, w_EXY) -> jax.Array:
  """mm(a, W) for an expert kernel; for a LoRA side-path kernel (model.lora.SideKernel, one A, B pair per expert)
  mm(a, stop_gradient(W)) + scale * side_mm(side_mm(dropout(a), A), B), the rank-r products through ragged_dot
  (the megablox kernels tile dims of 128)."""
  if not hasattr(w_EXY, "einsum"):
    return mm(a_PX, w_EXY)
  y_PY = mm(a_PX, jax.lax.stop_gradient(w_EXY.w))
  return y_PY + (w_EXY.scale * side_mm(side_mm(w_EXY.drop(a_PX), w_EXY.a), w_EXY.b)).astype(y_PY.dtype)


def grouped_ffn(x_RD: jax.Array, group_R: jax.Array, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array,
                act: Callable, impl, load: int | None = None) -> jax.Array:
  """down_e(act(gate_e x_r) * up_e x_r) for each row r with e = group_R[r] (E_loc = gate_EDF.shape[0]: no expert,
  a zero row). load: the rows expected to be real (default R); `tiled` recomputes its products in the backward
  pass when R is more than twice that. Returns [R, D]."""
  R, E = x_RD.shape[0], gate_EDF.shape[0]
  rows = R + TILE_ROWS if impl == "tiled" else R  # tiled: room for the last tile's overhang
  lay = layout(group_R, E, absent=rows)
  src_P = jnp.full((rows,), R, jnp.int32).at[lay.dest_R].set(jnp.arange(R, dtype=jnp.int32), mode="drop")
  x_PD = permute(x_RD, src_P, lay.dest_R)
  if impl == "tiled" and not _has_adapters(gate_EDF, up_EDF, down_EFD):
    y_PD = tiles_ffn(x_PD, gate_EDF, up_EDF, down_EFD, lay.sizes_E, act, R <= 2 * (load or R))
  else:  # LoRA adapters on the experts: the grouped matmuls (tiles_ffn's loops take plain kernels)
    mm = functools.partial(_adapted, grouped_matmul("ragged" if impl == "tiled" else impl, lay.sizes_E),
                           grouped_matmul("ragged", lay.sizes_E))
    h_PF = act(remat.tag(mm(x_PD, gate_EDF), remat.MLP_IN)) * remat.tag(mm(x_PD, up_EDF), remat.MLP_IN)
    y_PD = mm(remat.tag(h_PF, remat.MLP_HIDDEN), down_EFD)
  return permute(y_PD, lay.dest_R, src_P)


def _combine(y_AD: jax.Array, weights_TK: jax.Array, ok_A: jax.Array) -> jax.Array:
  """sum_k weights_tk * y_(t,k) over the kept assignments: [T, D]."""
  T, K = weights_TK.shape
  coef_A = jnp.where(ok_A, weights_TK.reshape(-1), 0.0).astype(y_AD.dtype)
  return jnp.sum((y_AD * coef_A[:, None]).reshape(T, K, -1), axis=1)


def expert_ffn(x_TD: jax.Array, experts_TK: jax.Array, weights_TK: jax.Array, keep_TK: jax.Array,
               gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array, first_expert, act: Callable,
               impl: str | megablox.MegabloxOptions = "ragged") -> jax.Array:
  """sum_k weights_tk * down_e(act(gate_e x_t) * up_e x_t) over the kept assignments of the local experts, on this
  device's tokens (no exchange).

  Local experts are first_expert .. first_expert + E_loc - 1 (E_loc = gate_EDF.shape[0]); other experts'
  assignments and dropped ones (keep 0) contribute nothing. `impl` picks the grouped matmul (`grouped_matmul`).
  Returns [T, D] in x's dtype.
  """
  K, E_loc = experts_TK.shape[1], gate_EDF.shape[0]
  expert_A = experts_TK.reshape(-1) - first_expert
  ok_A = keep_TK.reshape(-1) & (expert_A >= 0) & (expert_A < E_loc)
  y_AD = grouped_ffn(jnp.repeat(x_TD, K, axis=0), jnp.where(ok_A, expert_A, E_loc), gate_EDF, up_EDF, down_EFD,
                     act, impl)
  return _combine(y_AD, weights_TK, ok_A)


def _owners(experts_A, keep_A, E_loc: int, ep_axes, a2a_axes):
  """(dest_A, mine_A): the a2a-group index of each assignment's expert's device, and whether this device sends it.
  Expert e lives on the device with linear index e // E_loc over ep_axes; over the other expert axes (tokens
  replicated there) a device takes only its own experts' assignments."""
  owner_A = experts_A // E_loc
  dest_A, mine_A, stride = jnp.zeros_like(owner_A), keep_A, 1
  for name in reversed(ep_axes):  # the owner's coordinate on each expert axis, row-major
    size = jax.lax.axis_size(name)
    coord_A = (owner_A // stride) % size
    stride *= size
    if name in a2a_axes:
      dest_A = dest_A + coord_A * math.prod(jax.lax.axis_size(a) for a in a2a_axes[a2a_axes.index(name) + 1:])
    else:
      mine_A = mine_A & (coord_A == jax.lax.axis_index(name))
  return dest_A, mine_A


def _dense_exchange(rows, a2a_axes, G: int, A: int):
  """(slot_A, slots, send, back): every destination gets a block of A slots (the worst case), one all_to_all each
  way. rows: (dest_A, mine_A, packed_A: each assignment's row when packed by destination, start_G: where each
  destination's rows start there). send(a, fill) / back(y) move [slots, ...] rows there and back."""
  dest_A, mine_A, packed_A, start_G = rows
  slot_A = jnp.where(mine_A, packed_A - start_G[jnp.minimum(dest_A, G - 1)] + dest_A * A, G * A)
  exchange = functools.partial(jax.lax.all_to_all, axis_name=a2a_axes, split_axis=0, concat_axis=0, tiled=True)
  return slot_A, G * A, lambda a, fill=0: exchange(a), exchange


def _ragged_exchange(rows, a2a_axes, G: int, A: int):
  """As `_dense_exchange` with ragged_all_to_all: only real rows travel (TPUs; XLA:CPU does not run it). Sender
  rows are packed by destination; a receiver stacks its senders' rows in sender order, so sender s's rows land
  after those of senders 0 .. s-1 on each receiver."""
  dest_A, mine_A, packed_A, start_G = rows
  sizes_G = jnp.bincount(jnp.where(mine_A, dest_A, G), length=G + 1)[:G].astype(jnp.int32)
  recv_G = jax.lax.all_to_all(sizes_G, a2a_axes, 0, 0, tiled=True)
  sizes_SG = jax.lax.all_gather(sizes_G, a2a_axes, axis=0, tiled=False)  # [senders, receivers]
  land_G = (jnp.cumsum(sizes_SG, 0) - sizes_SG)[jax.lax.axis_index(a2a_axes)]
  recv_start_G = jnp.cumsum(recv_G) - recv_G
  home_G = jax.lax.all_to_all(start_G.astype(jnp.int32), a2a_axes, 0, 0, tiled=True)  # senders' own offsets

  def send(a_AX, fill=0):
    out = jnp.full((G * A, *a_AX.shape[1:]), fill, a_AX.dtype)
    return jax.lax.ragged_all_to_all(a_AX, out, start_G.astype(jnp.int32), sizes_G, land_G, recv_G,
                                     axis_name=a2a_axes)

  def back(y_SX):
    out = jnp.zeros((A, *y_SX.shape[1:]), y_SX.dtype)
    return jax.lax.ragged_all_to_all(y_SX, out, recv_start_G, recv_G, home_G, sizes_G, axis_name=a2a_axes)
  return jnp.where(mine_A, packed_A, A), A, send, back


def _exchange_ffn(x_TD, experts_TK, weights_TK, keep_TK, gate_EDF, up_EDF, down_EFD, act, impl,
                  ep_axes: tuple[str, ...], a2a_axes: tuple[str, ...], ragged: bool = False) -> jax.Array:
  """`expert_ffn` for the tokens of one device under expert parallelism: assignments travel to their experts'
  devices over `a2a_axes` (all_to_all, or ragged_all_to_all if `ragged`) and back. Returns [T, D], partial over the
  expert axes the tokens are replicated on (the caller's psum adds them)."""
  T, K = experts_TK.shape
  A, E_loc = T * K, gate_EDF.shape[0]
  G = math.prod(jax.lax.axis_size(a) for a in a2a_axes)
  experts_A = experts_TK.reshape(-1)
  dest_A, mine_A = _owners(experts_A, keep_TK.reshape(-1), E_loc, ep_axes, a2a_axes)
  by_dest = layout(jnp.where(mine_A, dest_A, G), G, absent=A)  # assignments packed by destination
  start_G = jnp.cumsum(by_dest.sizes_E) - by_dest.sizes_E
  slot_A, slots, send, back = (_ragged_exchange if ragged else _dense_exchange)(
      (dest_A, mine_A, by_dest.dest_R, start_G), a2a_axes, G, A)
  src_S = jnp.full((slots,), A, jnp.int32).at[slot_A].set(jnp.arange(A, dtype=jnp.int32), mode="drop")
  local_S = jnp.take(experts_A % E_loc, src_S, mode="fill", fill_value=E_loc)
  x_SD = permute(jnp.repeat(x_TD, K, axis=0), src_S, slot_A)
  groups = send(local_S, E_loc)  # rows nobody sent (ragged: past the received ones) are no expert's
  with jax.named_scope(f"{RECEIVED_SCOPE}{G}"):
    y_RD = grouped_ffn(send(x_SD), groups, gate_EDF, up_EDF, down_EFD, act, impl, load=A)
  return _combine(permute(back(y_RD), slot_A, src_S), weights_TK, mine_A)


def _one_key(w):
  """A LoRA expert kernel with one dropout key for all its experts (the rows' masks differ by row; the key need not
  travel sharded like the experts); a plain kernel unchanged."""
  if not hasattr(w, "einsum") or w.key is None:
    return w
  return type(w)(w.w, w.a, w.b, w.key.reshape(-1, w.key.shape[-1])[0], scale=w.scale, dropout=w.dropout)


def _per_device_key(w, mesh_shape):
  """A LoRA kernel's dropout key folded with this device's index (every device masks its own rows differently)."""
  if not hasattr(w, "einsum") or w.key is None:
    return w
  index = 0
  for a, size in mesh_shape.items():
    index = index * size + jax.lax.axis_index(a)
  return type(w)(w.w, w.a, w.b, jax.random.fold_in(w.key, index), scale=w.scale, dropout=w.dropout)


def _on_d(w, gather: Callable, axis: int, d_child: str):
  """gather(w, axis) for a plain kernel; for a LoRA kernel W and its adapter child holding D (`d_child`) gathered."""
  if not hasattr(w, "einsum"):
    return gather(w, axis)
  a = gather(w.a, 1) if d_child == "a" else w.a
  b = gather(w.b, 2) if d_child == "b" else w.b
  return type(w)(gather(w.w, axis), a, b, w.key, scale=w.scale, dropout=w.dropout)


def _kernel_spec(w, spec):
  """shard_map's in_spec of an expert kernel [E, X, Y]: `spec`; a LoRA kernel's A [E, X, r] keeps spec's E and X
  axes, B [E, r, Y] its E and Y axes (the rank unsplit), its key replicated."""
  if not hasattr(w, "einsum"):
    return spec
  a, b = jax.sharding.PartitionSpec(spec[0], spec[1], None), jax.sharding.PartitionSpec(spec[0], None, spec[2])
  key = None if w.key is None else jax.sharding.PartitionSpec()
  return type(w)(spec, a, b, key, scale=w.scale, dropout=w.dropout)


def _flat(spec_entry) -> tuple[str, ...]:
  return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def dispatch(x_BLD, experts_BLK, weights_BLK, keep_BLK, gate_EDF, up_EDF, down_EFD, act, impl) -> jax.Array:
  """The routed experts' output [B, L, D] for the whole batch: `expert_ffn` without a mesh, else each device's
  tokens through `_exchange_ffn` under `jax.shard_map` (module docstring)."""
  gate_EDF, up_EDF, down_EFD = (_one_key(w) for w in (gate_EDF, up_EDF, down_EFD))
  if not axes.active():
    B, L, D = x_BLD.shape
    y_TD = expert_ffn(x_BLD.reshape(B * L, D), experts_BLK.reshape(B * L, -1), weights_BLK.reshape(B * L, -1),
                      keep_BLK.reshape(B * L, -1), gate_EDF, up_EDF, down_EFD, 0, act, impl)
    return y_TD.reshape(B, L, D)
  tok_spec = axes.spec((BATCH, LENGTH, None))
  w_spec, down_spec = axes.spec((EXPERTS, EMBED, MLP)), axes.spec((EXPERTS, MLP, EMBED))
  mesh_shape = jax.sharding.get_abstract_mesh().shape
  split = lambda entry: tuple(a for a in _flat(entry) if mesh_shape[a] > 1)  # a collective over 1 device copies
  ep_axes, d_axes, f_axes = _flat(w_spec[0]), split(w_spec[1]), split(w_spec[2])
  tok_axes = set(_flat(tok_spec[0])) | set(_flat(tok_spec[1]))
  a2a_axes = tuple(a for a in split(w_spec[0]) if a in tok_axes)  # tokens split: exchange
  sum_axes = tuple(a for a in split(w_spec[0]) if a not in tok_axes)  # tokens replicated: own experts, psum
  ragged = RAGGED_EXCHANGE.get(splash.target_platform(), False)
  gather = lambda w, axis: jax.lax.all_gather(w, d_axes, axis=axis, tiled=True)

  def local(x_BLD, experts_BLK, weights_BLK, keep_BLK, gate_EDF, up_EDF, down_EFD):
    B, L, D = x_BLD.shape
    gate_EDF, up_EDF, down_EFD = (_per_device_key(w, mesh_shape) for w in (gate_EDF, up_EDF, down_EFD))
    if d_axes:  # FSDP: whole rows of D for the matmuls (a LoRA kernel: W, and A or B, whichever holds D)
      gate_EDF, up_EDF = (_on_d(w, gather, 1, "a") for w in (gate_EDF, up_EDF))
      down_EFD = _on_d(down_EFD, gather, 2, "b")
    args = (x_BLD.reshape(B * L, D), *(a.reshape(B * L, -1) for a in (experts_BLK, weights_BLK, keep_BLK)),
            gate_EDF, up_EDF, down_EFD, act, impl)
    if a2a_axes:
      y_TD = _exchange_ffn(*args, ep_axes=ep_axes, a2a_axes=a2a_axes, ragged=ragged)
    else:
      first = jax.lax.axis_index(ep_axes) * gate_EDF.shape[0] if ep_axes else 0
      y_TD = expert_ffn(*args[:7], first, act, impl)
    if f_axes + sum_axes:  # tensor-split F: partial sums of the down projection; replicated tokens: expert groups
      y_TD = jax.lax.psum(y_TD, f_axes + sum_axes)
    return y_TD.reshape(B, L, D)

  x_BLD = axes.constrain(x_BLD, (BATCH, LENGTH, None))
  # check_vma=False: under the pipeline's vmap over stages (spmd_axis_name="stage") jax adds `stage` to the specs
  # but its varying-axes check still compares against the unbatched out_specs; the collectives are unchanged.
  w_specs = (_kernel_spec(gate_EDF, w_spec), _kernel_spec(up_EDF, w_spec), _kernel_spec(down_EFD, down_spec))
  return jax.shard_map(local, in_specs=(tok_spec, tok_spec, tok_spec, tok_spec, *w_specs),
                       out_specs=tok_spec, check_vma=False)(x_BLD, experts_BLK, weights_BLK, keep_BLK, gate_EDF, up_EDF,
                                                             down_EFD)
