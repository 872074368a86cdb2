"""The key/value cache of autoregressive decoding: one layout for every layer type.

`KVCache` is a plain pytree (a NamedTuple) that the transformer threads through its layer scan:

  k, v   [layers, B, S, G, K]  logical axes (layers, batch, kv_length, kv_heads, head_dim); compute dtype.
         Multi-head Latent Attention (model.attention_type=mla) keeps its compressed form instead: k the
         normalised latent [layers, B, S, 1, kv_lora_rank], v the rotated RoPE key [layers, B, S, 1,
         qk_rope_head_dim] (`dims`), from which the absorbed decode path attends without expanding K/V.
  index  int32 []              slots written so far = the slot of the next token (the same for every row)
  start  int32 [B]             first real slot of each row (prompts are left-padded to a common length)

Slot j of row b holds the token at RoPE position j - start[b]. A query at slot i sees key slot j when
start[b] <= j <= i and, on a sliding-window layer, i - j < window; so L new tokens written at slots
[index, index + L) (a decode step, or one chunk of a prompt prefilled in chunks) see every cached slot of their row
and the new ones up to themselves. The window is applied by masking the full cache rather than by a ring buffer,
so windowed and global layers (and dense or MoE blocks) share one stacked `[layers, ...]` array that `lax.scan`
slices per layer. The cost is memory: bytes_per_token() per layer for every slot, window or not
(docs/generate.md).

Inside one layer the same type holds that layer's slice (k, v [B, S, G, K]).

`zeros` gives `index` as a NumPy int32 0, not a traced array: inside the trace that creates it, `is_empty` then
knows statically that nothing is cached, and the first call (a whole prompt) attends among its own tokens with
`model.attention_impl`. Any other call attends over the cache slots (`model.attention.cached_attention`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model import axes
from model.axes import BATCH, HEAD_DIM, KV_HEADS, KV_LENGTH, LAYERS
from model.config import DTYPES

NAMES = (LAYERS, BATCH, KV_LENGTH, KV_HEADS, HEAD_DIM)
LAYER_NAMES = NAMES[1:]


class KVCache(NamedTuple):
  k: jax.Array
  v: jax.Array
  index: jax.Array
  start: jax.Array


def dims(cfg) -> tuple[tuple[int, int], tuple[int, int]]:
  """((heads, width) of k, (heads, width) of v) per slot and layer: (num_kv_heads, head_dim) twice, or MLA's
  latent (1, kv_lora_rank) and RoPE key (1, qk_rope_head_dim)."""
  if cfg.attention_type == "mla":
    return (1, cfg.kv_lora_rank), (1, cfg.qk_rope_head_dim)
  return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)


def names(x: jax.Array, base=NAMES) -> tuple:
  """The logical names of a cache array (`base`: NAMES, or LAYER_NAMES for one layer's slice); a single kv head
  (MQA, MLA's latent) is never split over the mesh."""
  return base if x.shape[-2] > 1 else (*base[:-2], None, base[-1])


def zeros(cfg, start_B: jax.Array, length: int) -> KVCache:
  """An empty cache of `length` slots for len(start_B) rows, sharded by the logical axes when rules are active."""
  (gk, kk), (gv, kv_) = dims(cfg)
  lead = (cfg.num_layers, start_B.shape[0], length)
  k = jnp.zeros((*lead, gk, kk), DTYPES[cfg.dtype])
  v = k if (gk, kk) == (gv, kv_) else jnp.zeros((*lead, gv, kv_), DTYPES[cfg.dtype])
  return KVCache(axes.constrain(k, names(k)), axes.constrain(v, names(v)), np.int32(0), start_B.astype(jnp.int32))


def is_empty(cache: KVCache) -> bool:
  """True when `cache.index` is known at trace time to be 0 (a fresh `zeros` cache); False when it is traced
  (unknown) or a nonzero number, and for the engine's paged cache (no index). Selects the prefill path, never the
  result: both paths compute the same values."""
  index = getattr(cache, "index", None)
  return isinstance(index, (int, np.integer)) and int(index) == 0


def advance(cache: KVCache, length: int) -> KVCache:
  """The cache with `length` more slots written (index + length; an index known at trace time stays known)."""
  index = cache.index + length
  return cache._replace(index=np.int32(index) if isinstance(index, (int, np.integer)) else index)


def check_room(cache: KVCache, length: int) -> None:
  """ValueError when `length` new tokens do not fit in the slots left (checked where the index is known at trace
  time; a traced index is the caller's to keep in range, as `model.generate` does)."""
  slots = cache.k.shape[-3]
  used = int(cache.index) if isinstance(cache.index, (int, np.integer)) else 0
  if used + length > slots:
    raise ValueError(f"{length} new tokens at cache slot {used} do not fit the cache's {slots} slots; make the "
                     "cache longer (kv_cache.zeros(cfg, start_B, length))")


def write(layer: KVCache, k_BLGK: jax.Array, v_BLGK: jax.Array) -> KVCache:
  """The layer's cache with L new keys/values stored at slots [index, index + L) (index itself unchanged)."""
  at = (0, layer.index, 0, 0)
  k = jax.lax.dynamic_update_slice(layer.k, k_BLGK.astype(layer.k.dtype), at)
  v = jax.lax.dynamic_update_slice(layer.v, v_BLGK.astype(layer.v.dtype), at)
  return layer._replace(k=axes.constrain(k, names(k, LAYER_NAMES)), v=axes.constrain(v, names(v, LAYER_NAMES)))


def bytes_per_token(cfg) -> int:
  """Cache bytes per token per layer: 2 (K and V) x num_kv_heads x head_dim x bytes of the compute dtype; MLA
  (kv_lora_rank + qk_rope_head_dim) x bytes."""
  (gk, kk), (gv, kv_) = dims(cfg)
  return (gk * kk + gv * kv_) * jnp.dtype(DTYPES[cfg.dtype]).itemsize

