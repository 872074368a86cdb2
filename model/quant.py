"""8-bit matmuls on `model.quant_layers`: int8 (`model.quant=int8`) and fp8 (`model.quant=fp8`).

int8: per-channel scales and straight-through gradients (AQT-style; Abdolrashidi et al. 2021, "Pareto-Optimal
Quantized ResNet Is Mostly 4-bit"; google/aqt).

Symmetric quantisation of an operand over its contracting axes c (one scale per remaining index: per token for
activations, per output channel for weights):

  s = max_c |x| / 127,   q = clip(round(x / s), -127, 127)  (int8),   x ~ s * q

and the product of an einsum over c: y = (sum_c q_x q_w) * s_x * s_w, with the sum in int32 (exact integer
arithmetic). Backward is straight-through: the gradients are those of the float einsum of the unquantised
operands. Error bound per output element: |y - x.w| <= sum_c (|w| s_x/2 + |x| s_w/2 + s_x s_w/4).

fp8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; NVIDIA Transformer Engine's HYBRID recipe with
current scaling): both forward operands in e4m3 (3 mantissa bits, max 448), the output gradient in e5m2 (2
mantissa bits, max 57344), each with one float32 scale per tensor computed from the tensor itself:

  s = 2^ceil(log2(max |x| / fmax)),   q = fp8(x / s)  (round to nearest even),   x ~ s * q

  forward   y  = (q_x . q_w) s_x s_w                 (float32 accumulation)
  backward  dx = (q_g . q_w^T) s_g s_w,   dw = (q_x^T . q_g) s_x s_g   (q_g = e5m2 of the cotangent)

Straight-through: the quantisers count as the identity in the backward pass; the two gradient matmuls use the
saved fp8 operands. Error per element of each rounded operand: |x^ - x| <= 2^-4 |x| + 2^-10 s (e4m3's unit
roundoff and half its subnormal spacing; e5m2: 2^-3 |x| + 2^-17 s).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from model import axes

QMAX = 127.0


def contracting_axes(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Axes of each einsum operand that do not appear in the output ("bld,dhk->blhk": ((2,), (0,)))."""
  inputs, out = spec.split("->")
  a, b = inputs.split(",")
  return tuple(i for i, c in enumerate(a) if c not in out), tuple(i for i, c in enumerate(b) if c not in out)


def quantize(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """(int8 q, float32 scale with the contracting `axes` kept as size 1): x ~ scale * q."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / QMAX
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel quantises to zeros at any scale
  return jnp.clip(jnp.round(x / scale), -QMAX, QMAX).astype(jnp.int8), scale


def int8_einsum_forward(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """The quantised product in float32: int32 accumulation of the int8 operands times both scales."""
  ax, aw = contracting_axes(spec)
  qx, sx = quantize(x, ax)
  qw, sw = quantize(w, aw)
  acc = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.int32)
  # The same einsum over the size-1 contracting axes lays the scale product out like the output.
  return acc.astype(jnp.float32) * jnp.einsum(spec, sx, sw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def int8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`jnp.einsum(spec, x, w)` through int8 (module docstring), result in x's dtype; straight-through backward."""
  return int8_einsum_forward(spec, x, w).astype(x.dtype)


def _fwd(spec, x, w):
  return int8_einsum(spec, x, w), (x, w)


def _bwd(spec, res, g):
  x, w = res
  _, vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(x.dtype), x, w)
  return vjp(g)


int8_einsum.defvjp(_fwd, _bwd)


