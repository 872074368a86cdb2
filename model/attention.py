"""Attention kernels behind one switch (`model.attention_impl`), numerically equal up to float rounding.

All take q_BTHK, k_BSGK, v_BSGK (S == T: self-attention; G kv heads divide H query heads, query head h uses kv
head h // (H // G) as in Hugging Face), segment_ids_BT (0 = padding, which attends only within padding), a
window (tokens; 0 = full causal, else a token sees itself and window-1 before it; may be a traced int32) and
`causal` (a Python bool; False = bidirectional within the segment, the encoder of model.causal=false; no window)
and optionally prefix_BT (bool/int, 1 = the token belongs to its document's bidirectional prefix: prefix tokens of
one segment see each other in both directions, the prefix-LM of Raffel et al. 2020 / UL2's S-denoiser), and
optionally branch_BT (int: 0 = the shared trunk of a row's segment; a token of branch b > 0 sees the trunk and
branch b only, so several continuations of one prompt are scored in one row without seeing each other: tree
attention, evals/requests.py).
They return the context o_BTHK in q's dtype; scores and softmax statistics are float32. `softcap` (> 0,
model.attn_logit_softcap; Gemma 2) turns the scaled scores s into softcap * tanh(s / softcap) before the mask; xla,
blockwise, splash and the cached decode take it, jax.nn.dot_product_attention (dot_product, cudnn) cannot.

- `xla_attention`: the reference, materialises [B, H, T, S] scores.
- `dot_product_attention`: `jax.nn.dot_product_attention`; on GPUs in half precision it tries cuDNN and, where
  cuDNN refuses, runs XLA's implementation and says so once.
- `cudnn_attention`: the same call with `implementation="cudnn"` and nothing else: cuDNN flash attention on NVIDIA
  GPUs in bfloat16/float16, refused (ValueError naming model.attention_impl) where it cannot run.
- `blockwise_attention`: flash-style online softmax over blocks with a custom VJP that recomputes the scores, so
  memory grows linearly with T in both passes; blocks that the mask hides entirely are skipped.
- `splash` (model/splash.py): the Pallas TPU splash-attention kernel (interpret mode elsewhere, for tests).

`model.attention_impl=auto` picks one per platform (`resolve_impl`): splash on TPUs, cudnn on GPUs in half
precision, xla otherwise.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import ml_collections

from model import axes
from model import config as model_config
from model import splash as splash_lib
from model.axes import BATCH, HEAD_DIM, HEADS, KV_HEADS, KV_LENGTH, LENGTH
from parallel import context as parallel_context
from parallel import kernels

_log = logging.getLogger(__name__)
_NEG = -1e30  # finite "minus infinity": masked scores never produce NaN through (x - max)


def mask_fn(q_pos_T, k_pos_S, seg_q_BT, seg_k_BS, window, causal: bool = True, prefix_q_BT=None,
            prefix_k_BS=None, branch_q_BT=None, branch_k_BS=None) -> jax.Array:
  """bool [B, T, S]: within the same segment and, if `causal`, causal (by index in the row) inside the window
  or (with prefixes) both tokens in the prefix; with branches, the key is on the trunk (0) or the query's branch."""
  same_BTS = seg_q_BT[:, :, None] == seg_k_BS[:, None, :]
  if branch_q_BT is not None:
    same_BTS = same_BTS & ((branch_k_BS[:, None, :] == 0) | (branch_k_BS[:, None, :] == branch_q_BT[:, :, None]))
  if not causal:
    return same_BTS
  diff_TS = q_pos_T[:, None] - k_pos_S[None, :]
  visible_BTS = ((diff_TS >= 0) & ((window == 0) | (diff_TS < window)))[None]
  if prefix_q_BT is not None:
    visible_BTS = visible_BTS | ((prefix_q_BT[:, :, None] > 0) & (prefix_k_BS[:, None, :] > 0))
  return visible_BTS & same_BTS


@jax.custom_vjp
def softmax(s_BGRTS: jax.Array) -> jax.Array:
  """Softmax over the last axis whose backward is p * (g - sum(g * p)): it keeps only p for the backward pass.

  (jax.nn.softmax differentiates through exp(s - max) / sum unless the global jax_softmax_custom_jvp flag is on:
  its backward keeps the unnormalised exponentials and the sums too and runs twice the elementwise work.)
  """
  return jax.nn.softmax(s_BGRTS, axis=-1)


def _softmax_fwd(s):
  p = jax.nn.softmax(s, axis=-1)
  return p, p


def _softmax_bwd(p, g):
  return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _group(q_BTHK, num_kv_heads):
  B, T, H, K = q_BTHK.shape
  return q_BTHK.reshape(B, T, num_kv_heads, H // num_kv_heads, K)


def xla_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, causal: bool = True, prefix_BT=None,
                  branch_BT=None, query_block: int = 0, softcap: float = 0.0):
  """Reference attention with an explicit [B, G, R, T, S] score tensor (R = H // G query heads per kv head).

  With `query_block` b > 0 and T > b, causal self-attention without prefixes splits the queries into
  n = ceil(T / b) blocks of about T / n rows, and block i multiplies only the keys up to its own last token: the
  score blocks above the diagonal, masked for every query, are never computed (n = 2 computes 3 of 4 blocks,
  n = 4 10 of 16, large n about half the square). Same values up to float rounding. Not applied when the mesh
  splits the length (sequence parallelism), where slicing the queries' length would move them between devices.
  """
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  mask_BTS = mask_fn(jnp.arange(T), jnp.arange(S), segment_ids_BT, segment_ids_BT, window, causal, prefix_BT,
                     prefix_BT, branch_BT, branch_BT)
  whole = not causal or prefix_BT is not None or T != S or axes.mesh_size(axes.LENGTH) > 1
  return _masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, None if whole else query_blocks(T, query_block),
                           softcap)


