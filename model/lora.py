"""LoRA adapters on the attention and MLP projections, as a transformation of the parameter tree.

For a projection kernel W with input dims I and output dims O (q/k/v: [D | H, K], o: [H, K | D], gate/up:
[D | F], down: [F | D]; a leading `layers` dim when layers are scanned), the adapted kernel is

    W' = W + (alpha / r) * A @ B,    A: [I..., r] (random normal, std 1/sqrt(prod I)),  B: [r, O...] (zeros)

so the adapted model equals the base model at initialisation (Hu et al. 2021, "LoRA", eq. 3; PEFT's layout with
lora_A = A^T, lora_B = B^T). scale = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023, "A Rank
Stabilization Scaling Factor for Fine-Tuning with LoRA"; PEFT's use_rslora).

Training runs the side path (`side`): every adapted kernel becomes a `SideKernel` and its projection computes

    y = x W + scale * (dropout(x) A) B          (PEFT's order: dropout on the adapter's input only)

with W behind stop_gradient, so the backward pass forms dx through W but never a cotangent of W's size: the
step's memory holds W once (frozen, possibly quantized: model/basequant.py) and gradients and optimizer state
of A and B only. `merge` builds W' (export, generation: merged once at load, then plain projections).
"""
from __future__ import annotations

import math
import string
from typing import Any, Sequence

import jax
import jax.numpy as jnp

# target name -> (parent modules in a Block, number of leading input dims of the kernel, kernel rank). The MLP
# targets adapt dense MLPs, an MoE layer's shared experts and its routed experts (one A, B pair per expert: the
# experts dim leads like a scanned layers dim).
TARGETS = {"q": (("attn",), 1, 3), "k": (("attn",), 1, 3), "v": (("attn",), 1, 3), "o": (("attn",), 2, 3),
           "gate": (("mlp", "shared", "moe"), 1, 2), "up": (("mlp", "shared", "moe"), 1, 2),
           "down": (("mlp", "shared", "moe"), 1, 2)}


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
    if len(path) >= 2 and path[-1] in targets and path[-2] in TARGETS[path[-1]][0]:
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


def scale(alpha: float, rank: int, rslora: bool = False) -> float:
  """The adapter's multiplier: alpha / r, or alpha / sqrt(r) under rsLoRA."""
  return float(alpha) / (math.sqrt(rank) if rslora else rank)


@jax.tree_util.register_pytree_node_class
class SideKernel:
  """A frozen kernel W (an array or a basequant.QuantizedKernel) with its adapters A [I..., r], B [r, O...] (a
  leading lead dims on each child when layers are scanned), applied as a side path by `einsum`.

  key: raw uint32 PRNG key data [lead..., 2] for lora_dropout (None: no dropout, e.g. evaluation). Reading it as a
  parameter (`param[...]`, `.astype(dtype)`) keeps the structure, so layer code passes it to the einsum unchanged.
  """

  def __init__(self, w, a, b, key=None, *, scale: float, dropout: float = 0.0):
    self.w, self.a, self.b, self.key = w, a, b, key
    self.scale, self.dropout = scale, dropout

  def tree_flatten(self):
    return (self.w, self.a, self.b, self.key), (self.scale, self.dropout)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, scale=aux[0], dropout=aux[1])

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError(f"a LoRA side-path kernel reads whole ([...]), not [{index!r}]")
    return self

  @property
  def shape(self):
    return self.w.shape

  @property
  def ndim(self):
    return len(self.w.shape)

  def astype(self, dtype) -> "SideKernel":
    """W, A and B in `dtype` (a quantized W is dequantized here, inside the layer that uses it)."""
    return SideKernel(self.w.astype(dtype), self.a.astype(dtype), self.b.astype(dtype), self.key,
                      scale=self.scale, dropout=self.dropout)

  def drop(self, x: jax.Array) -> jax.Array:
    """The adapter's input: x with lora_dropout applied (kept entries scaled by 1 / (1 - p)); x without a key."""
    if not self.dropout or self.key is None:
      return x
    keep = jax.random.bernoulli(self.key, 1.0 - self.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

  def einsum(self, spec: str, x: jax.Array, base_einsum) -> jax.Array:
    """base_einsum(spec, x, stop_gradient(W)) + scale * (dropout(x) A) B for a projection `spec` such as
    "bld,dhk->blhk" (W's contracted letters first, as every adapted kernel is laid out)."""
    from model import quant as quant_lib  # pylint: disable=g-import-not-at-top
    y = base_einsum(spec, x, jax.lax.stop_gradient(self.w))
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    contracted = "".join(c for c in ws if c not in out)
    outs = ws[len(contracted):]
    r = next(c for c in string.ascii_letters if c not in spec)
    x = self.drop(x)
    free = "".join(c for c in xs if c not in contracted)
    h = quant_lib.project(f"{xs},{contracted}{r}->{free}{r}", x, self.a)
    side = quant_lib.project(f"{free}{r},{r}{outs}->{out}", h, self.b)
    return y + (self.scale * side).astype(y.dtype)


def side(model_params: dict, adapters: dict, scale_: float, dropout: float = 0.0, key: jax.Array | None = None) -> dict:
  """The model parameters with every adapted kernel replaced by a SideKernel (a new tree; inputs unchanged).

  key: a PRNG key for lora_dropout (each kernel, and each scanned layer of it, draws its own masks); None = no
  dropout."""
  tree = jax.tree.map(lambda x: x, model_params)
  for i, (path, ab) in enumerate(sorted(_walk_adapters(adapters), key=lambda item: str(item[0]))):
    w = _get(model_params, path)
    lead = ab["a"].ndim - TARGETS[path[-1]][1] - 1
    keys = None
    if dropout and key is not None:
      lead_shape = ab["a"].shape[:lead]
      keys = jax.random.key_data(jax.random.split(jax.random.fold_in(key, i), math.prod(lead_shape)))
      keys = keys.reshape(lead_shape + keys.shape[-1:])
    _set(tree, path, SideKernel(w, ab["a"], ab["b"], keys, scale=scale_, dropout=dropout))
  return tree


def counts(cfg_model, targets: Sequence[str], rank: int) -> dict[str, int]:
  """{"adapters": parameters of the LoRA adapters on `targets` at `rank`, "base_kernels": parameters of every
  projection kernel (what QLoRA quantizes)} of a model config, from its abstract parameter tree."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import config as config_lib  # pylint: disable=g-import-not-at-top
  from model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  cfg = config_lib.validate(cfg_model)
  tree = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param))
  adapters = sum(math.prod(leaf.shape[:lead]) * rank * (math.prod(leaf.shape[lead:lead + n_in])
                                                       + math.prod(leaf.shape[lead + n_in:]))
                 for leaf, lead, n_in in kernels(tree, targets).values())
  base = sum(math.prod(leaf.shape) for leaf, _, _ in kernels(tree, tuple(TARGETS)).values())
  return {"adapters": int(adapters), "base_kernels": int(base)}
