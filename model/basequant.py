"""Frozen base weights for QLoRA stored in int8 or NF4 and dequantized in the compute dtype inside the matmul.

A projection kernel has shape lead + ins + outs: `lead` leading dims (scanned layers, experts), `n_in` input
(contracting) dims, then the output dims (q [D | H, K], o [H, K | D], scanned up [N | D | F], experts
[N, E | D | F]). Arithmetic is float32; `dequantize(dtype)` casts at the end.

int8 (symmetric, one scale per lead + output index, over the input dims; as `model.quant`):

  s = max_ins |w| * fl(1/127)   (1 for an all-zero channel),   q = clip(round(w / s), -127, 127),   w^ = s q
  |w - w^| <= s / 2                                   (fl(1/n): n's float32 reciprocal, see _RECIP_QMAX)

NF4 (Dettmers et al. 2023, "QLoRA", section 3; bitsandbytes' blockwise 4-bit quantization). The input dims
are flattened row-major to I = prod(ins) (for [H, K]: H-major) and split into blocks of `block` consecutive
inputs per output channel, which are bitsandbytes' blocks of `block` consecutive elements of the PyTorch
[out, in] weight. Per block b:

  c_b = max_b |w|,   x = w / c_b in [-1, 1]   (x = 0 when c_b = 0; bitsandbytes' x = w * (1/c_b) can differ
                                                in the last ulp),
  code = argmin_j |x - NF4_LEVELS[j]|   (the nearest level; an exact tie takes the lower index, as
                                          bitsandbytes' `x > midpoint` decision tree does),
  w^ = NF4_LEVELS[code] * c_b,          |w - w^| <= c_b * max_j (L[j+1] - L[j]) / 2 = 0.1385 c_b

The 16 levels are the quantiles of N(0, 1) normalised to [-1, 1] with an exact zero (`create_normal_map` in
bitsandbytes: 8 positive quantiles at linspace(0.9677083, 0.5, 9)[:-1], 7 negative at linspace(.., 8)[:-1]).
Two codes per byte: the even element of each pair in the high nibble, the odd one in the low nibble
(bitsandbytes' order, so the stored bytes are a transposition of bitsandbytes' for the same weight).

Storage (children keep the lead dims first so that a lax.scan over layers slices every child):

  codes   uint8   [lead, I/block, block/2, outs]    (the blocks axis sits where the first input dim was, so
  absmax  float32 [lead, I/block, outs]              it can be split over that dim's mesh axes)

Double quantization (QLoRA section 3, "Double Quantization"): the absmax constants c are quantized once
more to 8-bit floats (float8_e4m3fn, max 448). With m the mean of c over one kernel (one mean per lead
index: per layer / expert; bitsandbytes takes one per tensor, the same when lead = 0), in blocks of
`double_block` consecutive constants along the last axis of `absmax` (one block over that axis when it does
not divide by `double_block`):

  s2 = max_blk |c - m| * fl(1/448)   (1 if all zero),   c8 = e4m3((c - m) / s2),   c^ = c8 s2 + m
  |c - c^| <= 2^-4 |c - m| + 2^-10 s2   (e4m3's unit roundoff and half its subnormal spacing)

  absmax_fp8   float8_e4m3fn [lead, I/block, outs],   absmax_scale float32 [lead, I/block, outs[:-1], n2],
  absmax_mean  float32 [lead]

Bytes per weight: int8 1 + 4/I; NF4 0.5 + 4/block (0.5625 at 64); with double quantization
0.5 + 1/block + 4/(block * double_block) (0.5159 at 64, 256). bitsandbytes quantizes the constants with its
8-bit dynamic map rather than e4m3; the paper describes 8-bit floats, which this follows.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("none", "int8", "nf4")
QMAX = 127.0
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
# Scales are amax times the float32 reciprocal, written out: XLA rewrites a division by a constant into this
# product on some backends and not others, and quantizing on the host or the accelerator must give the same bytes.
_RECIP_QMAX, _RECIP_FP8_MAX = np.float32(1 / QMAX), np.float32(1 / FP8_MAX)

NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
    1.0], dtype=np.float32)


def _upper_thresholds(levels: np.ndarray) -> np.ndarray:
  """For each pair of adjacent levels, the smallest float32 strictly above their exact midpoint: a float32 x
  is nearer the upper level iff x >= it, so the count of thresholds <= x is the nearest index (ties lower)."""
  mid = (levels[:-1].astype(np.float64) + levels[1:].astype(np.float64)) / 2  # exact: sums of float32
  t = mid.astype(np.float32)
  return np.where(t.astype(np.float64) > mid, t, np.nextafter(t, np.float32(np.inf))).astype(np.float32)


NF4_THRESHOLDS = _upper_thresholds(NF4_LEVELS)


@jax.tree_util.register_pytree_node_class
class QuantizedKernel:
  """A quantized kernel: array children (see the module docstring) and static shape information that stays
  valid when a scan slices the lead dims off (the lead dims are read from the children's rank).

  kind: "int8" or "nf4"; ins / outs: the input and output dims; dtype: the float dtype that was quantized;
  block: NF4 block size (0 for int8); double_block: the effective double-quantization block along the last
  absmax axis (0 without double quantization).
  """

  def __init__(self, kind: str, children: tuple, ins: tuple, outs: tuple, dtype: Any, block: int = 0,
               double_block: int = 0):
    self.children = tuple(children)
    self.kind, self.ins, self.outs = kind, tuple(ins), tuple(outs)
    self.block, self.double_block, self.dtype = block, double_block, np.dtype(dtype)

  def tree_flatten(self):
    return self.children, (self.kind, self.ins, self.outs, self.dtype, self.block, self.double_block)

  @classmethod
  def tree_unflatten(cls, aux, children):
    kind, ins, outs, dtype, block, double_block = aux
    return cls(kind, children, ins, outs, dtype, block, double_block)

  @property
  def lead(self) -> int:
    """Number of leading (layer / expert) dims, from the first child's rank."""
    per_kernel = len(self.ins) if self.kind == "int8" else 2
    return len(self.children[0].shape) - per_kernel - len(self.outs)

  @property
  def shape(self) -> tuple[int, ...]:
    """lead + ins + outs: the shape of the float kernel."""
    return tuple(self.children[0].shape[:self.lead]) + self.ins + self.outs

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> int:
    """Stored bytes of all children (works on abstract children from jax.eval_shape too)."""
    return sum(math.prod(c.shape) * np.dtype(c.dtype).itemsize for c in self.children)

  @property
  def absmax(self) -> jax.Array:
    """NF4's per-block constants, float32 [lead, I/block, outs] (dequantized when double-quantized)."""
    if self.kind != "nf4":
      raise AttributeError(f"absmax: a {self.kind} kernel has per-channel scales, not NF4 block constants")
    if not self.double_block:
      return self.children[1]
    return _double_dequantize(*self.children[1:], self.lead, self.double_block)

  def dequantize(self, dtype=None) -> jax.Array:
    """The kernel, lead + ins + outs, in `dtype` (default: the dtype that was quantized); float32 arithmetic."""
    dtype = self.dtype if dtype is None else dtype
    lead_shape = tuple(self.children[0].shape[:self.lead])
    if self.kind == "int8":
      q, scale = self.children
      w = q.astype(jnp.float32) * scale.reshape(lead_shape + (1,) * len(self.ins) + self.outs)
    else:
      x = _nf4_values(_unpack(self.children[0], self.lead + 1))
      w = x * jnp.expand_dims(self.absmax, self.lead + 1)
    return w.reshape(lead_shape + self.ins + self.outs).astype(dtype)

  def astype(self, dtype) -> jax.Array:
    return self.dequantize(dtype)

  def __getitem__(self, key):
    """`self` for `...` (so `param[...].astype(dt)` dequantizes); an int or slice indexes the first lead dim."""
    if key is Ellipsis or (isinstance(key, tuple) and len(key) == 1 and key[0] is Ellipsis):
      return self
    if not isinstance(key, (int, slice)) or self.lead == 0:
      raise TypeError(f"QuantizedKernel[{key!r}]: only `...` or an int / slice over a lead dim (lead={self.lead})")
    return jax.tree.map(lambda c: c[key], self)

  def __repr__(self):
    extra = f", block={self.block}" if self.block else ""
    extra += f", double_block={self.double_block}" if self.double_block else ""
    return f"QuantizedKernel({self.kind}, ins={self.ins}, outs={self.outs}, dtype={self.dtype.name}{extra})"


def _split(shape: tuple, lead: int, n_in: int) -> tuple[tuple, tuple, tuple]:
  if lead < 0 or n_in < 1 or lead + n_in >= len(shape):
    raise ValueError(f"kernel shape {shape}: lead={lead}, n_in={n_in} leave no input or no output dim")
  return tuple(shape[:lead]), tuple(shape[lead:lead + n_in]), tuple(shape[lead + n_in:])


def _nf4_codes(x: jax.Array) -> jax.Array:
  """Index of the nearest NF4 level of each x in [-1, 1] (ties: the lower index), uint8 of x's shape."""
  code = jnp.zeros(x.shape, jnp.uint8)
  for t in NF4_THRESHOLDS:  # 15 compares fuse into one elementwise pass (no [..., 16] distance array)
    code = code + (x >= t).astype(jnp.uint8)
  return code


def _nf4_values(codes: jax.Array) -> jax.Array:
  """NF4_LEVELS[codes] in float32, as a chain of selects: elementwise, so it fuses with the unpacking and the
  scaling and keeps the codes' sharding (a gather from the table has no unambiguous output sharding)."""
  x = jnp.full(codes.shape, NF4_LEVELS[0], jnp.float32)
  for j in range(1, len(NF4_LEVELS)):
    x = jnp.where(codes >= j, NF4_LEVELS[j], x)
  return x


def _pack(codes: jax.Array, axis: int) -> jax.Array:
  """Pairs of 4-bit codes along `axis` into bytes: even element in the high nibble, odd in the low."""
  n = codes.shape[axis]
  pairs = codes.reshape(codes.shape[:axis] + (n // 2, 2) + codes.shape[axis + 1:])
  hi, lo = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
  return (hi << 4) | lo


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
  """Inverse of `_pack`: [..., n/2 (axis), ...] bytes -> [..., n (axis), ...] codes."""
  pairs = jnp.stack([packed >> 4, packed & 0xF], axis=axis + 1)
  return pairs.reshape(packed.shape[:axis] + (2 * packed.shape[axis],) + packed.shape[axis + 1:])


def _quantize_int8(w: jax.Array, lead: int, ins: tuple) -> tuple:
  """(int8 q of w's shape, float32 scale [lead, outs]) over the input dims."""
  in_axes = tuple(range(lead, lead + len(ins)))
  scale = jnp.max(jnp.abs(w), axis=in_axes)
  scale = jnp.where(scale > 0, scale * _RECIP_QMAX, 1.0)  # an all-zero channel quantises to zeros at any scale
  q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, in_axes)), -QMAX, QMAX).astype(jnp.int8)
  return q, scale