def query_blocks(T: int, query_block: int) -> list[int] | None:
  """Edges 0 = b_0 < ... < b_n = T of `xla_attention`'s n = ceil(T / query_block) causal query blocks, as even as
  integers allow; None (one square) when 0 = query_block or T <= query_block."""
  if not 0 < query_block < T:
    return None
  n = -(-T // query_block)
  return [T * i // n for i in range(n + 1)]


def cached_attention(q_BTHK, k_BSGK, v_BSGK, index, start_B, window=0, softcap: float = 0.0):
  """Queries at cache slots [index, index + T) against a KV cache of S slots holding them (see model.kv_cache):
  a decode step (T = 1) or a chunk of a prompt (T > 1, its keys/values already written at those slots).

  Key slot j is visible to the query at slot i when start_B[b] <= j <= i (left padding and not-yet-written
  slots hidden; the chunk's own later tokens too) and, for window > 0, i - j < window. `index` may be traced.
  Same arithmetic as `xla_attention`; the scores are [B, H, T, S] float32, so chunk length bounds the memory.
  Queries in the left padding (i < start_B[b]) see no key; their outputs are finite and never read.
  """
  mask_BTS = _cache_mask(q_BTHK.shape[0], q_BTHK.shape[1], k_BSGK.shape[1], index, start_B, window)
  return _masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap=softcap)


def masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap: float = 0.0, heads_major: bool = False) -> jax.Array:
  """Softmax attention of queries [B, T, H, K] over keys / values [B, S, G, K] (heads_major: [B, G, S, K], the
  layout the products use) where mask_BTS (bool [B, T, S]) is True (float32 scores, GQA groups of H / G heads):
  the arithmetic of `cached_attention` for any mask."""
  return _masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, softcap=softcap, heads_major=heads_major)


def _cache_mask(B: int, T: int, S: int, index, start_B, window) -> jax.Array:
  """bool [B, T, S]: queries at cache slots [index, index + T) see slots start_B[b] <= j <= i (inside the window)."""
  slots_S = jnp.arange(S)
  real_BS = (slots_S[None, :] >= start_B[:, None]).astype(jnp.int32)
  return mask_fn(index + jnp.arange(T), slots_S, jnp.ones((B, T), jnp.int32), real_BS, window)


def latent_cached_attention(q_nope_BTHN, q_rot_BTHR, latent_BSC, k_rot_BSR, w_uk_CHN, w_uv_CHV, index, start_B,
                            window=0, scale: float = 1.0, softcap: float = 0.0):
  """Multi-head Latent Attention over a cache of latents (C = kv_lora_rank wide) and RoPE keys, masked as
  `cached_attention` masks (`latent_masked_attention`). Returns o_BTHV in q's dtype."""
  mask_BTS = _cache_mask(q_nope_BTHN.shape[0], q_nope_BTHN.shape[1], latent_BSC.shape[1], index, start_B, window)
  return latent_masked_attention(q_nope_BTHN, q_rot_BTHR, latent_BSC, k_rot_BSR, w_uk_CHN, w_uv_CHV, mask_BTS,
                                 scale, softcap)


def latent_masked_attention(q_nope_BTHN, q_rot_BTHR, latent_BSC, k_rot_BSR, w_uk_CHN, w_uv_CHV, mask_BTS,
                            scale: float = 1.0, softcap: float = 0.0):
  """Multi-head Latent Attention over latents [B, S, C] and RoPE keys [B, S, R] where mask_BTS (bool) is True,
  without expanding them into per-head keys and values (the absorbed form, DeepSeek-V2 sec. 2.1.3): the key of
  head h at slot s is [latent_s @ w_uk_h, k_rot_s], so q.k = (q_nope_h @ w_uk_h^T) . latent_s + q_rot_h . k_rot_s,
  and the output sum_s p_s (latent_s @ w_uv_h) = (sum_s p_s latent_s) @ w_uv_h. Scores are float32, times `scale`
  (the softmax scale). Returns o_BTHV in q's dtype.
  """
  f32 = jnp.float32
  q_lat_BTHC = jnp.einsum("bthn,chn->bthc", q_nope_BTHN, w_uk_CHN, preferred_element_type=f32)
  s_BHTS = (jnp.einsum("bthc,bsc->bhts", q_lat_BTHC, latent_BSC.astype(f32))
            + jnp.einsum("bthr,bsr->bhts", q_rot_BTHR, k_rot_BSR, preferred_element_type=f32)) * f32(scale)
  s_BHTS = jnp.where(mask_BTS[:, None], cap_scores(s_BHTS, softcap), _NEG)
  p_BHTS = softmax(s_BHTS)
  ctx_BTHC = jnp.einsum("bhts,bsc->bthc", p_BHTS, latent_BSC.astype(f32))
  o_BTHV = jnp.einsum("bthc,chv->bthv", ctx_BTHC, w_uv_CHV.astype(f32))
  return o_BTHV.astype(q_nope_BTHN.dtype)


def cap_scores(s, softcap: float):
  """softcap * tanh(s / softcap) (float32 scores; Gemma 2's attention logit soft-capping); s itself for 0."""
  if not softcap:
    return s
  cap = jnp.float32(softcap)
  return jnp.tanh(s / cap) * cap


