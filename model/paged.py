"""A paged key/value cache: fixed-size pages in one preallocated pool per layer, a page table per sequence.

`PagedKVCache` is a plain pytree the transformer threads through its layer scan like `model.kv_cache.KVCache`:

  k, v     [layers, N, page, G, K]  the pools: N pages of `page` slots (page 0 is scratch: padding tokens write
                                     there and no real sequence owns it); compute dtype
  table    int32 [S, P]              page ids of each of S sequence slots, in order (position p of sequence s lives
                                     in page table[s, p // page] at offset p % page); unused entries 0
  length   int32 [S]                 tokens of each sequence cached before this call

A call feeds [S, T] tokens with segment ids (1 real, 0 padding) and positions = length[s] + t for the real ones:
a decode step (one real token per running sequence) or chunks of prompts (chunked prefill). Every real token's
key/value is written to its page slot first; then each query at position q of sequence s attends to positions
0 .. q of s (its cached tokens and the call's own up to itself; inside the window on sliding-window layers),
gathered from s's pages (`attend`: an XLA gather of the row's pages, [S, P * page] slots). Inside one layer the
same type holds all the pools and the layer's index (`layer`): the layer scan carries the pools and each layer
updates its own in place (a scanned slice would copy every pool at every call). Which pages a sequence owns is the engine's business
(model/engine.py).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from model import attention as attention_lib
from model import axes
from model.axes import HEAD_DIM, KV_HEADS, LAYERS
from model.config import DTYPES

SCRATCH = 0  # the page padding tokens write to


class PagedKVCache(NamedTuple):
  k: jax.Array
  v: jax.Array
  table: jax.Array
  length: jax.Array
  layer: jax.Array | None = None  # int32 scalar: inside the layer stack, the layer whose pools k[layer], v[layer] are

  # the pools' logical axes: pages are never split over the mesh (any sequence may own any page)
  NAMES = (LAYERS, None, None, KV_HEADS, HEAD_DIM)


def pools(cfg, num_pages: int, page: int) -> tuple[jax.Array, jax.Array]:
  """Empty k, v pools [layers, num_pages, page, G, K] in the compute dtype (MLA is not paged: ValueError)."""
  if cfg.attention_type == "mla":
    raise ValueError("model.attention_type='mla': the paged engine keeps per-head keys and values; decode MLA "
                     "models with model.generate (its latent cache)")
  shape = (cfg.num_layers, num_pages, page, cfg.num_kv_heads, cfg.head_dim)
  k = jnp.zeros(shape, DTYPES[cfg.dtype])
  return axes.constrain(k, PagedKVCache.NAMES), axes.constrain(jnp.zeros_like(k), PagedKVCache.NAMES)


def write(layer: PagedKVCache, k_STGK: jax.Array, v_STGK: jax.Array, segment_ids_ST: jax.Array) -> PagedKVCache:
  """The layer's pools with the call's real tokens stored at their sequences' page slots (padding: SCRATCH)."""
  page = layer.k.shape[-3]
  pos_ST = layer.length[:, None] + jnp.arange(k_STGK.shape[1], dtype=jnp.int32)[None, :]
  real_ST = segment_ids_ST > 0
  slot_ST = jnp.clip(pos_ST // page, 0, layer.table.shape[1] - 1)
  page_ST = jnp.where(real_ST, jnp.take_along_axis(layer.table, slot_ST, axis=1), SCRATCH)
  offset_ST = pos_ST % page
  at = (page_ST, offset_ST) if layer.layer is None else (layer.layer, page_ST, offset_ST)
  k = layer.k.at[at].set(k_STGK.astype(layer.k.dtype))
  v = layer.v.at[at].set(v_STGK.astype(layer.v.dtype))
  return layer._replace(k=k, v=v)


def attend(q_STHK: jax.Array, layer: PagedKVCache, window=0, softcap: float = 0.0) -> jax.Array:
  """Each query (sequence s, position length[s] + t) against positions 0 .. its own of its sequence, gathered from
  the sequence's pages (written already: `write` first); `window` > 0 also hides positions q - j >= window.
  Scores float32 [S, H, T, P * page]; the arithmetic of `model.attention.cached_attention`."""
  S, T = q_STHK.shape[:2]
  P, page = layer.table.shape[1], layer.k.shape[-3]
  at = layer.table if layer.layer is None else (layer.layer, layer.table)
  k_SXGK = layer.k[at].reshape(S, P * page, *layer.k.shape[-2:])
  v_SXGK = layer.v[at].reshape(S, P * page, *layer.v.shape[-2:])
  q_pos_ST = layer.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  key_pos_X = jnp.arange(P * page, dtype=jnp.int32)
  visible_STX = key_pos_X[None, None, :] <= q_pos_ST[:, :, None]
  window = jnp.asarray(window)
  visible_STX &= (window <= 0) | (q_pos_ST[:, :, None] - key_pos_X[None, None, :] < window)
  return attention_lib.masked_attention(q_STHK, k_SXGK, v_SXGK, visible_STX, softcap=softcap)