# ---- fp8 ------------------------------------------------------------------------------------------------
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def quantize_fp8(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(fp8 q of x's shape, float32 scalar scale): current per-tensor scaling, x ~ scale * q (module docstring).

  The scale is the smallest power of two with max|x| / scale <= fmax, so dividing by it is exact and fp8's
  rounding is the only error (a power-of-two scale gives up less than one binade of fp8's range).
  """
  fmax = float(jnp.finfo(dtype).max)
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x))
  scale = jnp.exp2(jnp.ceil(jnp.log2(amax / fmax)))
  # log2 of a rounded ratio can land one power off: step to the smallest power of two that fits.
  scale = jnp.where(amax / scale > fmax, 2 * scale, scale)
  scale = jnp.where(amax / (scale / 2) <= fmax, scale / 2, scale)
  scale = jnp.where(amax > 0, scale, 1.0)  # an all-zero tensor quantises to zeros at any scale
  # fp8's cast turns anything above fmax into NaN (e4m3fn); the clip only guards that.
  return jnp.clip(x / scale, -fmax, fmax).astype(dtype), scale


def _fp8_dot(spec: str, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32) * scale


def _transposed_specs(spec: str) -> tuple[str, str]:
  """The einsums of the two gradients of `spec` = "x,w->y": ("y,w->x", "x,y->w")."""
  (a, b), out = spec.split("->")[0].split(","), spec.split("->")[1]
  return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """`jnp.einsum(spec, x, w)` through e4m3 operands (module docstring), result in x's dtype; the backward pass
  multiplies the e5m2 cotangent with the saved e4m3 operands (straight-through)."""
  return _fp8_fwd(spec, x, w)[0]


def _fp8_fwd(spec, x, w):
  qx, sx = quantize_fp8(x, E4M3)
  qw, sw = quantize_fp8(w, E4M3)
  # Residuals are the fp8 operands and their scales (a quarter of float32's activation memory); the empty
  # array carries w's dtype (dx has the output's, i.e. x's, dtype).
  return _fp8_dot(spec, qx, qw, sx * sw).astype(x.dtype), (qx, sx, qw, sw, jnp.zeros((0,), w.dtype))


def _fp8_bwd(spec, res, g):
  qx, sx, qw, sw, w_like = res
  qg, sg = quantize_fp8(g, E5M2)
  dx_spec, dw_spec = _transposed_specs(spec)
  return (_fp8_dot(dx_spec, qg, qw, sg * sw).astype(g.dtype),
          _fp8_dot(dw_spec, qx, qg, sx * sg).astype(w_like.dtype))


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)


def _contracted(spec: str) -> int:
  """How many axes `spec` contracts when it is a projection x [..., C...] @ w [C..., ...] (x's trailing axes
  contract with w's leading ones, in order; the output is x's free axes then w's), else 0."""
  inputs, out = spec.split("->")
  a, b = inputs.split(",")
  c = len(set(a) & set(b))
  if c == 0 or a[len(a) - c:] != b[:c] or out != a[:len(a) - c] + b[c:]:
    return 0
  return c


def project(spec: str, x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
  """`jnp.einsum(spec, x, w)`; for a CPU program, as one 2-D matmul [M, C] @ [C, N] when `spec` is a projection
  (`_contracted`).

  Same product. On XLA:CPU the backward pass then has plain 2-D matmuls too: it runs the weight gradient of
  "bld,df->blf" (a dot contracting two axes of a 3-D operand, after a transpose copy) ~2.5x slower than that of
  the flattened product (docs/throughput.md). On TPU the flattening costs: the forward and backward products then
  want the FSDP-gathered [D, H, K] kernels in two layouts, so XLA gathers the attention kernels twice and adds
  relayout copies (16B on v5e-256, docs/planning.md: 71 against 62 GB all-gathered per chip, 0.65 against 0.36 s
  of memory-bound kernels per step); there the einsum stays whole.
  """
  c = _contracted(spec)
  if not c or axes.platform() != "cpu":
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
  free_x, free_w = x.shape[:x.ndim - c], w.shape[c:]
  with jax.named_scope(spec):  # profiles and HLO metadata keep the einsum's name, as jnp.einsum's op does
    y = jnp.matmul(x.reshape(math.prod(free_x), -1), w.reshape(-1, math.prod(free_w)),
                   preferred_element_type=preferred_element_type)
  return y.reshape(*free_x, *free_w)


def einsum(spec: str, x: jax.Array, w: jax.Array, quant: str) -> jax.Array:
  """`jnp.einsum(spec, x, w)` (quant="none", as `project`) or its int8 / fp8 version (quant="int8" / "fp8"); a
  LoRA side-path kernel (model.lora.SideKernel) adds its adapters' product to the frozen kernel's."""
  if hasattr(w, "einsum"):  # a LoRA SideKernel: its base product comes back here with the plain array
    return w.einsum(spec, x, lambda s, x_, w_: einsum(s, x_, w_, quant))
  if quant == "int8":
    return int8_einsum(spec, x, w)
  if quant == "fp8":
    return fp8_einsum(spec, x, w)
  return project(spec, x, w)