def _masked_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, bounds=None, softcap: float = 0.0,
                      heads_major: bool = False):
  """Masked softmax attention; `bounds` (query block edges 0 = b_0 < ... < b_n = T, T == S, causal masks only):
  queries [b_i, b_i+1) against keys [0, b_i+1); `softcap` > 0 caps the scaled scores (`cap_scores`); heads_major:
  keys and values come as [B, G, S, K]."""
  B, T, H, K = q_BTHK.shape
  if not heads_major:
    # Heads-major operands (M = R * T query rows per kv head): the products are then plain batched matmuls over
    # (b, g) of contiguous matrices, which XLA:CPU runs about twice as fast as the token-major einsum
    # ("btgrk,bsgk->bgrts"), whose operands it transposes inside every product and its gradients.
    k_BSGK, v_BSGK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  k_BGSK, v_BGSK = k_BSGK, v_BSGK
  G, S = k_BGSK.shape[1:3]
  R = H // G
  q_BGRTK = _group(q_BTHK, G).transpose(0, 2, 3, 1, 4)
  edges = (0, T) if bounds is None else bounds
  o_blocks = []
  for a, e in zip(edges[:-1], edges[1:]):
    t, s = e - a, S if bounds is None else e  # queries, keys of this block
    q_BGMK = q_BGRTK[:, :, :, a:e].reshape(B, G, R * t, K)
    s_BGMS = jnp.einsum("bgmk,bgsk->bgms", q_BGMK, k_BGSK[:, :, :s], preferred_element_type=jnp.float32) / jnp.sqrt(
        jnp.float32(K))
    s_BGMS = cap_scores(s_BGMS, softcap)
    s_BGRTS = jnp.where(mask_BTS[:, None, None, a:e, :s], s_BGMS.reshape(B, G, R, t, s), _NEG)
    p_BGMS = softmax(s_BGRTS).reshape(B, G, R * t, s)
    o_BGMK = jnp.einsum("bgms,bgsk->bgmk", p_BGMS.astype(v_BGSK.dtype), v_BGSK[:, :, :s],
                        preferred_element_type=jnp.float32)
    o_blocks.append(o_BGMK.reshape(B, G, R, t, K))
  o_BGRTK = o_blocks[0] if len(o_blocks) == 1 else jnp.concatenate(o_blocks, axis=3)
  return o_BGRTK.transpose(0, 3, 1, 2, 4).reshape(B, T, H, K).astype(q_BTHK.dtype)


def _jax_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, causal, prefix_BT, branch_BT, implementation):
  """`jax.nn.dot_product_attention(implementation=...)` computing meshlm's mask.

  Packed documents (and prefixes, branches, a traced window) go in as the boolean mask of `mask_fn`, [B, 1, T, S]:
  the API's query/key_value_seq_lengths describe one unpadded prefix per row, not several documents. cuDNN turns the
  mask into an additive bias in q's dtype that its flash kernel reads tile by tile. `is_causal` (plain causal
  self-attention) and a static window (`local_window_size`) are passed besides, so cuDNN skips the tiles they hide.
  """
  T, S = q_BTHK.shape[1], k_BSGK.shape[1]
  mask_B1TS = mask_fn(jnp.arange(T), jnp.arange(S), segment_ids_BT, segment_ids_BT, window, causal, prefix_BT,
                      prefix_BT, branch_BT, branch_BT)[:, None]
  is_causal = causal and prefix_BT is None and T == S
  static = None if isinstance(window, jax.core.Tracer) else int(window)
  local = (static - 1, 0) if is_causal and static else None
  return jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, mask=mask_B1TS, is_causal=is_causal,
                                      local_window_size=local, implementation=implementation)


def dot_product_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, causal: bool = True,
                          prefix_BT=None, branch_BT=None):
  """`jax.nn.dot_product_attention` with the segment/causal/window mask; on GPU in half precision it tries cuDNN
  and runs XLA's implementation (logged once) where cuDNN refuses. `cudnn_attention` never falls back."""
  call = functools.partial(_jax_attention, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, causal, prefix_BT,
                           branch_BT)
  if jax.default_backend() == "gpu" and q_BTHK.dtype in (jnp.bfloat16, jnp.float16):
    try:
      out = call(implementation="cudnn")
    except (ValueError, NotImplementedError, RuntimeError) as e:  # cuDNN refuses this shape, mask or version
      report_once(f"attention_impl=dot_product: cuDNN refused q {q_BTHK.shape} {q_BTHK.dtype} ({e}); "
                   "running the XLA implementation (same function, more memory)", logging.WARNING)
    else:
      report_once(f"attention_impl=dot_product: cuDNN flash attention for q {q_BTHK.shape} {q_BTHK.dtype}")
      return out
  else:
    report_once(f"attention_impl=dot_product: the XLA implementation on {jax.default_backend()} "
                 f"({q_BTHK.dtype}; cuDNN needs a GPU and half precision)")
  return call(implementation="xla")


CUDNN_DTYPES = ("bfloat16", "float16")  # cuDNN's flash attention has half-precision kernels only
# Largest head_dim cuDNN takes: 256 on Hopper and later, 128 before (jax checks the GPU's generation when tracing).
CUDNN_MAX_HEAD_DIM = 256
_CUDNN_ALTERNATIVES = ("use model.attention_impl=auto (the platform's fast path: splash on TPU, cudnn on GPU in "
                       "bfloat16/float16, else xla), or xla, dot_product or blockwise, which run everywhere")


