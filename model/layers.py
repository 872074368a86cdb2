"""Building blocks: parameters with logical names, norms, the embedding, attention and the MLP."""
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
from model.axes import BATCH, EMBED, HEAD_DIM, HEADS, KV_HEADS, KV_LENGTH, LENGTH, MLP, VOCAB
from model.config import DTYPES


def param(rngs: nnx.Rngs, shape, names, cfg, init: str = "normal") -> nnx.Param:
  """A parameter of `shape` in cfg.param_dtype with logical axis `names`; init normal(init_std) | zeros | ones
  (under muP the normal's std depends on the kind of parameter: model/mup.py)."""
  inits = {"normal": nnx.initializers.normal(mup.init_std(cfg, names)), "zeros": nnx.initializers.zeros,
           "ones": nnx.initializers.ones}
  make = axes.param_init(inits[init], names)
  return nnx.Param(make(rngs.params(), tuple(shape), DTYPES[cfg.param_dtype]))


def _value(p: nnx.Param, dtype) -> jax.Array:
  return p[...].astype(dtype)


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


class Attention(nnx.Module):
  """Multi-head / grouped-query / multi-query self-attention with RoPE; returns the output projection."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.impl, self.block_size, self.dtype = cfg.attention_impl, cfg.attention_block_size, DTYPES[cfg.dtype]
    self.query_block = cfg.attention_query_block
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

    With a cache the L new keys/values are stored at slots [cache.index, cache.index + L). L == 1 is a decode
    step: the token attends to the cached slots (`cached_attention`). L > 1 is a prefill into an empty cache
    (index 0): the tokens attend among themselves with `model.attention_impl`, exactly as without a cache.
    """
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
    if cache is not None:
      cache = kv_cache.write(cache, k_BLGK, v_BLGK)
    if cache is not None and q_BLHK.shape[1] == 1:
      o_BLHK = attention_lib.cached_attention(q_BLHK, cache.k, cache.v, cache.index, cache.start, window)
    else:
      o_BLHK = attention_lib.attend(self.impl, q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, window, self.block_size,
                                    self.causal, prefix_BL, branch_BL, self.query_block)
    o_BLHK = remat.tag(axes.constrain(o_BLHK, (BATCH, LENGTH, HEADS, HEAD_DIM)), remat.ATTN_CONTEXT)
    y_BLD = quant_lib.einsum("blhk,hkd->bld", o_BLHK, _value(self.o, dt), self.quant)
    if self.use_bias:
      y_BLD = y_BLD + _value(self.o_bias, dt)
    y_BLD = remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.ATTN_OUT)
    return y_BLD if cache is None else (y_BLD, cache)


class Mlp(nnx.Module):
  """Feed-forward block: swiglu down(silu(gate x) * up x), geglu (gelu gate), or gelu down(gelu(up x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, F = cfg.d_model, cfg.mlp_dim
    self.kind, self.dtype, self.use_bias = cfg.mlp_type, DTYPES[cfg.dtype], cfg.use_bias
    self.quant = cfg.quant if "mlp" in cfg.quant_layers else "none"
    if self.kind != "gelu":
      self.gate = param(rngs, (D, F), (EMBED, MLP), cfg)
    self.up = param(rngs, (D, F), (EMBED, MLP), cfg)
    self.down = param(rngs, (F, D), (MLP, EMBED), cfg)
    if cfg.use_bias:
      if self.kind != "gelu":
        self.gate_bias = param(rngs, (F,), (MLP,), cfg, "zeros")
      self.up_bias = param(rngs, (F,), (MLP,), cfg, "zeros")
      self.down_bias = param(rngs, (D,), (EMBED,), cfg, "zeros")

  def _project(self, x_BLD, name):
    h_BLF = quant_lib.einsum("bld,df->blf", x_BLD, _value(getattr(self, name), self.dtype), self.quant)
    if self.use_bias:
      h_BLF = h_BLF + _value(getattr(self, name + "_bias"), self.dtype)
    return remat.tag(axes.constrain(h_BLF, (BATCH, LENGTH, MLP)), remat.MLP_IN)

  def __call__(self, x_BLD) -> jax.Array:
    up_BLF = self._project(x_BLD, "up")
    if self.kind == "gelu":
      h_BLF = jax.nn.gelu(up_BLF, approximate=True)
    else:
      act = jax.nn.silu if self.kind == "swiglu" else lambda g: jax.nn.gelu(g, approximate=True)
      h_BLF = act(self._project(x_BLD, "gate")) * up_BLF
    h_BLF = remat.tag(h_BLF, remat.MLP_HIDDEN)
    y_BLD = quant_lib.einsum("blf,fd->bld", h_BLF, _value(self.down, self.dtype), self.quant)
    if self.use_bias:
      y_BLD = y_BLD + _value(self.down_bias, self.dtype)
    return remat.tag(axes.constrain(y_BLD, (BATCH, LENGTH, EMBED)), remat.MLP_OUT)


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
