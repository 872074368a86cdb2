"""Splash attention (`model.attention_impl=splash`): the Pallas TPU flash-attention kernel of
`jax.experimental.pallas.ops.tpu.splash_attention`, with the arguments and results of model/attention.py.

- Masks are static block masks (`splash_attention_mask`): causal (`CausalMask`), a sliding window of w tokens
  (`LocalMask` with w-1 keys to the left, none to the right), bidirectional (`FullMask`, model.causal=false); the
  kernel skips the blocks they hide. Packed documents are `SegmentIds` (a query sees keys of its own segment id;
  meshlm's padding, id 0, attends within padding as in the other implementations).
- GQA / MQA: the kernel's MQA form (q [R, T, K] against k, v [S, K]) for each kv head, vmapped over kv heads and
  rows, so K/V are never repeated in memory.
- The kernel does not scale the scores: q is multiplied by 1/sqrt(head_dim) before it (so the kernel's soft cap,
  model.attn_logit_softcap, applies to the scaled scores, as in the other implementations).
- Lengths are padded to a multiple of the tile (`SPLASH_GRANULE`, 128, at least); padded tokens get segment id -1,
  which no real token has, and see only each other.
- A window traced through the layer scan chooses, with `lax.switch`, among kernels built for the model's distinct
  windows (`SplashOptions.windows`), since masks are static.
- Under a mesh the kernel runs per device inside `parallel.kernels.shard_heads` (rows over data/fsdp/expert, heads
  over tensor).
- The kernel's residuals (its output and the row logsumexp) are named `attn_context` (model/remat.py), so a remat
  policy that saves the context (`save_attn`) does not rerun the forward kernel in the backward pass.
- `model.pallas_interpret=true` runs the kernel in Pallas interpret mode: slow, but on any backend (tests on CPU).
  Without it the kernel needs TPU devices and `check_platform` refuses others before anything compiles.
- Cost: XLA sees the compiled kernel as an opaque custom call; `kernel_cost` gives the FLOPs and HBM bytes of one
  call in closed form (the performance model, train/planning/predict.py, reads the call's operand shapes and tiles
  from the HLO, and its mask from the named scope `mask_scope` puts around each kernel).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from model import axes
from model import remat
from model.axes import BATCH, HEAD_DIM, HEADS, KV_HEADS, KV_LENGTH, LENGTH
from model.config import SPLASH_GRANULE, layer_windows
from parallel import kernels

_PAD_SEGMENT = -1  # segment id of the padding up to the tile multiple: no real token (ids >= 0) has it


@dataclasses.dataclass(frozen=True)
class SplashOptions:
  """Static settings of the splash kernel (hashable: an attribute of the nnx Attention module).

  Block sizes are tokens (multiples of SPLASH_GRANULE); `windows` the model's distinct per-layer windows (0 =
  global), the kernels a traced window chooses among (needed only when the window is traced); `soft_cap` caps the
  scaled scores at +-soft_cap with tanh (Gemma 2; model.attn_logit_softcap) when set: the kernel's
  attn_logits_soft_cap, forward and backward.
  """
  block_q: int = 512
  block_kv: int = 512
  block_kv_compute: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 512
  interpret: bool = False
  windows: tuple[int, ...] = ()
  soft_cap: float | None = None


def options(cfg) -> SplashOptions:
  """The SplashOptions of a validated model config (`model.splash_*`, `model.pallas_interpret`, the windows)."""
  return SplashOptions(cfg.splash_block_q, cfg.splash_block_kv, cfg.splash_block_kv_compute, cfg.splash_block_q_bwd,
                       cfg.splash_block_kv_bwd, cfg.pallas_interpret, tuple(sorted(set(layer_windows(cfg)))),
                       float(cfg.attn_logit_softcap) if cfg.attn_logit_softcap else None)


def target_platform() -> str:
  """The platform a traced program is compiled for: the current mesh's devices (TPU for an ahead-of-time compile
  on a CPU host), else JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device.platform
  return jax.default_backend()


def check_platform(interpret: bool, platform: str | None = None) -> None:
  """ValueError naming model.attention_impl unless the splash kernel can run: TPU devices, or interpret mode."""
  platform = target_platform() if platform is None else platform
  if not interpret and platform != "tpu":
    raise ValueError(f"model.attention_impl='splash' runs a Pallas TPU kernel, which does not compile for "
                     f"{platform} devices; on CPU use model.pallas_interpret=true (interpret mode: slow, for tests) "
                     "or model.attention_impl=auto (the platform's fast path), xla or blockwise")