def cudnn_problem(platform: str, dtype, head_dim: int) -> str | None:
  """Why cuDNN flash attention cannot run on `platform` ("cpu", "gpu", "tpu") in compute `dtype` with `head_dim`;
  None when it can, as far as is known before tracing (jax checks the GPU generation and cuDNN version then)."""
  if platform != "gpu":
    return f"runs NVIDIA's cuDNN kernel, which does not compile for {platform} devices"
  name = jnp.dtype(dtype).name
  if name not in CUDNN_DTYPES:
    return f"needs model.dtype=bfloat16 or float16: cuDNN flash attention has no {name} kernel"
  if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
    return f"needs model.head_dim a multiple of 8 and at most {CUDNN_MAX_HEAD_DIM}; got {head_dim}"
  return None


def cudnn_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, causal: bool = True, prefix_BT=None,
                    branch_BT=None, *, implementation: str = "cudnn"):
  """cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`, mask as `_jax_attention`) ->
  o_BTHK in q's dtype. Never falls back: where cuDNN cannot run (`cudnn_problem`, or jax refusing the shape when
  tracing) it raises ValueError naming model.attention_impl.

  Under a mesh each device runs the kernel on its own rows and heads (`parallel.kernels.shard_heads`; a length
  split over `sequence` is gathered, as cuDNN's own partitioning refuses one). `implementation="xla"` runs the
  very same call (arguments, mask, sharding) through XLA's implementation instead: how tests check it off GPU.
  """
  if implementation == "cudnn":
    problem = cudnn_problem(splash_lib.target_platform(), q_BTHK.dtype, q_BTHK.shape[-1])
    if problem:
      raise ValueError(f"model.attention_impl='cudnn' {problem}; {_CUDNN_ALTERNATIVES}")
    report_once(f"attention_impl=cudnn: cuDNN flash attention for q {q_BTHK.shape} {q_BTHK.dtype}")
  static = None if isinstance(window, jax.core.Tracer) else int(window)
  has_prefix, has_branch = prefix_BT is not None, branch_BT is not None
  zeros = jnp.zeros(segment_ids_BT.shape, jnp.int32)
  # One row-sharded operand carries the per-token codes through shard_heads: segment, prefix, branch.
  codes_BTC = jnp.stack([segment_ids_BT.astype(jnp.int32), prefix_BT.astype(jnp.int32) if has_prefix else zeros,
                         branch_BT.astype(jnp.int32) if has_branch else zeros], axis=-1)

  def body(q, k, v, codes, *traced_window):
    w = traced_window[0] if traced_window else static
    return _jax_attention(q, k, v, codes[..., 0], w, causal, codes[..., 1] if has_prefix else None,
                          codes[..., 2] if has_branch else None, implementation)

  replicated = () if static is not None else (window,)
  try:
    if not axes.active():
      return body(q_BTHK, k_BSGK, v_BSGK, codes_BTC, *replicated)
    q_spec = axes.spec((BATCH, LENGTH, HEADS, HEAD_DIM))
    kv_spec = axes.spec((BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM))
    return kernels.shard_heads(body, q_BTHK, k_BSGK, v_BSGK, codes_BTC, *replicated, batch=q_spec[0],
                               heads=q_spec[2], kv_heads=kv_spec[2])
  except (ValueError, NotImplementedError, RuntimeError) as e:  # jax's checks of the shapes, GPU and cuDNN
    raise ValueError(f"model.attention_impl='cudnn': cuDNN cannot run q {q_BTHK.shape} {q_BTHK.dtype} here ({e}); "
                     f"{_CUDNN_ALTERNATIVES}") from e


# auto on CPUs: xla, the fastest CPU path measured. Training steps of the tiny config (configs/tiny.py: T = 128,
# batch 16) on one core of the 2-core CPU machine, fastest of 15 alternating steps (benchmarks/train_step.py
# --configs tiny --peers "" --threads=1 --variant model.attention_impl=...): xla 188 ms vs blockwise 206 ms without
# remat, 227 vs 311 ms with full remat; another run xla 154 vs dot_product 168 ms, 206 vs 224 ms (docs/model.md).
AUTO_CPU = "xla"


def auto_impl(platform: str, dtype, head_dim: int, softcap: float = 0.0) -> str:
  """`model.attention_impl=auto`'s choice for `platform` ("cpu", "gpu", "tpu"), compute `dtype` and `head_dim`:
  splash on TPUs, cudnn on GPUs where cuDNN takes the dtype and head_dim (half precision) and no `softcap`
  (model.attn_logit_softcap, which cuDNN cannot apply) is set, else xla."""
  if platform == "tpu":
    return "splash"
  if platform == "gpu" and not softcap and cudnn_problem(platform, dtype, head_dim) is None:
    return "cudnn"
  return AUTO_CPU if platform == "cpu" else "xla"


def resolve_impl(cfg, platform: str) -> str:
  """The attention implementation a model config (`config.model`) runs on `platform` ("cpu", "gpu", "tpu"): auto's
  choice (`auto_impl`) for "auto", else model.attention_impl itself once it is known to run there.

  Raises ValueError naming model.attention_impl and what would run for an explicit choice that cannot: splash off
  TPU without model.pallas_interpret, cudnn off GPU, in float32, or with a head_dim cuDNN does not take.
  """
  impl = cfg.attention_impl
  if impl == "auto":
    return auto_impl(platform, cfg.dtype, cfg.head_dim, cfg.attn_logit_softcap)
  if impl == "splash":
    splash_lib.check_platform(cfg.pallas_interpret, platform)
  elif impl == "cudnn":
    problem = cudnn_problem(platform, cfg.dtype, cfg.head_dim)
    if problem:
      raise ValueError(f"model.attention_impl='cudnn' {problem}; {_CUDNN_ALTERNATIVES}")
  return impl