def _quantize_nf4(w: jax.Array, lead: int, ins: tuple, outs: tuple, block: int) -> tuple:
  """(uint8 packed codes [lead, I/block, block/2, outs], float32 absmax [lead, I/block, outs])."""
  fan_in = math.prod(ins)
  if block <= 0 or block % 2 or fan_in % block:
    raise ValueError(f"NF4 block={block}: must be a positive even divisor of the input size {fan_in} "
                     f"(kernel shape {w.shape}, input dims {ins})")
  wb = w.reshape(w.shape[:lead] + (fan_in // block, block) + outs)
  absmax = jnp.max(jnp.abs(wb), axis=lead + 1)
  x = wb / jnp.expand_dims(jnp.where(absmax > 0, absmax, 1.0), lead + 1)
  return _pack(_nf4_codes(x), lead + 1), absmax


def _double_quantize(absmax: jax.Array, lead: int, double_block: int) -> tuple[tuple, int]:
  """((e4m3 constants, float32 block scales, float32 per-lead mean), effective block) of the absmax array."""
  n = absmax.shape[-1]
  b2 = double_block if n % double_block == 0 else n
  mean = jnp.mean(absmax, axis=tuple(range(lead, absmax.ndim)))
  centred = absmax - mean.reshape(mean.shape + (1,) * (absmax.ndim - lead))
  g = centred.reshape(absmax.shape[:-1] + (n // b2, b2))
  scale = jnp.max(jnp.abs(g), axis=-1)
  scale = jnp.where(scale > 0, scale * _RECIP_FP8_MAX, 1.0)
  # e4m3fn casts anything above 448 to NaN; the clip only guards float32 rounding of the ratio.
  q = jnp.clip(g / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
  return (q.reshape(absmax.shape), scale, mean), b2


def _double_dequantize(q: jax.Array, scale: jax.Array, mean: jax.Array, lead: int, b2: int) -> jax.Array:
  """c^ = c8 s2 + m, float32 of q's shape."""
  n = q.shape[-1]
  g = q.astype(jnp.float32).reshape(q.shape[:-1] + (n // b2, b2)) * scale[..., None]
  return g.reshape(q.shape) + mean.reshape(mean.shape + (1,) * (q.ndim - lead))


def quantize(w: jax.Array, lead: int, n_in: int, kind: str, block: int = 64, double: bool = False,
             double_block: int = 256):
  """w [lead..., ins..., outs...] as a QuantizedKernel of `kind` (module docstring); kind "none" returns w.

  Pure jnp: jit it with lead, n_in, kind, block, double, double_block static. ValueError on an unknown kind,
  a block that is not a positive even divisor of prod(ins), or a non-positive double_block.
  """
  if kind not in KINDS:
    raise ValueError(f"base quantization kind={kind!r}: must be one of {', '.join(KINDS)}")
  if kind == "none":
    return w
  _, ins, outs = _split(tuple(w.shape), lead, n_in)
  w32 = jnp.asarray(w).astype(jnp.float32)
  if kind == "int8":
    return QuantizedKernel(kind, _quantize_int8(w32, lead, ins), ins, outs, w.dtype)
  codes, absmax = _quantize_nf4(w32, lead, ins, outs, block)
  if not double:
    return QuantizedKernel(kind, (codes, absmax), ins, outs, w.dtype, block)
  if double_block <= 0:
    raise ValueError(f"double_block={double_block}: must be positive")
  dq, b2 = _double_quantize(absmax, lead, double_block)
  return QuantizedKernel(kind, (codes,) + dq, ins, outs, w.dtype, block, b2)


def specs(kernel_spec, qk, lead: int, n_in: int):
  """PartitionSpecs of `qk`'s children (a QuantizedKernel of PartitionSpecs) from the float kernel's spec.

  int8: q keeps the kernel's spec, the scale [lead, outs] the lead and output axes. NF4: the blocks axis takes
  the first input dim's mesh axes (the other input dims are replicated; the shards line up with the kernel's
  when the first input dim's shard holds a whole number of blocks), the within-block axis is unsharded, output
  dims keep theirs. Double quantization: the e4m3 constants as absmax, the block scales the same but with the
  double-block axis replicated, the mean the lead axes. `qk` may be abstract (jax.eval_shape); a plain kernel
  (kind "none") gets `kernel_spec` back. Meant for meshlm's Auto-axis meshes: with Explicit axes, dequantize's
  reshapes of sharded dims need out_sharding arguments this module does not give.
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  if not isinstance(qk, QuantizedKernel):
    return kernel_spec
  ndim = lead + n_in + len(qk.outs)
  if len(qk.ins) != n_in or qk.lead != lead:
    raise ValueError(f"specs: {qk!r} has lead={qk.lead}, n_in={len(qk.ins)}; asked for lead={lead}, n_in={n_in}")
  s = (tuple(kernel_spec) + (None,) * ndim)[:ndim]
  lead_s, first_in, out_s = s[:lead], s[lead], s[lead + n_in:]
  if qk.kind == "int8":
    children = (P(*s), P(*lead_s, *out_s))
  else:
    absmax = P(*lead_s, first_in, *out_s)  # or, double-quantized, its e4m3 constants
    children = (P(*lead_s, first_in, None, *out_s), absmax)
    if qk.double_block:
      children += (P(*lead_s, first_in, *out_s[:-1], None), P(*lead_s))
  return QuantizedKernel(qk.kind, children, qk.ins, qk.outs, qk.dtype, qk.block, qk.double_block)


def nbytes_per_param(kind: str, block: int = 64, double: bool = False, *, double_block: int = 256,
                     fan_in: int | None = None, dtype: Any = jnp.bfloat16) -> float:
  """Stored bytes per weight of a large kernel, for the memory planner.

  nf4: 0.5 + 4/block (0.5625 at 64); with double quantization 0.5 + 1/block + 4/(block * double_block)
  (the per-kernel mean is ignored). int8: 1 + 4/fan_in (one float32 scale per output channel) when fan_in is
  given, else 1.0 (under 0.1% low for fan_in >= 4096). "none": the itemsize of `dtype`.
  """
  if kind not in KINDS:
    raise ValueError(f"base quantization kind={kind!r}: must be one of {', '.join(KINDS)}")
  if kind == "none":
    return float(np.dtype(dtype).itemsize)
  if kind == "int8":
    return 1.0 + (4.0 / fan_in if fan_in else 0.0)
  if not double:
    return 0.5 + 4.0 / block
  return 0.5 + 1.0 / block + 4.0 / (block * double_block)


# ---- a parameter tree with quantized kernels, as the train state holds it -----------------------------------
# Checkpoints keep plain nested dicts: a quantized kernel is stored as {child name: array}; `attach` rebuilds the
# QuantizedKernel objects from templates (their static shape information) where the layers read them.
CHILD_NAMES = {("int8", False): ("q", "scale"), ("nf4", False): ("codes", "absmax"),
               ("nf4", True): ("codes", "absmax_fp8", "absmax_scale", "absmax_mean")}


def as_dict(qk: QuantizedKernel) -> dict[str, Any]:
  """{child name: child} of a quantized kernel (arrays, ShapeDtypeStructs or PartitionSpecs alike)."""
  return dict(zip(CHILD_NAMES[(qk.kind, bool(qk.double_block))], qk.children))


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree: dict, path: tuple, value) -> dict:
  """A copy of `tree` along `path` with `value` there (other branches shared)."""
  if not path:
    return value
  return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def quantize_params(params: dict, kernels: dict[tuple, tuple[int, int]], kind: str, double: bool = False) -> dict:
  """`params` with each kernel at a path of `kernels` (path -> (lead, n_in)) quantized to `kind`, as `as_dict`
  dicts (a new tree; `params` unchanged; a dict there already is kept). kind "none": `params` itself."""
  if kind == "none":
    return params
  for path, (lead, n_in) in kernels.items():
    if not isinstance(_get(params, path), dict):  # a kernel quantized already (while loading) stays as it is
      params = _set(params, path, as_dict(quantize(_get(params, path), lead, n_in, kind, double=double)))
  return params


def templates(abstract_params: dict, kernels: dict[tuple, tuple[int, int]], kind: str,
              double: bool = False) -> dict[tuple, QuantizedKernel]:
  """path -> abstract QuantizedKernel (ShapeDtypeStruct children) for the kernels of `abstract_params`."""
  if kind == "none":
    return {}
  return {path: jax.eval_shape(lambda w, lead=lead, n_in=n_in: quantize(w, lead, n_in, kind, double=double),
                               jax.ShapeDtypeStruct(_get(abstract_params, path).shape,
                                                    _get(abstract_params, path).dtype))
          for path, (lead, n_in) in kernels.items()}


def attach(params: dict, templates_: dict[tuple, QuantizedKernel]) -> dict:
  """`params` (as `quantize_params` made it) with each stored dict made a QuantizedKernel again (the layers
  dequantize it where they read it: `param[...].astype(dtype)`)."""
  for path, t in templates_.items():
    d = _get(params, path)
    params = _set(params, path, QuantizedKernel(t.kind, tuple(d[n] for n in as_dict(t)), t.ins, t.outs, t.dtype,
                                                t.block, t.double_block))
  return params


def dequantize_params(params: dict, templates_: dict[tuple, QuantizedKernel]) -> dict:
  """`params` with every stored quantized kernel dequantized to its original dtype (plain arrays)."""
  attached = attach(params, templates_)
  for path in templates_:
    params = _set(params, path, _get(attached, path).dequantize())
  return params


def _fit(spec, shape: tuple, mesh_shape: dict):
  """`spec` with the mesh axes of each dim kept only where they divide it (a kernel narrower than one block per
  shard, e.g. D=64 in blocks of 64 over fsdp=2, keeps its blocks whole on every device)."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  out = []
  for entry, size in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    out.append(entry if size % math.prod(mesh_shape[a] for a in names) == 0 else None)
  return P(*out)


def spec_tree(param_specs: dict, kernels: dict[tuple, tuple[int, int]], templates_: dict[tuple, QuantizedKernel],
              mesh_shape: dict[str, int]) -> dict:
  """The PartitionSpecs of a `quantize_params` tree from the float tree's (`specs` per kernel, as dicts; a mesh
  axis that does not divide a child's dim is dropped there: `_fit`)."""
  for path, t in templates_.items():
    lead, n_in = kernels[path]
    child_specs = as_dict(specs(_get(param_specs, path), t, lead, n_in))
    shapes = as_dict(t)
    param_specs = _set(param_specs, path, {k: _fit(v, tuple(shapes[k].shape), mesh_shape)
                                           for k, v in child_specs.items()})
  return param_specs
