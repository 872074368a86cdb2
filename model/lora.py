"""LoRA adapters on the attention and MLP projections, as a transformation of the parameter tree.

For a projection kernel W with input dims I and output dims O (q/k/v: [D | H, K], o: [H, K | D], gate/up:
[D | F], down: [F | D]; a leading `layers` dim when layers are scanned), the adapted kernel is

    W' = W + (alpha / r) * A @ B,    A: [I..., r] (random normal, std 1/sqrt(prod I)),  B: [r, O...] (zeros)

so the adapted model equals the base model at initialisation (Hu et al. 2021, "LoRA", eq. 3; PEFT's layout with
lora_A = A^T, lora_B = B^T). `merge` builds W' for every adapted kernel; training differentiates through it with
respect to A and B only, so the base weights stay untouched and optimizer state exists only for the adapters.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

# target name -> (parent module in a Block, number of leading input dims of the kernel, kernel rank)
TARGETS = {"q": ("attn", 1, 3), "k": ("attn", 1, 3), "v": ("attn", 1, 3), "o": ("attn", 2, 3),
           "gate": ("mlp", 1, 2), "up": ("mlp", 1, 2), "down": ("mlp", 1, 2)}


def check_targets(targets: Sequence[str]) -> tuple[str, ...]:
  """Validated target names (ValueError naming train.lora_targets)."""
  targets = tuple(targets)
  bad = [t for t in targets if t not in TARGETS]
  if bad or not targets:
    raise ValueError(f"train.lora_targets={targets!r}: each must be one of {', '.join(TARGETS)} (at least one)")
  return targets


def _walk(tree: dict, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _walk(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def kernels(model_params: dict, targets: Sequence[str]) -> dict[tuple, tuple[Any, int, int]]:
  """path -> (kernel leaf, lead dims, input dims) for every kernel adapted by `targets` (layers: scanned or not)."""
  out = {}
  for path, leaf in _walk(model_params):
    if len(path) >= 2 and path[-1] in targets and path[-2] == TARGETS[path[-1]][0]:
      _, n_in, rank = TARGETS[path[-1]]
      out[path] = (leaf, len(leaf.shape) - rank, n_in)
  return out


def _set(tree: dict, path: tuple, value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def init(key: jax.Array, model_params: dict, targets: Sequence[str], rank: int, dtype=jnp.float32) -> dict:
  """Adapters {path...: {"a": [lead, I..., r], "b": [lead, r, O...]}} for the kernels of `model_params`
  (arrays or ShapeDtypeStructs); B = 0 so the adapted model starts equal to the base."""
  adapters = {}
  for i, (path, (leaf, lead, n_in)) in enumerate(sorted(kernels(model_params, targets).items(), key=str)):
    shape = tuple(leaf.shape)
    ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
    a = jax.random.normal(jax.random.fold_in(key, i), shape[:lead] + ins + (rank,), dtype)
    a = a / math.sqrt(math.prod(ins))
    _set(adapters, path, {"a": a, "b": jnp.zeros(shape[:lead] + (rank,) + outs, dtype)})
  return adapters


def specs(kernel_specs: dict, model_params: dict, targets: Sequence[str]) -> dict:
  """PartitionSpecs of the adapters from their kernels' specs: A keeps the input dims' axes, B the output's."""
  from jax.sharding import PartitionSpec  # pylint: disable=g-import-not-at-top
  out = {}
  for path, (leaf, lead, n_in) in kernels(model_params, targets).items():
    spec = tuple(_get(kernel_specs, path)) + (None,) * len(leaf.shape)
    spec = spec[:len(leaf.shape)]
    _set(out, path, {"a": PartitionSpec(*spec[:lead + n_in], None),
                     "b": PartitionSpec(*spec[:lead], None, *spec[lead + n_in:])})
  return out


def delta(a: jax.Array, b: jax.Array, lead: int, scale: float) -> jax.Array:
  """scale * A @ B with the rank contracted: [lead, I..., r] x [lead, r, O...] -> [lead, I..., O...]."""
  ins, outs = a.shape[lead:-1], b.shape[lead + 1:]
  a3 = a.reshape(a.shape[:lead] + (math.prod(ins), a.shape[-1]))
  b3 = b.reshape(b.shape[:lead + 1] + (math.prod(outs),))
  d = jnp.matmul(a3, b3, preferred_element_type=jnp.float32)
  return (scale * d).reshape(a.shape[:lead] + ins + outs)


def merge(model_params: dict, adapters: dict, scale: float) -> dict:
  """The model parameters with every adapted kernel replaced by W + scale * A @ B (a new tree; inputs unchanged)."""
  merged = jax.tree.map(lambda x: x, model_params)
  for path, ab in _walk_adapters(adapters):
    w = _get(model_params, path)
    lead = ab["a"].ndim - TARGETS[path[-1]][1] - 1
    _set(merged, path, (w + delta(ab["a"], ab["b"], lead, scale)).astype(w.dtype))
  return merged


def _walk_adapters(adapters: dict, prefix=()):
  for k, v in adapters.items():
    if isinstance(v, dict) and set(v) == {"a", "b"}:
      yield prefix + (k,), v
    elif isinstance(v, dict):
      yield from _walk_adapters(v, prefix + (k,))