def auto_inert_keys(cfg, resolved: dict[str, str]) -> list[str]:
  """Warnings for model keys set away from their defaults that act only under another kernel than the ones auto
  runs here (`resolved`: {"attention_impl": ..., "moe_impl": ...}, what model.*_impl=auto chose): the config
  checks cannot tell under "auto" (model.config.CONDITIONAL_KEYS rows that return None), so the Trainer says it
  once the platform is known."""
  defaults = model_config.default_model_config()
  settled = ml_collections.ConfigDict(dict(cfg, **{k: v for k, v in resolved.items() if v != "none"}))
  chose = ", ".join(f"model.{k}={cfg[k]} runs {v}" for k, v in resolved.items() if cfg[k] == "auto" and v != "none")
  out = []
  for key, condition, acts, why in model_config.CONDITIONAL_KEYS:
    if cfg[key] != defaults[key] and acts(cfg) is None and acts(settled) is False:
      out.append(f"warning: model.{key}={cfg[key]!r} has no effect: {chose} here, and it acts only under "
                 f"{condition} ({why})")
  return out


_REPORTED: set[str] = set()


def report_once(message: str, level: int = logging.INFO) -> None:
  """Logs which attention path runs, once per distinct message (the function is traced once per shape)."""
  if message not in _REPORTED:
    _REPORTED.add(message)
    _log.log(level, message)


def _pad_to(x, length, axis, value=0):
  pad = length - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _span_visible(q_idx, k_idx, window, causal=True):
  """Whether any (query, key) pair of two sets of token indices (1-D) can be visible under the causal + window
  mask: exact for contiguous runs of indices, conservative (True) otherwise."""
  if not causal:
    return jnp.bool_(True)
  q_min, q_max, k_min, k_max = q_idx.min(), q_idx.max(), k_idx.min(), k_idx.max()
  return (q_max >= k_min) & ((window == 0) | (q_min - k_max < window))


