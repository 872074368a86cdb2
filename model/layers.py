"""Building blocks: norms, the embedding, attention and the transformer block (parameters with logical names and
the MLP: model/dense.py).

cos, sin (RoPE) reach the blocks as `model.rope.tables` makes them: [B, L, K/2], or [2, B, L, K/2] (global and
local sets, model.rope_local_theta), of which Attention takes its layer's with `rope.for_window`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import attention as attention_lib
from model import axes
from model import kv_cache
from model import moe as moe_lib
from model import mup
from model import paged
from model import quant as quant_lib
from model import remat
from model import rope
from model import splash as splash_lib
from model.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, KV_LENGTH, LENGTH, VOCAB
from model.config import DTYPES
# In their own module below moe (whose routed and shared experts are built from them); still layers.param etc.
from model.dense import Mlp, _value, param  # noqa: F401  pylint: disable=unused-import


class Norm(nnx.Module):
  """RMSNorm or LayerNorm over the trailing axes its scale covers (statistics in float32).

  Default: the block and final norms, scale [d_model] on `embed`, model.norm_type, a bias with model.use_bias.
  `shape`/`names` give another scale (the q/k norms of model.qk_norm: [K] on head_dim, or [H, K] over a whole
  projection); `rms=True` makes it RMSNorm without bias whatever norm_type says. With model.norm_offset the scale
  enters as (1 + scale) and starts at 0, multiplied in float32 before the cast (Gemma's RMSNorm); otherwise the
  normalised input is cast first and multiplied in the compute dtype (Llama's).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, shape: tuple[int, ...] | None = None, names=(EMBED,),
               rms: bool = False, eps: float | None = None):
    self.kind, self.dtype = "rmsnorm" if rms else cfg.norm_type, DTYPES[cfg.dtype]
    self.eps = cfg.norm_eps if eps is None else eps
    shape = (cfg.d_model,) if shape is None else tuple(shape)
    self.over, self.offset = tuple(range(-len(shape), 0)), cfg.norm_offset  # the axes normalised
    self.scale = param(rngs, shape, names, cfg, "zeros" if cfg.norm_offset else "ones")
    self.bias = param(rngs, shape, names, cfg, "zeros") if cfg.use_bias and not rms else None

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., *scale shape] (x_BLD for the block norms) -> normalised, in the compute dtype."""
    x = x.astype(jnp.float32)
    if self.kind == "layernorm":
      x = x - x.mean(self.over, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, self.over, keepdims=True) + self.eps)
    if self.offset:
      y = (x * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)
    else:
      y = x.astype(self.dtype) * _value(self.scale, self.dtype)
    if self.bias is not None:
      y = y + _value(self.bias, self.dtype)
    return y


def _attention_impl(cfg) -> str:
  """model.attention_impl, with "auto" resolved for the platform the model is built for (the current mesh's, else
  the default backend; model.attention.resolve_impl), which is logged once."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  platform = splash_lib.target_platform()
  impl = attention_lib.resolve_impl(cfg, platform)
  attention_lib.report_once(f"model.attention_impl=auto: {impl} on {platform} ({cfg.dtype})")
  return impl


