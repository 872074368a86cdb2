"""A paged key/value cache: fixed-size pages in one preallocated pool per layer, a page table per sequence.

`PagedKVCache` is a plain pytree the transformer threads through its layer scan like `model.kv_cache.KVCache`:

  k, v     [G, layers, N, page, K]  the pools: N pages of `page` slots per layer and kv head (page 0 is scratch:
                                     padding tokens write there and no real sequence owns it); compute dtype.
                                     Multi-head Latent Attention keeps its compressed form as model.kv_cache does:
                                     k the latent [1, layers, N, page, kv_lora_rank], v the RoPE key [1, ...,
                                     qk_rope_head_dim] (`latent_attend` attends without expanding them)
  table    int32 [S, P]              page ids of each of S sequence slots, in order (position p of sequence s lives
                                     in page table[s, p // page] at offset p % page); unused entries 0
  length   int32 [S]                 tokens of each sequence cached before this call
  first    int                       slots below it are never visible (1 for the multi-token head's pools, whose
                                     slot p holds the entry of position p - 1: model/engine.py)

A call feeds [S, T] tokens with segment ids (1 real, 0 padding) and positions = length[s] + t for the real ones:
a decode step (one real token per running sequence) or chunks of prompts (chunked prefill). Every real token's
key/value is written to its page slot first; then each query at position q of sequence s attends to positions
0 .. q of s (its cached tokens and the call's own up to itself; inside the window on sliding-window layers),
gathered from s's pages (`attend`: an XLA gather of the row's pages, [S, P * page] slots), or for decode calls
on TPU by the Pallas paged-attention kernel (`kernel`), which reads the pages in place: the pools' layout is
the kernel's, [kv heads, pages, page, head_dim], with the layers folded into the pages. Inside one layer the
same type holds all the pools and the layer's index (`layer`): the layer scan carries the pools and each layer
updates its own in place (a scanned slice would copy every pool at every call). Which pages a sequence owns is the engine's business
(model/engine.py).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from model import attention as attention_lib
from model import axes
from model import kv_cache
from model.axes import BATCH, HEAD_DIM, HEADS, KV_HEADS, LAYERS
from model.config import DTYPES

SCRATCH = 0  # the page padding tokens write to


class PagedKVCache(NamedTuple):
  k: jax.Array
  v: jax.Array
  table: jax.Array
  length: jax.Array
  layer: jax.Array | None = None  # int32 scalar: inside the layer stack, the layer whose pools k[:, layer] are
  # "xla" (the gather), or for decode calls (one token per sequence, no window): "pallas", the TPU paged-attention
  # kernel, or "interpret", the same kernel in Pallas' TPU interpret mode (any backend; tests)
  kernel: str = "xla"
  first: int = 0

  # the pools' logical axes: kv heads split like the model's; pages never (any sequence may own any page)
  NAMES = (KV_HEADS, LAYERS, None, None, HEAD_DIM)


def names(pool: jax.Array) -> tuple:
  """A pool's logical axes: NAMES, with a single kv head (MQA, MLA's latent) never split over the mesh."""
  return PagedKVCache.NAMES if pool.shape[0] > 1 else (None, *PagedKVCache.NAMES[1:])


def pools(cfg, num_pages: int, page: int, layers: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Empty k, v pools [G, layers, num_pages, page, K] in the compute dtype, per `model.kv_cache.dims` (MLA: the
  latent and the RoPE key); `layers` defaults to model.num_layers."""
  (gk, kk), (gv, kv_) = kv_cache.dims(cfg)
  lead = (layers or cfg.num_layers, num_pages, page)
  k, v = jnp.zeros((gk, *lead, kk), DTYPES[cfg.dtype]), jnp.zeros((gv, *lead, kv_), DTYPES[cfg.dtype])
  return axes.constrain(k, names(k)), axes.constrain(v, names(v))