def blockwise_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, block_size: int = 512,
                        causal: bool = True, prefix_BT=None, branch_BT=None, softcap: float = 0.0):
  """Flash-style attention: O(T * block) memory in forward and backward; same values as `xla_attention`."""
  B, T, H, K = q_BTHK.shape
  blk = min(block_size, T)
  Tp = -(-T // blk) * blk
  side, flags = token_side(segment_ids_BT, prefix_BT, branch_BT, causal, jnp.arange(T, dtype=jnp.int32), Tp)
  q, k, v = (_pad_to(a, Tp, 1) for a in (q_BTHK, k_BSGK, v_BSGK))
  o = _flash(q, k, v, side, side, jnp.asarray(window, jnp.int32), blk, *flags, float(softcap))
  return o[:, :T]


def token_side(segment_ids_BT, prefix_BT, branch_BT, causal: bool, index_T, length: int):
  """The per-token operands of the blockwise kernel, padded to `length`: (index_T int32 token indices in the row,
  segment ids [B, T] with -1 for padding, tree codes [B, T] = prefix bit + 2 * branch), and its static flags
  (causal, has_prefix, has_branch). Padded tokens get segment -1 (they match no real token) and the last index."""
  # With a prefix every block may hold visible pairs above the diagonal: none is skipped (causal=False does that).
  has_prefix = prefix_BT is not None and causal
  has_branch = branch_BT is not None
  tree = (prefix_BT > 0).astype(jnp.int32) if has_prefix else jnp.zeros(segment_ids_BT.shape, jnp.int32)
  if has_branch:
    tree = tree + 2 * branch_BT.astype(jnp.int32)
  side = _pad_side((index_T.astype(jnp.int32), segment_ids_BT.astype(jnp.int32), tree), length)
  return side, (causal and not has_prefix, has_prefix, has_branch)


def _pad_side(side, length: int):
  """A `token_side` tuple padded to `length` tokens: the last index repeated, segment -1, tree code 0."""
  index_T, seg_BT, tree_BT = side[:3]
  return (jnp.pad(index_T, (0, length - index_T.shape[0]), mode="edge"), _pad_to(seg_BT, length, 1, value=-1),
          _pad_to(tree_BT, length, 1))


def _split_blocks(x, blk):
  """[B, T, ...] -> [T // blk, B, blk, ...]."""
  B, T = x.shape[:2]
  return jnp.moveaxis(x.reshape(B, T // blk, blk, *x.shape[2:]), 1, 0)


def _merge_blocks(x):
  """[n, B, blk, ...] -> [B, n * blk, ...]."""
  n, B, blk = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(B, n * blk, *x.shape[3:])


def _side_blocks(side, blk):
  """(index_T, seg_BT, tree_BT) -> ([n, blk], [n, B, blk], [n, B, blk])."""
  index_T, seg_BT, tree_BT = side
  return index_T.reshape(-1, blk), _split_blocks(seg_BT, blk), _split_blocks(tree_BT, blk)


def _scores(q_BQGRK, k_BSGK, scale, softcap: float = 0.0):
  return cap_scores(jnp.einsum("bqgrk,bsgk->bgrqs", q_BQGRK, k_BSGK, preferred_element_type=jnp.float32) * scale,
                    softcap)


def flash_forward(q, k, v, q_side, k_side, window, blk, causal, has_prefix, has_branch, softcap):
  """Online-softmax attention of queries q [B, T, H, K] against keys/values k, v [B, S, G, K] (T, S multiples of
  blk), their tokens described by `token_side` tuples -> (o_BTHK float32, lse_BGRT float32). A query that sees no
  key gets o = 0 and lse = -1e30, so partial results over disjoint key sets combine by their lse (ring attention).
  Tiles that the causal + window mask hides entirely are skipped."""
  B, T, H, K = q.shape
  G = k.shape[2]
  R = H // G
  scale = 1.0 / jnp.sqrt(jnp.float32(K))
  qb = _split_blocks(_group(q, G), blk)  # [n, B, blk, G, R, K]
  kb, vb = _split_blocks(k, blk), _split_blocks(v, blk)
  qs, ks = _side_blocks(q_side, blk), _side_blocks(k_side, blk)

  def q_block(q_BQGRK, qi_Q, segq_BQ, treeq_BQ):
    def k_step(carry, xs):
      k_BSGK, v_BSGK, ki_S, segk_BS, treek_BS = xs

      def compute(carry):
        m, l, acc = carry
        s = _scores(q_BQGRK, k_BSGK, scale, softcap)
        mask = _block_mask(qi_Q, ki_S, segq_BQ, segk_BS, window, causal, has_prefix, has_branch, treeq_BQ, treek_BS)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("bgrqs,bsgk->bgrqk", p.astype(v_BSGK.dtype), v_BSGK,
                                                 preferred_element_type=jnp.float32)
        return m_new, l, acc

      visible = _span_visible(qi_Q, ki_S, window, causal)
      return jax.lax.cond(visible, compute, lambda c: c, carry), None

    init = (jnp.full((B, G, R, blk), _NEG, jnp.float32), jnp.zeros((B, G, R, blk), jnp.float32),
            jnp.zeros((B, G, R, blk, K), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(k_step, init, (kb, vb, *ks))
    seen = l > 0
    o_BGRQK = acc / jnp.where(seen, l, 1.0)[..., None]
    return jnp.einsum("bgrqk->bqgrk", o_BGRQK).reshape(B, blk, H, K), jnp.where(seen, m + jnp.log(l), _NEG)

  o_n, lse_n = jax.lax.map(lambda xs: q_block(*xs), (qb, *qs))
  lse_BGRT = jnp.moveaxis(lse_n, 0, 3).reshape(B, G, R, T)
  return _merge_blocks(o_n), lse_BGRT


def _block_mask(qi_Q, ki_S, segq_BQ, segk_BS, window, causal, has_prefix, has_branch, treeq_BQ, treek_BS):
  """[B, 1, 1, Q, S] mask of a query tile against a key tile (token indices qi_Q, ki_S; tree codes: prefix bit +
  2 * branch)."""
  prefixes = (treeq_BQ & 1, treek_BS & 1) if has_prefix else (None, None)
  branches = (treeq_BQ >> 1, treek_BS >> 1) if has_branch else (None, None)
  return mask_fn(qi_Q, ki_S, segq_BQ, segk_BS, window, causal or has_prefix, *prefixes, *branches)[:, None, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, q_side, k_side, window, blk, causal, has_prefix, has_branch, softcap):
  return flash_forward(q, k, v, q_side, k_side, window, blk, causal, has_prefix, has_branch, softcap)[0].astype(
      q.dtype)


def _flash_fwd(q, k, v, q_side, k_side, window, blk, causal, has_prefix, has_branch, softcap):
  o, lse = flash_forward(q, k, v, q_side, k_side, window, blk, causal, has_prefix, has_branch, softcap)
  o = o.astype(q.dtype)
  return o, (q, k, v, q_side, k_side, window, o, lse)


def _flash_bwd(blk, causal, has_prefix, has_branch, softcap, res, do_BTHK):
  q, k, v, q_side, k_side, window, o, lse_BGRT = res
  d_BGRT = softmax_delta(do_BTHK, o, k.shape[2])
  dq, dk, dv = flash_backward(q, k, v, q_side, k_side, window, lse_BGRT, d_BGRT, do_BTHK, blk, causal, has_prefix,
                              has_branch, softcap)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def softmax_delta(do_BTHK, o_BTHK, num_kv_heads: int) -> jax.Array:
  """D_BGRT = sum_k do * o: the softmax-Jacobian term of the attention backward pass, one number per query row."""
  return jnp.einsum("btgrk,btgrk->bgrt", _group(do_BTHK, num_kv_heads).astype(jnp.float32),
                    _group(o_BTHK, num_kv_heads).astype(jnp.float32))


def flash_backward(q, k, v, q_side, k_side, window, lse_BGRT, d_BGRT, do_BTHK, blk, causal, has_prefix, has_branch,
                   softcap):
  """Gradients (dq, dk, dv, float32) of attention of q against k, v given the rows' final logsumexp lse_BGRT and
  softmax_delta d_BGRT, recomputing the scores tile by tile (hidden tiles skipped). With lse and d of the whole
  key set, the result is this key set's share: summed over disjoint key sets it is the full gradient."""
  B, T, H, K = q.shape
  G = k.shape[2]
  R = H // G
  scale = 1.0 / jnp.sqrt(jnp.float32(K))
  qb, dob = _split_blocks(_group(q, G), blk), _split_blocks(_group(do_BTHK, G), blk)
  lseb = jnp.moveaxis(lse_BGRT.reshape(B, G, R, T // blk, blk), 3, 0)  # [n, B, G, R, blk]
  db = jnp.moveaxis(d_BGRT.reshape(B, G, R, T // blk, blk), 3, 0)
  kb, vb = _split_blocks(k, blk), _split_blocks(v, blk)
  qs, ks = _side_blocks(q_side, blk), _side_blocks(k_side, blk)

  def k_block(dq_acc, xs):
    k_BSGK, v_BSGK, ki_S, segk_BS, treek_BS = xs

    def q_step(carry, xs):
      i, q_BQGRK, do_BQGRK, lse_BGRQ, d_BGRQ, qi_Q, segq_BQ, treeq_BQ = xs

      def compute(carry):
        dk, dv, dq_acc = carry
        s = _scores(q_BQGRK, k_BSGK, scale, softcap)
        mask = _block_mask(qi_Q, ki_S, segq_BQ, segk_BS, window, causal, has_prefix, has_branch, treeq_BQ, treek_BS)
        p = jnp.where(mask, jnp.exp(s - lse_BGRQ[..., None]), 0.0)
        dv = dv + jnp.einsum("bgrqs,bqgrk->bsgk", p, do_BQGRK.astype(jnp.float32))
        dp = jnp.einsum("bqgrk,bsgk->bgrqs", do_BQGRK, v_BSGK, preferred_element_type=jnp.float32)
        ds = p * (dp - d_BGRQ[..., None]) * scale
        if softcap:  # d(c tanh(u / c)) / du = 1 - tanh^2 = 1 - (s / c)^2 of the capped score s
          ds = ds * (1 - jnp.square(s / jnp.float32(softcap)))
        # the query block's dq is added in place: adding a whole [n, ...] stack per key block would move
        # n^2 blocks through memory
        dq_acc = dq_acc.at[i].add(jnp.einsum("bgrqs,bsgk->bqgrk", ds, k_BSGK.astype(jnp.float32)))
        dk = dk + jnp.einsum("bgrqs,bqgrk->bsgk", ds, q_BQGRK.astype(jnp.float32))
        return dk, dv, dq_acc

      visible = _span_visible(qi_Q, ki_S, window, causal)
      return jax.lax.cond(visible, compute, lambda c: c, carry), None

    init = (jnp.zeros((B, blk, G, K), jnp.float32), jnp.zeros((B, blk, G, K), jnp.float32), dq_acc)
    (dk, dv, dq_acc), _ = jax.lax.scan(q_step, init, (jnp.arange(T // blk), qb, dob, lseb, db, *qs))
    return dq_acc, (dk, dv)

  dq0 = jnp.zeros((T // blk, B, blk, G, R, K), jnp.float32)
  dq_n, (dk_n, dv_n) = jax.lax.scan(k_block, dq0, (kb, vb, *ks))
  return _merge_blocks(dq_n).reshape(B, T, H, K), _merge_blocks(dk_n), _merge_blocks(dv_n)


_flash.defvjp(_flash_fwd, _flash_bwd)

IMPLEMENTATIONS = {"xla": xla_attention, "dot_product": dot_product_attention, "blockwise": blockwise_attention,
                   "cudnn": cudnn_attention}


def attend(impl: str, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, block_size: int = 512,
           causal: bool = True, prefix_BT=None, branch_BT=None, query_block: int = 0,
           splash_options: splash_lib.SplashOptions | None = None, softcap: float = 0.0):
  """Dispatches to the implementation named by `model.attention_impl` (`query_block`: `xla_attention`'s;
  `splash_options`: the splash kernel's, model.splash.options(cfg), whose soft_cap must equal `softcap`).

  Splash masks are static, so prefix-LM and tree masks (prefix_BT, branch_BT) run the blockwise kernel instead,
  which says so once. "auto" (models resolve it when built: `resolve_impl`) is `auto_impl` of the platform being
  compiled for and q's dtype and head_dim.
  """
  if impl == "auto":
    impl = auto_impl(splash_lib.target_platform(), q_BTHK.dtype, q_BTHK.shape[-1], softcap)
  if impl == "splash":
    if prefix_BT is None and branch_BT is None:
      opts = splash_options or splash_lib.SplashOptions(soft_cap=float(softcap) if softcap else None)
      if (opts.soft_cap or 0.0) != softcap:
        raise ValueError(f"splash options cap scores at {opts.soft_cap} but model.attn_logit_softcap={softcap}")
      return splash_lib.splash_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, causal, opts)
    report_once("attention_impl=splash: prefix or tree masks are not static block masks; running blockwise "
                 "attention for them", logging.WARNING)
    impl = "blockwise"
  if impl == "blockwise":
    return blockwise_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, block_size, causal, prefix_BT,
                               branch_BT, softcap)
  if impl == "xla":
    return xla_attention(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, causal, prefix_BT, branch_BT, query_block,
                         softcap)
  if softcap:
    raise ValueError(f"model.attn_logit_softcap={softcap} with model.attention_impl={impl!r}: "
                     "jax.nn.dot_product_attention cannot cap scores; use auto, xla, blockwise or splash")
  return IMPLEMENTATIONS[impl](q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, causal, prefix_BT, branch_BT)


CONTEXT_PARALLEL = ("all_gather", "ring", "ulysses")  # model.context_parallel: attention over mesh.sequence


def context_shards(mode: str) -> int:
  """Devices the sequence is split over when `mode` (model.context_parallel) runs ring or Ulysses attention under
  the current mesh; 1 when attention gathers K/V instead (all_gather, or no sequence split)."""
  return axes.mesh_size(LENGTH) if mode != "all_gather" else 1


def kv_length_name(mode: str) -> str:
  """The logical name of K/V's length inside attention: split like the queries' under ring / Ulysses (they move
  by their own collectives), else `kv_length` (gathered onto every device of the sequence axis)."""
  return LENGTH if context_shards(mode) > 1 else KV_LENGTH


def context_attend(mode: str, impl: str, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window=0, block_size: int = 512,
                   causal: bool = True, prefix_BT=None, branch_BT=None, query_block: int = 0,
                   splash_options: splash_lib.SplashOptions | None = None, softcap: float = 0.0, order_T=None):
  """`attend` under model.context_parallel = `mode` over the `sequence` mesh axis (parallel/context.py).

  all_gather (or no sequence split): `attend` with K/V gathered. ring: each device keeps its queries and the K/V
  blocks circle the ring; every ring step runs the blockwise kernel's math (tiles of `block_size`, hidden tiles and
  ring steps skipped). `order_T` (int32 [T], the zigzag layout) gives the token index held at each row position:
  masks compare those indices, so a permuted layout attends as the natural one. ulysses: all-to-all to whole
  sequences of H/n heads, `impl` on each device, all-to-all back (natural order only).
  """
  shards = context_shards(mode)
  if shards == 1:
    return attend(impl, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, block_size, causal, prefix_BT, branch_BT,
                  query_block, splash_options, softcap)
  B, T = segment_ids_BT.shape
  q_spec, kv_spec = axes.spec((BATCH, LENGTH, HEADS, HEAD_DIM)), axes.spec((BATCH, LENGTH, KV_HEADS, HEAD_DIM))
  place = dict(batch=q_spec[0], heads=q_spec[2], kv_heads=kv_spec[2], length=q_spec[1])
  seq_axis = q_spec[1]
  window = jnp.asarray(window, jnp.int32)
  if mode == "ulysses":
    if order_T is not None:
      raise ValueError("model.context_parallel='ulysses' attends in the natural token order; the zigzag layout "
                       "(model.context_layout) is for ring")
    masks = tuple(a for a in (prefix_BT, branch_BT) if a is not None)

    def local(q, k, v, seg, *rest):
      gathered = iter(jax.lax.all_gather(a, seq_axis, axis=1, tiled=True) for a in rest[:-1])
      prefix, branch = (None if a is None else next(gathered) for a in (prefix_BT, branch_BT))
      w = rest[-1]

      def whole(q, k, v, seg):
        with axes.axis_rules(()):  # one device's whole sequences: no mesh inside
          return attend(impl, q, k, v, seg, w, block_size, causal, prefix, branch, query_block, splash_options,
                        softcap)
      return parallel_context.ulysses(whole, q, k, v, seg, axis=seq_axis, shards=shards)

    return kernels.shard_heads(local, q_BTHK, k_BSGK, v_BSGK, segment_ids_BT, window, tokens=masks, **place)
  report_once(f"model.context_parallel='ring': every ring step runs the blockwise kernel's math (tiles of {block_size}); "
              f"model.attention_impl={impl!r} applies where the sequence is not split")
  # Tiles within one contiguous run of tokens (a zigzag device holds two chunks of T / 2n), so that the causal
  # mask can skip whole tiles.
  blk = min(block_size, T // shards if order_T is None else T // (2 * shards))
  order_T = jnp.arange(T, dtype=jnp.int32) if order_T is None else jnp.asarray(order_T, jnp.int32)
  side, flags = token_side(segment_ids_BT, prefix_BT, branch_BT, causal, order_T, T)
  index_BT = jnp.broadcast_to(side[0], (B, T))
  fwd, bwd = _ring_block_fns(blk, *flags, float(softcap))

  def local(q, k, v, seg, index, tree, w):
    own = (index[0], seg, tree, w)
    return parallel_context.ring(fwd, bwd, q, k, v, own, own[:3], axis=seq_axis, shards=shards)

  return kernels.shard_heads(local, q_BTHK, k_BSGK, v_BSGK, side[1], window, tokens=(index_BT, side[2]), **place)


@functools.lru_cache(maxsize=None)
def _ring_block_fns(blk: int, causal: bool, has_prefix: bool, has_branch: bool, softcap: float):
  """The blockwise kernel as ring attention's per-block functions (parallel.context.ring): local queries against
  one visiting K/V block, rows padded to whole tiles of `blk`; a block that no query can see is skipped. Cached
  so that every layer passes the same functions (the ring's custom VJP takes them as static arguments)."""
  flags = (causal, has_prefix, has_branch, softcap)

  def fwd(q, k, v, q_side, k_side):
    b, T, H, _ = q.shape
    Tp, window = -(-T // blk) * blk, q_side[3]
    qs, ks = _pad_side(q_side, Tp), _pad_side(k_side, Tp)

    def compute():
      o, lse_BGRT = flash_forward(*(_pad_to(a, Tp, 1) for a in (q, k, v)), qs, ks, window, blk, *flags)
      return o[:, :T], jnp.transpose(lse_BGRT, (0, 3, 1, 2)).reshape(b, Tp, H)[:, :T]

    skip = lambda: (jnp.zeros(q.shape, jnp.float32), jnp.full((b, T, H), parallel_context.NEG, jnp.float32))
    return jax.lax.cond(_span_visible(q_side[0], k_side[0], window, causal), compute, skip)

  def bwd(q, k, v, q_side, k_side, lse_bTH, delta_bTH, do):
    b, T, H, K = q.shape
    G = k.shape[2]
    Tp, window = -(-T // blk) * blk, q_side[3]
    qs, ks = _pad_side(q_side, Tp), _pad_side(k_side, Tp)
    to_bgrt = lambda a: _pad_to(a, Tp, 1).reshape(b, Tp, G, H // G).transpose(0, 2, 3, 1)

    def compute():
      q_, k_, v_, do_ = (_pad_to(a, Tp, 1) for a in (q, k, v, do))
      grads = flash_backward(q_, k_, v_, qs, ks, window, to_bgrt(lse_bTH), to_bgrt(delta_bTH), do_, blk, *flags)
      return tuple(g[:, :T] for g in grads)

    skip = lambda: tuple(jnp.zeros(a.shape, jnp.float32) for a in (q, k, v))
    return jax.lax.cond(_span_visible(q_side[0], k_side[0], window, causal), compute, skip)

  return fwd, bwd