class Attention(nnx.Module):
  """Multi-head / grouped-query / multi-query self-attention with RoPE; returns the output projection.

  q, k, v projections (+ biases with model.use_bias or model.qkv_bias) -> q/k norms (model.qk_norm) -> RoPE
  (the layer's set of cos/sin) -> attention with scores scaled by 1/sqrt(head_dim), or 1/sqrt(query_pre_attn_scalar),
  soft-capped with model.attn_logit_softcap -> output projection.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.impl, self.block_size, self.dtype = _attention_impl(cfg), cfg.attention_block_size, DTYPES[cfg.dtype]
    self.query_block, self.context = cfg.attention_query_block, cfg.context_parallel
    self.splash = splash_lib.options(cfg) if self.impl == "splash" else None
    self.q = param(rngs, (D, H, K), (EMBED, HEADS, HEAD_DIM), cfg)
    self.k = param(rngs, (D, G, K), (EMBED, KV_HEADS, HEAD_DIM), cfg)
    self.v = param(rngs, (D, G, K), (EMBED, KV_HEADS, HEAD_DIM), cfg)
    self.o = param(rngs, (H, K, D), (HEADS, HEAD_DIM, EMBED), cfg)
    self.qkv_bias = cfg.use_bias or cfg.qkv_bias
    if self.qkv_bias:
      self.q_bias = param(rngs, (H, K), (HEADS, HEAD_DIM), cfg, "zeros")
      self.k_bias = param(rngs, (G, K), (KV_HEADS, HEAD_DIM), cfg, "zeros")
      self.v_bias = param(rngs, (G, K), (KV_HEADS, HEAD_DIM), cfg, "zeros")
    if cfg.use_bias:
      self.o_bias = param(rngs, (D,), (EMBED,), cfg, "zeros")
    if cfg.qk_norm == "head":  # one [K] scale shared by the heads (Qwen3, Gemma 3)
      self.q_norm = Norm(cfg, rngs=rngs, shape=(K,), names=(HEAD_DIM,), rms=True)
      self.k_norm = Norm(cfg, rngs=rngs, shape=(K,), names=(HEAD_DIM,), rms=True)
    elif cfg.qk_norm == "proj":  # statistics over the whole projection (OLMo 2)
      self.q_norm = Norm(cfg, rngs=rngs, shape=(H, K), names=(HEADS, HEAD_DIM), rms=True)
      self.k_norm = Norm(cfg, rngs=rngs, shape=(G, K), names=(KV_HEADS, HEAD_DIM), rms=True)
    self.use_bias, self.causal, self.qk_norm = cfg.use_bias, cfg.causal, cfg.qk_norm != "none"
    self.softcap = float(cfg.attn_logit_softcap)
    # The kernels scale scores by 1/sqrt(K): a factor on q turns that into muP's 1/K or 1/sqrt(query_pre_attn_scalar).
    scalar = cfg.query_pre_attn_scalar
    self.query_multiplier = mup.query_multiplier(cfg) * (math.sqrt(K / scalar) if scalar else 1.0)
    self.quant = cfg.quant if "attn" in cfg.quant_layers else "none"

  def __call__(self, x_BLD, segment_ids_BL, cos, sin, window, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None, order_L=None):
    """-> y_BLD, or (y_BLD, this layer's updated cache) when `cache` (one layer's slice) is given; `prefix_BL`
    (1 = bidirectional prefix token) and `branch_BL` (tree attention) apply without a cache (model/attention.py).
    Without a cache, attention crosses a split sequence by model.context_parallel; `order_L` (int32 [L]) is the
    token index at each row position when the rows are in the ring's balanced layout (None: natural order).
    cos, sin: `rope.tables` (this layer's set is picked by its window, which may be traced).

    With a cache the L new keys/values are stored at slots [cache.index, cache.index + L). Into a cache known to
    be empty (`kv_cache.is_empty`: a whole prompt) the tokens attend among themselves with `model.attention_impl`,
    exactly as without a cache. Otherwise (a decode step, L == 1, or a chunk of a prompt, L > 1) they attend to
    every cached slot of their row from `cache.start` on and to the new slots up to their own, causally and inside
    the window (`cached_attention`), so a prompt prefilled in chunks gives the logits of one whole pass.
    """
    paged_cache = isinstance(cache, paged.PagedKVCache)
    if cache is not None:
      if not self.causal:
        raise ValueError("model.causal=False (a bidirectional encoder) cannot use a KV cache: its tokens see later "
                         "ones; score it with one forward pass")
      if not paged_cache:
        kv_cache.check_room(cache, x_BLD.shape[1])
    dt = self.dtype
    q_BLHK = quant_lib.einsum("bld,dhk->blhk", x_BLD, _value(self.q, dt), self.quant)
    k_BLGK = quant_lib.einsum("bld,dgk->blgk", x_BLD, _value(self.k, dt), self.quant)
    v_BLGK = quant_lib.einsum("bld,dgk->blgk", x_BLD, _value(self.v, dt), self.quant)
    if self.qkv_bias:
      q_BLHK, k_BLGK = q_BLHK + _value(self.q_bias, dt), k_BLGK + _value(self.k_bias, dt)
      v_BLGK = v_BLGK + _value(self.v_bias, dt)
    if self.qk_norm:
      q_BLHK, k_BLGK = self.q_norm(q_BLHK), self.k_norm(k_BLGK)
    cos_BLF, sin_BLF = rope.for_window(cos, sin, window)
    m = self.query_multiplier  # muP (q.k / head_dim) or query_pre_attn_scalar: on the float32 rotation of q, so
    # that a factor like sqrt(128/144) is not rounded to bfloat16 first
    q_BLHK = rope.apply(q_BLHK, cos_BLF * m, sin_BLF * m) if m != 1.0 else rope.apply(q_BLHK, cos_BLF, sin_BLF)
    k_BLGK = rope.apply(k_BLGK, cos_BLF, sin_BLF)
    q_BLHK = remat.tag(axes.constrain(q_BLHK, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.QUERY_PROJ)
    # K/V on `kv_length` (gathered while queries stay sharded under sequence parallelism), or split like the
    # queries when ring / Ulysses attention moves them itself.
    kv_len = KV_LENGTH if cache is not None else attention_lib.kv_length_name(self.context)
    k_BLGK = remat.tag(axes.constrain(k_BLGK, (BATCH, kv_len, KV_HEADS, HEAD_DIM)), remat.KEY_PROJ)
    v_BLGK = remat.tag(axes.constrain(v_BLGK, (BATCH, kv_len, KV_HEADS, HEAD_DIM)), remat.VALUE_PROJ)
    if paged_cache:  # the engine's pages (model/paged.py): write the call's tokens, attend over their sequences
      cache = paged.write(cache, k_BLGK, v_BLGK, segment_ids_BL)
      o_BLHK = paged.attend(q_BLHK, cache, window, self.softcap)
    elif cache is not None and not kv_cache.is_empty(cache):  # decided at trace time (see kv_cache)
      cache = kv_cache.write(cache, k_BLGK, v_BLGK)
      o_BLHK = attention_lib.cached_attention(q_BLHK, cache.k, cache.v, cache.index, cache.start, window,
                                              self.softcap)
    else:
      if cache is not None:
        cache = kv_cache.write(cache, k_BLGK, v_BLGK)
      context = self.context if cache is None else "all_gather"  # a prompt into a cache: K/V gathered for it
      o_BLHK = attention_lib.context_attend(context, self.impl, q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, window,
                                            self.block_size, self.causal, prefix_BL, branch_BL, self.query_block,
                                            self.splash, self.softcap, order_L)
    o_BLHK = remat.tag(axes.constrain(o_BLHK, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.ATTN_CONTEXT)
    y_BLD = quant_lib.einsum("blhk,hkd->bld", o_BLHK, _value(self.o, dt), self.quant)
    if self.use_bias:
      y_BLD = y_BLD + _value(self.o_bias, dt)
    y_BLD = remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.ATTN_OUT)
    return y_BLD if cache is None else (y_BLD, cache)


MLA_NORM_EPS = 1e-6  # the latents' RMSNorm epsilon: DeepSeek's code builds them with the default, not rms_norm_eps


class LatentAttention(nnx.Module):
  """Multi-head Latent Attention (DeepSeek-V2 sec. 2.1, V3): model.attention_type='mla'.

  Shapes: N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim, C = kv_lora_rank, Q = q_lora_rank.
    q      = x @ q [D, H, N+R], or q_b(RMSNorm(x @ q_a [D, Q])) with q_b [Q, H, N+R] when Q > 0
    latent = RMSNorm((x @ kv_a)[:C]),  k_rot = RoPE((x @ kv_a)[C:])   kv_a [D, C+R]: one RoPE key for all heads
    [k_nope, v] = latent @ kv_b [C, H, N+V];  k = [k_nope, k_rot];  q = [q_nope, RoPE(q_rot)]
    y = attention(q, k, v) @ o [H, V, D], scores scaled by 1/sqrt(N+R) (times YaRN's mscale^2 with
    model.rope_mscale_all_dim)
  model.rope_interleave: the checkpoint's rotated dimensions are interleaved pairs, de-interleaved before RoPE.
  The KV cache holds (latent, k_rot) (model.kv_cache); decoding through it uses the absorbed products
  (`attention.latent_cached_attention`), so K and V are never expanded for the cached slots.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, H = cfg.d_model, cfg.num_heads
    N, R, V, C, Q = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank,
                     cfg.q_lora_rank)
    self.dims, self.dtype = (N, R, V, C), DTYPES[cfg.dtype]
    self.impl, self.block_size = _attention_impl(cfg), cfg.attention_block_size
    self.query_block, self.softcap = cfg.attention_query_block, float(cfg.attn_logit_softcap)
    self.context = cfg.context_parallel
    self.splash = splash_lib.options(cfg) if self.impl == "splash" else None
    if Q:
      self.q_a = param(rngs, (D, Q), (EMBED, None), cfg)
      self.q_a_norm = Norm(cfg, rngs=rngs, shape=(Q,), names=(None,), rms=True, eps=MLA_NORM_EPS)
      self.q_b = param(rngs, (Q, H, N + R), (None, HEADS, HEAD_DIM), cfg)
    else:
      self.q = param(rngs, (D, H, N + R), (EMBED, HEADS, HEAD_DIM), cfg)
    self.kv_a = param(rngs, (D, C + R), (EMBED, None), cfg)
    self.kv_a_norm = Norm(cfg, rngs=rngs, shape=(C,), names=(None,), rms=True, eps=MLA_NORM_EPS)
    self.kv_b = param(rngs, (C, H, N + V), (None, HEADS, HEAD_DIM), cfg)
    self.o = param(rngs, (H, V, D), (HEADS, HEAD_DIM, EMBED), cfg)
    self.interleave = cfg.rope_interleave
    mscale = 1.0
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim and cfg.rope_scaling_factor > 1:
      mscale = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_scaling_factor) + 1.0
    self.score_multiplier = mscale * mscale * mup.query_multiplier(cfg)

  def _rotate(self, x_BLNR, cos_BLF, sin_BLF):
    if self.interleave:  # pairs (x0, x1), (x2, x3), ... -> halves [x0, x2, ...], [x1, x3, ...]
      x_BLNR = jnp.concatenate([x_BLNR[..., 0::2], x_BLNR[..., 1::2]], axis=-1)
    return rope.apply(x_BLNR, cos_BLF, sin_BLF)

  def __call__(self, x_BLD, segment_ids_BL, cos, sin, window, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None, order_L=None):
    """As `Attention.__call__`: -> y_BLD, or (y_BLD, the layer's updated cache of latents and RoPE keys)."""
    paged_cache = isinstance(cache, paged.PagedKVCache)
    if cache is not None and not paged_cache:
      kv_cache.check_room(cache, x_BLD.shape[1])
    dt, (N, R, V, C) = self.dtype, self.dims
    if hasattr(self, "q"):
      q_BLHK = quant_lib.einsum("bld,dhk->blhk", x_BLD, _value(self.q, dt), "none")
    else:
      q_BLQ = self.q_a_norm(jnp.einsum("bld,dq->blq", x_BLD, _value(self.q_a, dt)))
      q_BLHK = jnp.einsum("blq,qhk->blhk", q_BLQ, _value(self.q_b, dt))
    ckv_BLX = jnp.einsum("bld,dx->blx", x_BLD, _value(self.kv_a, dt))
    latent_BLC = self.kv_a_norm(ckv_BLX[..., :C])
    cos_BLF, sin_BLF = rope.for_window(cos, sin, window)
    q_nope_BLHN, q_rot_BLHR = q_BLHK[..., :N], self._rotate(q_BLHK[..., N:], cos_BLF, sin_BLF)
    k_rot_BL1R = self._rotate(ckv_BLX[..., None, C:], cos_BLF, sin_BLF)
    kv_b = _value(self.kv_b, dt)
    scale = self.score_multiplier / math.sqrt(N + R)
    if paged_cache:  # the engine's pages hold the latents and RoPE keys (model/paged.py)
      cache = paged.write(cache, latent_BLC[:, :, None], k_rot_BL1R, segment_ids_BL)
      o_BLHV = paged.latent_attend(q_nope_BLHN, q_rot_BLHR, cache, kv_b[..., :N], kv_b[..., N:], window, scale,
                                   self.softcap)
    elif cache is not None and not kv_cache.is_empty(cache):  # decided at trace time (see kv_cache)
      cache = kv_cache.write(cache, latent_BLC[:, :, None], k_rot_BL1R)
      o_BLHV = attention_lib.latent_cached_attention(q_nope_BLHN, q_rot_BLHR, cache.k[:, :, 0], cache.v[:, :, 0],
                                                     kv_b[..., :N], kv_b[..., N:], cache.index, cache.start, window,
                                                     scale, self.softcap)
    else:
      if cache is not None:
        cache = kv_cache.write(cache, latent_BLC[:, :, None], k_rot_BL1R)
      o_BLHV = self._expanded(q_nope_BLHN, q_rot_BLHR, latent_BLC, k_rot_BL1R, kv_b, segment_ids_BL, window,
                              prefix_BL, branch_BL, cache is None, order_L)
    o_BLHV = remat.tag(axes.constrain(o_BLHV, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.ATTN_CONTEXT)
    y_BLD = quant_lib.einsum("blhv,hvd->bld", o_BLHV, _value(self.o, dt), "none")
    y_BLD = remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.ATTN_OUT)
    return y_BLD if cache is None else (y_BLD, cache)

  def _expanded(self, q_nope_BLHN, q_rot_BLHR, latent_BLC, k_rot_BL1R, kv_b, segment_ids_BL, window, prefix_BL,
                branch_BL, uncached: bool = True, order_L=None):
    """Attention over per-head keys and values expanded from the latent (training, and a prompt into an empty
    cache), with `model.attention_impl`. The kernels take one width for q, k and v: the narrower side is padded
    with zeros (values: sliced off after; queries/keys: the score scale corrected), which adds no rounding."""
    N, R, V, _ = self.dims
    kv_BLHX = jnp.einsum("blc,chx->blhx", latent_BLC, kv_b)
    H = kv_BLHX.shape[2]
    k_BLHK = jnp.concatenate([kv_BLHX[..., :N], jnp.broadcast_to(k_rot_BL1R, (*k_rot_BL1R.shape[:2], H, R))], -1)
    q_BLHK = jnp.concatenate([q_nope_BLHN, q_rot_BLHR.astype(q_nope_BLHN.dtype)], -1)
    v_BLHV = kv_BLHX[..., N:]
    W = max(N + R, V)
    m = self.score_multiplier * math.sqrt(W / (N + R))  # the kernels divide by sqrt(W)
    pad = lambda a: a if a.shape[-1] == W else jnp.pad(a, [(0, 0)] * 3 + [(0, W - a.shape[-1])])
    q_BLHK = q_BLHK * jnp.asarray(m, q_BLHK.dtype) if m != 1.0 else q_BLHK
    q_BLHK = remat.tag(axes.constrain(pad(q_BLHK), (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.QUERY_PROJ)
    context = self.context if uncached else "all_gather"  # a prompt into a cache: K/V for the cache, gathered
    kv_len = attention_lib.kv_length_name(context)
    k_BLHK = remat.tag(axes.constrain(pad(k_BLHK), (BATCH, kv_len, HEADS, HEAD_DIM)), remat.KEY_PROJ)
    v_BLHK = remat.tag(axes.constrain(pad(v_BLHV), (BATCH, kv_len, HEADS, HEAD_DIM)), remat.VALUE_PROJ)
    o_BLHK = attention_lib.context_attend(context, self.impl, q_BLHK, k_BLHK, v_BLHK, segment_ids_BL, window,
                                          self.block_size, True, prefix_BL, branch_BL, self.query_block, self.splash,
                                          self.softcap, order_L)
    return o_BLHK[..., :V]


class Block(nnx.Module):
  """One layer: sequential x += attn(norm x); x += mlp(norm x), or parallel x + attn(n x) + mlp(n x).

  model.norm_position places the norms of each sublayer f (attention, then MLP or MoE): pre x + f(norm x) (norms
  `attn_norm`, `mlp_norm`), sandwich x + post_norm(f(norm x)) (adds `attn_post_norm`, `mlp_post_norm`; Gemma 2/3),
  post x + post_norm(f(x)) (only the post norms; OLMo 2). Parallel blocks are pre-norm only.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs, moe: bool = False):
    self.parallel = cfg.block_type == "parallel"
    pre, post = cfg.norm_position != "post", cfg.norm_position != "pre"
    if pre:
      self.attn_norm = Norm(cfg, rngs=rngs)
    self.attn = LatentAttention(cfg, rngs=rngs) if cfg.attention_type == "mla" else Attention(cfg, rngs=rngs)
    if not self.parallel and pre:
      self.mlp_norm = Norm(cfg, rngs=rngs)
    if moe:  # a Mixture-of-Experts feed-forward (model/moe.py) in place of the MLP
      self.moe = moe_lib.MoE(cfg, rngs=rngs)
    else:
      self.mlp = Mlp(cfg, rngs=rngs)
    if post:
      self.attn_post_norm = Norm(cfg, rngs=rngs)
      self.mlp_post_norm = Norm(cfg, rngs=rngs)

  def _norm(self, name: str, x_BLD):
    """The norm `name` applied to x_BLD, or x_BLD itself where model.norm_position has no such norm."""
    return getattr(self, name)(x_BLD) if hasattr(self, name) else x_BLD

  def __call__(self, x_BLD, segment_ids_BL, cos, sin, window, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None, order_L=None):
    """-> (x_BLD, stats), or (x_BLD, updated layer cache) when `cache` is given (see Attention; cos, sin:
    `rope.tables`; order_L: the ring's token layout).

    stats are the MoE layer's router statistics (model.moe.router_stats), {} for a dense block; decoding with a
    cache drops them.
    """
    if cache is not None and x_BLD.shape[1] > 1 and not kv_cache.is_empty(cache) and self._capacity_limited():
      # Expert capacity is per call (ceil(capacity_factor * k * L / E)): a chunk would drop other tokens than one
      # whole prefill does, so its results would differ from the same prompt in one pass.
      raise ValueError("model.capacity_factor > 0 (capacity-limited MoE) cannot prefill a prompt in chunks through "
                       "a filled KV cache; prefill it in one call into an empty cache, or use capacity_factor=0 "
                       "(dropless)")
    if cache is None:  # every use of the input reads the tagged copy, so an offloading policy moves the only copy
      x_BLD = remat.tag(x_BLD, remat.LAYER_INPUT)
    h_BLD = self._norm("attn_norm", x_BLD)
    if cache is None:
      attn_BLD = self.attn(h_BLD, segment_ids_BL, cos, sin, window, prefix_BL=prefix_BL, branch_BL=branch_BL,
                           order_L=order_L)
    else:
      attn_BLD, cache = self.attn(h_BLD, segment_ids_BL, cos, sin, window, cache)
    attn_BLD = self._norm("attn_post_norm", attn_BLD)
    stats = {}
    if self.parallel:
      x_BLD = x_BLD + attn_BLD + self.mlp(h_BLD)
    else:
      x_BLD = x_BLD + attn_BLD
      h_BLD = self._norm("mlp_norm", x_BLD)
      if hasattr(self, "moe"):
        y_BLD, stats = self.moe(h_BLD, segment_ids_BL > 0)
      else:
        y_BLD = self.mlp(h_BLD)
      x_BLD = x_BLD + self._norm("mlp_post_norm", y_BLD)
    x_BLD = axes.constrain(x_BLD, (BATCH, LENGTH, EMBED))
    return (x_BLD, stats) if cache is None else (x_BLD, cache)

  def _capacity_limited(self) -> bool:
    return hasattr(self, "moe") and self.moe.cf > 0


class MultiTokenHead(nnx.Module):
  """One multi-token-prediction module (DeepSeek-V3 sec. 2.2), depth d of model.mtp_depth.

  h'_i = [RMSNorm(Emb(t_{i+d})), RMSNorm(h_i)] @ proj [2, D, D] (the embedding of the token d places ahead beside
  the previous depth's representation h_i, the main model's for d = 1; DeepSeek's eh_proj takes them in this
  order), then one transformer block (MoE when the
  model has experts) and its own final norm; the model's output projection turns it into the logits of token
  t_{i+d+1}. `head(h_BLD, e_BLD, segment_ids_BL, cos, sin, window) -> (h_BLD for the next depth, normed x_BLD, the
  block's MoE statistics ({} when dense))`; with a `cache` (the block's one layer: the engine's MTP drafts), the
  updated cache in place of the statistics.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.hnorm, self.enorm = Norm(cfg, rngs=rngs), Norm(cfg, rngs=rngs)
    self.proj = param(rngs, (2, cfg.d_model, cfg.d_model), (None, EMBED, None), cfg)
    self.block = Block(cfg, rngs=rngs, moe=bool(cfg.num_experts))
    self.norm = Norm(cfg, rngs=rngs)
    self.dtype = DTYPES[cfg.dtype]

  def __call__(self, h_BLD, e_BLD, segment_ids_BL, cos, sin, window, cache=None):
    proj = _value(self.proj, self.dtype)
    x_BLD = (jnp.einsum("bld,de->ble", self.enorm(e_BLD), proj[0])
             + jnp.einsum("bld,de->ble", self.hnorm(h_BLD), proj[1]))
    x_BLD = axes.constrain(x_BLD, (BATCH, LENGTH, EMBED))
    if cache is None:
      x_BLD, stats = self.block(x_BLD, segment_ids_BL, cos, sin, window)
    else:
      x_BLD, stats = self.block(x_BLD, segment_ids_BL, cos, sin, window, cache)
    return x_BLD, self.norm(x_BLD), stats


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` is the tied output projection (of the unscaled table).

  With model.embed_scale the looked-up rows are multiplied by sqrt(d_model), rounded to float32 and then to the
  compute dtype first, as Gemma's `normalizer` (in bfloat16 sqrt(3072) becomes 55.5).
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = DTYPES[cfg.dtype]
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), cfg)
    self.scale = float(np.float32(math.sqrt(cfg.d_model))) if cfg.embed_scale else None

  def __call__(self, tokens_BL) -> jax.Array:
    x_BLD = jnp.take(_value(self.embedding, self.dtype), tokens_BL, axis=0)
    if self.scale is not None:
      x_BLD = x_BLD * jnp.asarray(np.float32(self.scale)).astype(self.dtype)
    return axes.constrain(x_BLD, (BATCH, LENGTH, EMBED))

  def attend(self, x_BLD) -> jax.Array:
    return quant_lib.project("bld,dv->blv", x_BLD, _value(self.embedding, self.dtype).T,
                             preferred_element_type=jnp.float32)


class LayerGroup(nnx.Module):
  """moe_every consecutive blocks, the last one MoE: the unit the layer scan repeats when moe_every > 1, so that
  compile time stays independent of depth. `group(x, ..., windows_U) -> (x, the MoE block's stats)`."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    n = cfg.moe_every
    self.blocks = nnx.List([Block(cfg, rngs=rngs, moe=j == n - 1) for j in range(n)])

  def __call__(self, x_BLD, segment_ids_BL, cos, sin, windows_U, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None, order_L=None):
    """-> (x_BLD, the MoE block's stats), or (x_BLD, updated cache) when `cache` (k/v: [moe_every, ...]) is given."""
    stats, ks, vs = {}, [], []
    indices_U = getattr(cache, "layer", None)
    for j, block in enumerate(self.blocks):
      if cache is None:
        x_BLD, block_stats = block(x_BLD, segment_ids_BL, cos, sin, windows_U[j], prefix_BL=prefix_BL,
                                   branch_BL=branch_BL, order_L=order_L)
        stats = block_stats or stats
      elif indices_U is not None:  # a paged cache: all the pools and the unit's layer indices [unit]
        x_BLD, cache = block(x_BLD, segment_ids_BL, cos, sin, windows_U[j], cache._replace(layer=indices_U[j]))
      else:
        x_BLD, layer = block(x_BLD, segment_ids_BL, cos, sin, windows_U[j],
                             cache._replace(k=cache.k[j], v=cache.v[j]))
        ks.append(layer.k)
        vs.append(layer.v)
    if cache is None:
      return x_BLD, stats
    return x_BLD, (cache._replace(k=jnp.stack(ks), v=jnp.stack(vs)) if ks else cache)