def padded_blocks(opts: SplashOptions, T: int) -> tuple[splash_kernel.BlockSizes, int]:
  """(the kernel's BlockSizes, the padded length Tp) for T tokens: each block clipped to T rounded up to the
  granule, Tp the next multiple of every block (of the largest when they are powers of two)."""
  whole = -(-T // SPLASH_GRANULE) * SPLASH_GRANULE
  q, kv, q_bwd, kv_bwd = (min(b, whole) for b in (opts.block_q, opts.block_kv, opts.block_q_bwd, opts.block_kv_bwd))
  kv_compute = math.gcd(min(opts.block_kv_compute, kv), kv)
  unit = math.lcm(q, kv, q_bwd, kv_bwd)
  blocks = splash_kernel.BlockSizes(block_q=q, block_kv=kv, block_kv_compute=kv_compute, block_q_dkv=q_bwd,
                                    block_kv_dkv=kv_bwd, block_kv_dkv_compute=kv_bwd, block_q_dq=q_bwd,
                                    block_kv_dq=kv_bwd)
  return blocks, -(-T // unit) * unit


def _mask(Tp: int, T: int, window: int, causal: bool) -> splash_mask.Mask:
  """The static [Tp, Tp] mask of one head (a window covering the whole real length is plain causal)."""
  if not causal:
    return splash_mask.FullMask((Tp, Tp))
  if window == 0 or window >= T:
    return splash_mask.CausalMask((Tp, Tp))
  return splash_mask.LocalMask((Tp, Tp), window_size=(window - 1, 0), offset=0)


MASK_SCOPE = "splash_mask_"  # prefix of the named scope around each kernel call: the mask, in the HLO op_name


def mask_scope(Tp: int, T: int, window: int, causal: bool) -> str:
  """The named scope of a kernel built by `_mask(Tp, T, window, causal)`: splash_mask_causal, splash_mask_full or
  splash_mask_local<w> (w tokens: itself and w-1 before it), so its cost can be read from the compiled HLO."""
  if not causal:
    return MASK_SCOPE + "full"
  return MASK_SCOPE + ("causal" if window == 0 or window >= T else f"local{window}")


def visible_tiles(Tq: int, Tk: int, block_q: int, block_kv: int, mask: str) -> int:
  """(query tile, key tile) pairs of a [Tq, Tk] mask (`mask_scope`'s suffix: causal, full, local<w>) holding any
  visible pair: the tiles a kernel computes (it skips only the tiles the mask hides entirely)."""
  nq, nk = -(-Tq // block_q), -(-Tk // block_kv)
  if mask == "full":
    return nq * nk
  window = int(mask[len("local"):]) if mask.startswith("local") else 0
  tiles = 0
  for i in range(nq):
    first_q, last_q = i * block_q, min((i + 1) * block_q, Tq) - 1
    last = min(nk - 1, last_q // block_kv)  # keys after the tile's last query are hidden
    first = max(0, (first_q - window + 1) // block_kv) if window else 0  # keys before its first query's window
    tiles += max(0, last - first + 1)
  return tiles


# Matmul FLOPs per visible (query, key) pair and head_dim unit of each kernel: the forward computes q.k and p.v; the
# dq kernel recomputes q.k and computes do.v and ds.k; the dk/dv kernel recomputes q.k and computes do.v, p.do
# (dv) and ds.q (dk).
KERNEL_MATMULS = {"fwd": 4, "dq": 6, "dkv": 8}


def kernel_cost(phase: str, q_shape, k_shape, itemsize: int, block_q: int, block_kv: int,
                mask: str) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of one call of a splash kernel: `phase` fwd, dq or dkv; q_shape [..., Tq, K] (MQA:
  [..., R, Tq, K] per kv head, so the leading dims multiply to the query heads of the call), k_shape [..., Tk, K]
  (the kv heads); q's `itemsize` (bytes); the phase's tiles (tokens); `mask` as `visible_tiles`.

  FLOPs: KERNEL_MATMULS[phase] x (visible tiles x block_q x block_kv pairs) x K per query head. Bytes, a streaming
  model: each operand and result once per query head, plus the operand streamed along the inner grid axis once per
  visible tile (k and v in fwd and dq, q, do and the float32 row statistics in dkv); float32 statistics.
  """
  Tq, K = q_shape[-2:]
  Tk = k_shape[-2]
  heads, kv_heads = math.prod(q_shape[:-2]), math.prod(k_shape[:-2])
  tiles = visible_tiles(Tq, Tk, block_q, block_kv, mask)
  flops = KERNEL_MATMULS[phase] * tiles * block_q * block_kv * K * heads
  row = Tq * K * itemsize  # one query head's q (or o, do, dq)
  if phase == "fwd":  # q, o and the logsumexp (128 lanes wide) once; k, v per tile
    nbytes = heads * (2 * row + Tq * 128 * 4 + tiles * block_kv * K * itemsize * 2)
  elif phase == "dq":  # q, do, dq, logsumexp and di once; k, v per tile
    nbytes = heads * (3 * row + Tq * 4 * 2 + tiles * block_kv * K * itemsize * 2)
  else:  # k, v per query head and dk, dv per kv head once; q, do, logsumexp, di per tile
    nbytes = (heads * (2 * Tk * K * itemsize + tiles * block_q * (2 * K * itemsize + 2 * 4))
              + kv_heads * 2 * Tk * K * itemsize)
  return float(flops), float(nbytes)


def _kernel(opts: SplashOptions, blocks, Tp: int, T: int, R: int, window: int, causal: bool):
  """The MQA splash kernel for R query heads sharing one kv head (built at trace time; its masks are numpy)."""
  mask = splash_mask.MultiHeadMask([_mask(Tp, T, window, causal) for _ in range(R)])
  return splash_kernel.make_splash_mqa(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                       attn_logits_soft_cap=opts.soft_cap, residual_checkpoint_name=remat.ATTN_CONTEXT,
                                       interpret=opts.interpret)


def _static_window(window) -> int | None:
  """The window as a Python int when it is known at trace time, None when traced (inside the layer scan)."""
  return None if isinstance(window, jax.core.Tracer) else int(window)


def _local_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, *, opts, blocks, T, candidates, causal):
  """Splash attention on one device's (already scaled and padded) shard: q [B, Tp, H, K], k, v [B, Tp, G, K]."""
  B, Tp, H, K = q_BTHK.shape
  G = k_BSGK.shape[2]
  R = H // G
  q_BGRTK = q_BTHK.reshape(B, Tp, G, R, K).transpose(0, 2, 3, 1, 4)
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  segment_ids_BT = segment_ids_BT.astype(jnp.int32)

  def run(w, q_BGRTK, k_BGSK, v_BGSK, segment_ids_BT):
    kernel = _kernel(opts, blocks, Tp, T, R, w, causal)
    def one(q_RTK, k_SK, v_SK, seg_T):
      return kernel(q_RTK, k_SK, v_SK, splash_kernel.SegmentIds(q=seg_T, kv=seg_T))
    over_heads = jax.vmap(one, in_axes=(0, 0, 0, None))
    with jax.named_scope(mask_scope(Tp, T, w, causal)):  # the backward kernels inherit it too
      return jax.vmap(over_heads)(q_BGRTK, k_BGSK, v_BGSK, segment_ids_BT)

  operands = (q_BGRTK, k_BGSK, v_BGSK, segment_ids_BT)
  if len(candidates) == 1:
    o_BGRTK = run(candidates[0], *operands)
  else:  # the traced window picks its kernel: branch i where window == candidates[i]
    index = sum(jnp.int32(i) * (window == w) for i, w in enumerate(candidates)).astype(jnp.int32)
    o_BGRTK = jax.lax.switch(index, [functools.partial(run, w) for w in candidates], *operands)
  return o_BGRTK.transpose(0, 3, 1, 2, 4).reshape(B, Tp, H, K)


def splash_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, causal: bool = True,
                     opts: SplashOptions = SplashOptions()) -> jax.Array:
  """Causal (or bidirectional) self-attention with segments and a window by the splash kernel -> o_BTHK in q's
  dtype (arguments as model/attention.py's; S == T). `window` (tokens, 0 = global) may be a Python int or a
  traced int32, which must then be one of `opts.windows`. Refuses (ValueError) off TPU without interpret mode.
  """
  check_platform(opts.interpret)
  B, T, H, K = q_BTHK.shape
  if k_BSGK.shape[1] != T:
    raise ValueError(f"splash attention is self-attention: {T} queries but {k_BSGK.shape[1]} keys")
  static = _static_window(window) if causal else 0
  candidates = (static,) if static is not None else opts.windows
  if not candidates:
    raise ValueError("splash attention with a traced window needs the windows it may take (SplashOptions.windows: "
                     "the model's distinct per-layer windows, model.splash.options(cfg))")
  blocks, Tp = padded_blocks(opts, T)
  pad = lambda x, value=0: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
  q_BTHK = pad(q_BTHK * jnp.asarray(1.0 / math.sqrt(K), q_BTHK.dtype))
  k_BSGK, v_BSGK = pad(k_BSGK), pad(v_BSGK)
  segment_ids_BT = pad(segment_ids_BT.astype(jnp.int32), _PAD_SEGMENT)
  window = jnp.asarray(0 if static is not None else window, jnp.int32)
  body = functools.partial(_local_attention, opts=opts, blocks=blocks, T=T, candidates=candidates, causal=causal)
  if axes.active():
    q_spec = axes.spec((BATCH, LENGTH, HEADS, HEAD_DIM))
    kv_spec = axes.spec((BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM))
    o_BTHK = kernels.shard_heads(body, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, batch=q_spec[0],
                                 heads=q_spec[2], kv_heads=kv_spec[2])
  else:
    o_BTHK = body(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window)
  return o_BTHK[:, :T].astype(q_BTHK.dtype)
