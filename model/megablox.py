"""Megablox grouped matmuls (`model.moe_impl=megablox`): the Pallas TPU kernels of
`jax.experimental.pallas.ops.tpu.megablox` behind the grouped-matmul signature of model/moe.py.

Shapes: A rows (token-expert assignments sorted by expert), X contraction width, Y output width, E groups (the
local experts); Ap, Xp, Yp the same padded to whole tiles.

- The package's `gmm` is a custom VJP: the backward is a transposed `gmm` for the rows' gradient and `tgmm` (the
  per-group lhs^T @ grad) for the weights' gradient, both Pallas kernels; nothing here differentiates a kernel.
- The kernel multiplies only the tiles its groups cover: rows past sum(group sizes) (assignments of other devices'
  experts, dropped ones) cost nothing, which is what makes expert parallelism's masked rows free on TPUs. The
  kernel leaves those rows unwritten (undefined memory on a TPU), so they are zeroed on the way in and on the way
  out; `jnp.where` in both places also zeroes their gradients, so no undefined value reaches a sum.
- Tiles (tm, tk, tn): `model.megablox_tile_{m,k,n}` are upper bounds in multiples of 128 (the TPU's lane width).
  The widths X and Y are padded with zeros to a multiple of 128; tk and tn are the largest multiples of 128 within
  their bounds that divide both padded widths, because the backward's transposed product tiles X with tn and Y
  with tk. The rows are padded to a multiple of tm (tm = the bound, or the rows rounded up to 128 when fewer):
  padded rows lie past every group, so they are memory, not work. Test shapes (widths of 16 or 32) are thus
  padded to 128: the same path as on a TPU, slow only in memory.
- `interpret=True` (`model.pallas_interpret`) runs the kernels in Pallas interpret mode on any backend (slow: for
  tests on the CPU); without it the kernels compile only for TPUs and `check_platform` refuses others at trace
  time, before anything compiles.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import megablox as megablox_ops

from model.config import MEGABLOX_GRANULE
from model.splash import target_platform


@dataclasses.dataclass(frozen=True)
class MegabloxOptions:
  """Static settings of the megablox kernels (hashable: an attribute of the nnx MoE module). Tile bounds in rows
  (m) and columns (k: contraction, n: output), multiples of MEGABLOX_GRANULE."""
  tile_m: int = 512
  tile_k: int = 1024
  tile_n: int = 1024
  interpret: bool = False


def options(cfg) -> MegabloxOptions:
  """The MegabloxOptions of a validated model config (`model.megablox_tile_*`, `model.pallas_interpret`)."""
  return MegabloxOptions(cfg.megablox_tile_m, cfg.megablox_tile_k, cfg.megablox_tile_n, cfg.pallas_interpret)


def check_platform(interpret: bool, platform: str | None = None) -> None:
  """ValueError naming model.moe_impl unless the megablox kernels can run: TPU devices, or interpret mode."""
  platform = target_platform() if platform is None else platform
  if not interpret and platform != "tpu":
    raise ValueError(f"model.moe_impl='megablox' runs Pallas TPU kernels, which do not compile for {platform} "
                     "devices; on CPU use model.pallas_interpret=true (interpret mode: slow, for tests) or "
                     "model.moe_impl=ragged")


def _round_up(n: int, unit: int) -> int:
  return -(-n // unit) * unit


def _dividing_tile(width: int, bound: int) -> int:
  """The largest multiple of the granule <= max(bound, granule) that divides `width` (itself a granule multiple)."""
  units = width // MEGABLOX_GRANULE
  best = max(d for d in range(1, max(bound // MEGABLOX_GRANULE, 1) + 1) if units % d == 0)
  return best * MEGABLOX_GRANULE


def tiling(opts: MegabloxOptions, rows: int, x: int, y: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
  """((tm, tk, tn), (Ap, Xp, Yp)) for `rows` x `x` rows against [E, x, y] weights: the tiles the kernels get and
  the padded shapes they divide (module docstring)."""
  xp, yp = _round_up(x, MEGABLOX_GRANULE), _round_up(y, MEGABLOX_GRANULE)
  common = math.gcd(xp, yp)
  tk, tn = _dividing_tile(common, opts.tile_k), _dividing_tile(common, opts.tile_n)
  tm = min(opts.tile_m, _round_up(rows, MEGABLOX_GRANULE))
  return (tm, tk, tn), (_round_up(rows, tm), xp, yp)


def gmm(a_AX: jax.Array, w_EXY: jax.Array, sizes_E: jax.Array, opts: MegabloxOptions) -> jax.Array:
  """Grouped matmul -> y_AY in a's dtype: rows start(e) .. start(e) + sizes_E[e] - 1 times w_EXY[e], groups in
  order from row 0 (`jax.lax.ragged_dot`'s contract); rows past sum(sizes_E) are 0, with zero gradients.

  Differentiable (the package's custom VJP: Pallas kernels forward and backward). Refuses (ValueError naming
  model.moe_impl) off TPU unless `opts.interpret`.
  """
  check_platform(opts.interpret)
  A, X = a_AX.shape
  Y = w_EXY.shape[-1]
  (tm, tk, tn), (Ap, Xp, Yp) = tiling(opts, A, X, Y)
  sizes_E = sizes_E.astype(jnp.int32)
  grouped_A = jnp.arange(A) < jnp.sum(sizes_E)
  a_AX = jnp.where(grouped_A[:, None], a_AX, jnp.zeros((), a_AX.dtype))
  if (Ap, Xp) != (A, X):
    a_AX = jnp.pad(a_AX, ((0, Ap - A), (0, Xp - X)))
  if (Xp, Yp) != (X, Y):
    w_EXY = jnp.pad(w_EXY, ((0, 0), (0, Xp - X), (0, Yp - Y)))
  # The custom VJP takes its non-differentiable arguments by position: preferred type, tiling, group offset,
  # existing output, transpose_rhs, interpret.
  y_AY = megablox_ops.gmm(a_AX, w_EXY, sizes_E, a_AX.dtype, (tm, tk, tn), None, None, False, opts.interpret)
  y_AY = y_AY[:A, :Y]
  return jnp.where(grouped_A[:, None], y_AY, jnp.zeros((), y_AY.dtype))


def kernel_cost(kind: str, lhs_shape, rhs_shape, out_shape, itemsize: int) -> tuple[float, float] | None:
  """(FLOPs, HBM bytes) of one call of a megablox kernel, None for shapes that are not one. `kind` gmm: lhs [M, X]
  (rows sorted by expert), rhs [E, X, Y] (this call's experts) -> [M, Y]; tgmm (the weights' gradient): lhs
  [M, X], rhs [M, Y] -> [E, X, Y]; the rows' gradient is a gmm with rhs transposed ([E, Y, X], told apart by the
  result's width). FLOPs 2·M·X·Y: every row belongs to one group, and rows past the last group
  (other devices' experts under expert parallelism, padding) are an upper bound, since group sizes are values the
  program learns at run time. Bytes: operands and result once (the tiles stream each of them through VMEM once)."""
  gmm = kind == "gmm" and len(lhs_shape) == 2 and len(rhs_shape) == 3 and len(out_shape) == 2
  if gmm and lhs_shape[1] == rhs_shape[1] and out_shape[1] == rhs_shape[2]:
    (m, x), y = lhs_shape, rhs_shape[2]
  elif gmm and lhs_shape[1] == rhs_shape[2] and out_shape[1] == rhs_shape[1]:  # transpose_rhs
    (m, x), y = lhs_shape, rhs_shape[1]
  elif kind == "tgmm" and len(lhs_shape) == 2 and len(rhs_shape) == 2 and lhs_shape[0] == rhs_shape[0]:
    (m, x), y = lhs_shape, rhs_shape[1]
  else:
    return None
  sizes = (math.prod(lhs_shape), math.prod(rhs_shape), math.prod(out_shape))
  return float(2 * m * x * y), float(sum(sizes) * itemsize)
