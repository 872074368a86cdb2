"""Building blocks: norms, the embedding, attention and the transformer block (parameters with logical names and
the MLP: model/dense.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model import attention as attention_lib
from model import axes
from model import kv_cache
from model import moe as moe_lib
from model import mup
from model import quant as quant_lib
from model import remat
from model import rope
from model import splash as splash_lib
from model.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, KV_LENGTH, LENGTH, VOCAB
from model.config import DTYPES
# In their own module below moe (whose routed and shared experts are built from them); still layers.param etc.
from model.dense import Mlp, _value, param  # noqa: F401  pylint: disable=unused-import


class Norm(nnx.Module):
  """RMSNorm or LayerNorm over the last axis (statistics in float32), pre-norm style."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.kind, self.eps, self.dtype = cfg.norm_type, cfg.norm_eps, DTYPES[cfg.dtype]
    self.scale = param(rngs, (cfg.d_model,), (EMBED,), cfg, "ones")
    self.bias = param(rngs, (cfg.d_model,), (EMBED,), cfg, "zeros") if cfg.use_bias else None

  def __call__(self, x_BLD: jax.Array) -> jax.Array:
    x = x_BLD.astype(jnp.float32)
    if self.kind == "layernorm":
      x = x - x.mean(-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps)
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
  """Multi-head / grouped-query / multi-query self-attention with RoPE; returns the output projection."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.impl, self.block_size, self.dtype = _attention_impl(cfg), cfg.attention_block_size, DTYPES[cfg.dtype]
    self.query_block = cfg.attention_query_block
    self.splash = splash_lib.options(cfg) if self.impl == "splash" else None
    self.q = param(rngs, (D, H, K), (EMBED, HEADS, HEAD_DIM), cfg)
    self.k = param(rngs, (D, G, K), (EMBED, KV_HEADS, HEAD_DIM), cfg)
    self.v = param(rngs, (D, G, K), (EMBED, KV_HEADS, HEAD_DIM), cfg)
    self.o = param(rngs, (H, K, D), (HEADS, HEAD_DIM, EMBED), cfg)
    if cfg.use_bias:
      self.q_bias = param(rngs, (H, K), (HEADS, HEAD_DIM), cfg, "zeros")
      self.k_bias = param(rngs, (G, K), (KV_HEADS, HEAD_DIM), cfg, "zeros")
      self.v_bias = param(rngs, (G, K), (KV_HEADS, HEAD_DIM), cfg, "zeros")
      self.o_bias = param(rngs, (D,), (EMBED,), cfg, "zeros")
    self.use_bias, self.causal = cfg.use_bias, cfg.causal
    self.query_multiplier = mup.query_multiplier(cfg)
    self.quant = cfg.quant if "attn" in cfg.quant_layers else "none"

  def __call__(self, x_BLD, segment_ids_BL, cos_BLF, sin_BLF, window, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None):
    """-> y_BLD, or (y_BLD, this layer's updated cache) when `cache` (one layer's slice) is given; `prefix_BL`
    (1 = bidirectional prefix token) and `branch_BL` (tree attention) apply without a cache (model/attention.py).

    With a cache the L new keys/values are stored at slots [cache.index, cache.index + L). Into a cache known to
    be empty (`kv_cache.is_empty`: a whole prompt) the tokens attend among themselves with `model.attention_impl`,
    exactly as without a cache. Otherwise (a decode step, L == 1, or a chunk of a prompt, L > 1) they attend to
    every cached slot of their row from `cache.start` on and to the new slots up to their own, causally and inside
    the window (`cached_attention`), so a prompt prefilled in chunks gives the logits of one whole pass.
    """
    if cache is not None:
      if not self.causal:
        raise ValueError("model.causal=False (a bidirectional encoder) cannot use a KV cache: its tokens see later "
                         "ones; score it with one forward pass")
      kv_cache.check_room(cache, x_BLD.shape[1])
    dt = self.dtype
    q_BLHK = quant_lib.einsum("bld,dhk->blhk", x_BLD, _value(self.q, dt), self.quant)
    k_BLGK = quant_lib.einsum("bld,dgk->blgk", x_BLD, _value(self.k, dt), self.quant)
    v_BLGK = quant_lib.einsum("bld,dgk->blgk", x_BLD, _value(self.v, dt), self.quant)
    if self.use_bias:
      q_BLHK, k_BLGK = q_BLHK + _value(self.q_bias, dt), k_BLGK + _value(self.k_bias, dt)
      v_BLGK = v_BLGK + _value(self.v_bias, dt)
    q_BLHK = rope.apply(q_BLHK, cos_BLF, sin_BLF)
    if self.query_multiplier != 1.0:  # muP: scores q.k / head_dim
      q_BLHK = q_BLHK * jnp.asarray(self.query_multiplier, q_BLHK.dtype)
    k_BLGK = rope.apply(k_BLGK, cos_BLF, sin_BLF)
    q_BLHK = remat.tag(axes.constrain(q_BLHK, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.QUERY_PROJ)
    # K/V on `kv_length`: under sequence parallelism they are gathered while queries stay sharded.
    k_BLGK = remat.tag(axes.constrain(k_BLGK, (BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM)), remat.KEY_PROJ)
    v_BLGK = remat.tag(axes.constrain(v_BLGK, (BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM)), remat.VALUE_PROJ)
    cached = cache is not None and not kv_cache.is_empty(cache)  # decided at trace time (see kv_cache)
    if cache is not None:
      cache = kv_cache.write(cache, k_BLGK, v_BLGK)
    if cached:
      o_BLHK = attention_lib.cached_attention(q_BLHK, cache.k, cache.v, cache.index, cache.start, window)
    else:
      o_BLHK = attention_lib.attend(self.impl, q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, window, self.block_size,
                                    self.causal, prefix_BL, branch_BL, self.query_block, self.splash)
    o_BLHK = remat.tag(axes.constrain(o_BLHK, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.ATTN_CONTEXT)
    y_BLD = quant_lib.einsum("blhk,hkd->bld", o_BLHK, _value(self.o, dt), self.quant)
    if self.use_bias:
      y_BLD = y_BLD + _value(self.o_bias, dt)
    y_BLD = remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.ATTN_OUT)
    return y_BLD if cache is None else (y_BLD, cache)


class Block(nnx.Module):
  """One pre-norm layer: sequential x += attn(norm x); x += mlp(norm x), or parallel x + attn(n x) + mlp(n x)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, moe: bool = False):
    self.parallel = cfg.block_type == "parallel"
    self.attn_norm = Norm(cfg, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    if not self.parallel:
      self.mlp_norm = Norm(cfg, rngs=rngs)
    if moe:  # a Mixture-of-Experts feed-forward (model/moe.py) in place of the MLP
      self.moe = moe_lib.MoE(cfg, rngs=rngs)
    else:
      self.mlp = Mlp(cfg, rngs=rngs)

  def __call__(self, x_BLD, segment_ids_BL, cos_BLF, sin_BLF, window, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None):
    """-> (x_BLD, stats), or (x_BLD, updated layer cache) when `cache` is given (see Attention).

    stats are the MoE layer's router statistics (model.moe.router_stats), {} for a dense block; decoding with a
    cache drops them.
    """
    if cache is not None and x_BLD.shape[1] > 1 and not kv_cache.is_empty(cache) and self._capacity_limited():
      # Expert capacity is per call (ceil(capacity_factor * k * L / E)): a chunk would drop other tokens than one
      # whole prefill does, so its results would differ from the same prompt in one pass.
      raise ValueError("model.capacity_factor > 0 (capacity-limited MoE) cannot prefill a prompt in chunks through "
                       "a filled KV cache; prefill it in one call into an empty cache, or use capacity_factor=0 "
                       "(dropless)")
    h_BLD = self.attn_norm(x_BLD)
    if cache is None:
      attn_BLD = self.attn(h_BLD, segment_ids_BL, cos_BLF, sin_BLF, window, prefix_BL=prefix_BL, branch_BL=branch_BL)
    else:
      attn_BLD, cache = self.attn(h_BLD, segment_ids_BL, cos_BLF, sin_BLF, window, cache)
    stats = {}
    if self.parallel:
      x_BLD = x_BLD + attn_BLD + self.mlp(h_BLD)
    else:
      x_BLD = x_BLD + attn_BLD
      if hasattr(self, "moe"):
        y_BLD, stats = self.moe(self.mlp_norm(x_BLD), segment_ids_BL > 0)
      else:
        y_BLD = self.mlp(self.mlp_norm(x_BLD))
      x_BLD = x_BLD + y_BLD
    x_BLD = axes.constrain(x_BLD, (BATCH, LENGTH, EMBED))
    return (x_BLD, stats) if cache is None else (x_BLD, cache)

  def _capacity_limited(self) -> bool:
    return hasattr(self, "moe") and self.moe.cf > 0


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` is the tied output projection."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dtype = DTYPES[cfg.dtype]
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), cfg)

  def __call__(self, tokens_BL) -> jax.Array:
    x_BLD = jnp.take(_value(self.embedding, self.dtype), tokens_BL, axis=0)
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

  def __call__(self, x_BLD, segment_ids_BL, cos_BLF, sin_BLF, windows_U, cache: kv_cache.KVCache | None = None,
               prefix_BL=None, branch_BL=None):
    """-> (x_BLD, the MoE block's stats), or (x_BLD, updated cache) when `cache` (k/v: [moe_every, ...]) is given."""
    stats, ks, vs = {}, [], []
    for j, block in enumerate(self.blocks):
      if cache is None:
        x_BLD, block_stats = block(x_BLD, segment_ids_BL, cos_BLF, sin_BLF, windows_U[j], prefix_BL=prefix_BL,
                                   branch_BL=branch_BL)
        stats = block_stats or stats
      else:
        x_BLD, layer = block(x_BLD, segment_ids_BL, cos_BLF, sin_BLF, windows_U[j],
                             cache._replace(k=cache.k[j], v=cache.v[j]))
        ks.append(layer.k)
        vs.append(layer.v)
    return (x_BLD, stats) if cache is None else (x_BLD, cache._replace(k=jnp.stack(ks), v=jnp.stack(vs)))
