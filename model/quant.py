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


def einsum(spec: str, x: jax.Array, w: jax.Array, quant: str) -> jax.Array:
  """`jnp.einsum(spec, x, w)` (quant="none") or its int8 version (quant="int8")."""
  if quant == "int8":
    return int8_einsum(spec, x, w)
  return jnp.einsum(spec, x, w)
