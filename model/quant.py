"""int8 matmuls with per-channel scales and straight-through gradients (AQT-style; Abdolrashidi et al. 2021,
"Pareto-Optimal Quantized ResNet Is Mostly 4-bit"; google/aqt), `model.quant=int8` on `model.quant_layers`.

Symmetric quantisation of an operand over its contracting axes c (one scale per remaining index: per token for
activations, per output channel for weights):

  s = max_c |x| / 127,   q = clip(round(x / s), -127, 127)  (int8),   x ~ s * q

and the product of an einsum over c: y = (sum_c q_x q_w) * s_x * s_w, with the sum in int32 (exact integer
arithmetic). Backward is straight-through: the gradients are those of the float einsum of the unquantised
operands. Error bound per output element: |y - x.w| <= sum_c (|w| s_x/2 + |x| s_w/2 + s_x s_w/4).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

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
  """`jnp.einsum(spec, x, w)`, as one 2-D matmul [M, C] @ [C, N] when `spec` is a projection (`_contracted`).

  Same product; the backward pass then has plain 2-D matmuls too. XLA:CPU runs the weight gradient of
  "bld,df->blf" (a dot contracting two axes of a 3-D operand, after a transpose copy) ~2.5x slower than that of
  the flattened product (docs/throughput.md).
  """
  c = _contracted(spec)
  if not c:
    return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
  free_x, free_w = x.shape[:x.ndim - c], w.shape[c:]
  y = jnp.matmul(x.reshape(math.prod(free_x), -1), w.reshape(-1, math.prod(free_w)),
                 preferred_element_type=preferred_element_type)
  return y.reshape(*free_x, *free_w)


def einsum(spec: str, x: jax.Array, w: jax.Array, quant: str) -> jax.Array:
  """`jnp.einsum(spec, x, w)` (quant="none", as `project`) or its int8 version (quant="int8")."""
  if quant == "int8":
    return int8_einsum(spec, x, w)
  return project(spec, x, w)