def write(layer: PagedKVCache, k_STGK: jax.Array, v_STGK: jax.Array, segment_ids_ST: jax.Array) -> PagedKVCache:
  """The layer's pools with the call's real tokens stored at their sequences' page slots (padding: SCRATCH)."""
  page = layer.k.shape[3]
  pos_ST = layer.length[:, None] + jnp.arange(k_STGK.shape[1], dtype=jnp.int32)[None, :]
  real_ST = segment_ids_ST > 0
  slot_ST = jnp.clip(pos_ST // page, 0, layer.table.shape[1] - 1)
  page_ST = jnp.where(real_ST, jnp.take_along_axis(layer.table, slot_ST, axis=1), SCRATCH)
  at = (slice(None), layer.layer, page_ST, pos_ST % page)  # selects [G, S, T, K]
  k = layer.k.at[at].set(k_STGK.transpose(2, 0, 1, 3).astype(layer.k.dtype))
  v = layer.v.at[at].set(v_STGK.transpose(2, 0, 1, 3).astype(layer.v.dtype))
  return layer._replace(k=k, v=v)


def attend(q_STHK: jax.Array, layer: PagedKVCache, window=0, softcap: float = 0.0) -> jax.Array:
  """Each query (sequence s, position length[s] + t) against positions 0 .. its own of its sequence, gathered from
  the sequence's pages (written already: `write` first); `window` > 0 also hides positions q - j >= window.
  Scores float32 [S, H, T, P * page]; the arithmetic of `model.attention.cached_attention`. A decode call with
  `layer.kernel` set runs the Pallas kernel instead (`_kernel_attend`; the engine sets it only without windows)."""
  if layer.kernel != "xla" and q_STHK.shape[1] == 1:
    return _kernel_attend(q_STHK, layer, softcap)
  return attention_lib.masked_attention(q_STHK, _gather(layer.k, layer), _gather(layer.v, layer),
                                        _visible(layer, q_STHK.shape[1], window), softcap=softcap, heads_major=True)


def latent_attend(q_nope_STHN, q_rot_STHR, layer: PagedKVCache, w_uk_CHN, w_uv_CHV, window=0, scale: float = 1.0,
                  softcap: float = 0.0) -> jax.Array:
  """`attend` for Multi-head Latent Attention: the sequences' latents [S, X, C] and RoPE keys [S, X, R] gathered
  from their pages, attended in the absorbed form of `model.attention.latent_masked_attention` -> o_STHV."""
  latent_SXC, k_rot_SXR = _gather(layer.k, layer)[:, 0], _gather(layer.v, layer)[:, 0]
  return attention_lib.latent_masked_attention(q_nope_STHN, q_rot_STHR, latent_SXC, k_rot_SXR, w_uk_CHN, w_uv_CHV,
                                               _visible(layer, q_nope_STHN.shape[1], window), scale, softcap)


def _gather(pool: jax.Array, layer: PagedKVCache) -> jax.Array:
  """[S, G, P * page, K]: each sequence's pages of this layer's pool in order, gathered where the pool lies and
  then laid heads-major for the products."""
  G, page, S, P = pool.shape[0], pool.shape[3], *layer.table.shape
  return pool[:, layer.layer, layer.table].reshape(G, S, P * page, -1).transpose(1, 0, 2, 3)


def _visible(layer: PagedKVCache, T: int, window) -> jax.Array:
  """bool [S, T, P * page]: the query at slot length[s] + t sees slots `first` .. its own (inside the window)."""
  q_pos_ST = layer.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  key_pos_X = jnp.arange(layer.table.shape[1] * layer.k.shape[3], dtype=jnp.int32)
  visible_STX = (key_pos_X[None, None, :] <= q_pos_ST[:, :, None]) & (key_pos_X >= layer.first)[None, None, :]
  window = jnp.asarray(window)
  return visible_STX & ((window <= 0) | (q_pos_ST[:, :, None] - key_pos_X[None, None, :] < window))


def _kernel_attend(q_S1HK: jax.Array, layer: PagedKVCache, softcap: float) -> jax.Array:
  """One query per sequence (at position length[s], written already) over its length[s] + 1 keys by
  `jax.experimental.pallas.ops.tpu.paged_attention`, reading the pages where they lie: the pools' layers are
  folded into their pages ([G, layers x N, page, K], a free reshape) and the page table offset to this layer's.
  The kernel computes q.k of the pre-scaled queries in float32 with keys and values as bfloat16."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention_kernel  # pylint: disable=g-import-not-at-top
  G, L, N, page, K = layer.k.shape
  P = layer.table.shape[1]
  fold = lambda pool: pool.reshape(G, L * N, page, K)  # noqa: E731
  q_SHK = q_S1HK[:, 0].astype(jnp.float32) * jnp.float32(K ** -0.5)

  def local(q_SHK, k, v, length_S, table_SP):  # one device's sequences and heads
    run = functools.partial(paged_attention_kernel.paged_attention, q_SHK, k, v, length_S, table_SP,
                            attn_logits_soft_cap=softcap or None, pages_per_compute_block=math.gcd(P, 8))
    if layer.kernel == "interpret":
      with pltpu.force_tpu_interpret_mode():
        return run()
    return run()

  args = (q_SHK, fold(layer.k), fold(layer.v), layer.length + 1, layer.table + layer.layer * N)
  if axes.active():  # the kernel is one device's program: sequences over the batch axes, heads over tensor
    specs = (axes.spec((BATCH, HEADS, HEAD_DIM)), axes.spec((KV_HEADS, None, None, HEAD_DIM)),
             axes.spec((KV_HEADS, None, None, HEAD_DIM)), axes.spec((BATCH,)), axes.spec((BATCH, None)))
    o_SHK = jax.shard_map(local, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)
  else:
    o_SHK = local(*args)
  return o_SHK[:, None].astype(q_S1HK.dtype)
