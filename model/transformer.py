"""The decoder-only transformer: embedding, N blocks (scanned or unrolled), final norm, output projection."""
from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
from flax import nnx

from common.segments import positions_from_segments
from model import attention as attention_lib
from model import axes
from model import config as config_lib
from model import kv_cache
from model import paged
from model import layers
from model import moe as moe_lib
from model import mup
from model import quant
from model import remat as remat_lib
from model import rope
from model.axes import BATCH, EMBED, LAYERS, LENGTH, VOCAB
from parallel import context as context_lib
from parallel import pipeline as pipeline_lib

MTP_FEATURES = "mtp_features"  # aux key of the multi-token heads' features (Transformer.__call__ with mtp=True)


class Transformer(nnx.Module):
  """Decoder-only LM. `model(tokens_BL, segment_ids_BL=None, positions_BL=None) -> logits_BLV` (float32).

  segment_ids_BL > 0 mark packed documents (0 = padding); a token attends causally within its segment only
  (bidirectionally with model.causal=false; prefix_BL = 1 marks a document's bidirectional prefix, prefix-LM).
  positions_BL (RoPE positions) default to the index inside each segment. `remat` names a policy in
  `model.remat.POLICIES`. The config is validated here (ValueError naming the key). Decoding uses
  `features(..., cache=)` and `logits` (model.generate). `pipeline` (parallel.pipeline.Schedule) pipelines the
  scanned layer stack over the mesh's `stage` axis when that axis has more than one device (docs/pipeline.md).
  """

  def __init__(self, cfg_model: Mapping[str, Any], *, rngs: nnx.Rngs, remat: str = "none",
               pipeline: pipeline_lib.Schedule | None = None):
    cfg = config_lib.validate(cfg_model)
    if remat not in remat_lib.POLICIES:
      raise ValueError(f"remat={remat!r} (train.remat) is not one of {', '.join(remat_lib.POLICIES)}")
    self.cfg = ml_collections.FrozenConfigDict(cfg)
    self.remat = remat
    if pipeline is not None and not cfg.scan_layers:
      raise ValueError("mesh.stage > 1 needs model.scan_layers=True: pipeline stages split the scanned layer stack")
    self.pipeline = pipeline
    with axes.creation_context():
      self.embed = layers.Embed(cfg, rngs=rngs)
      unit = config_lib.layers_per_unit(cfg)  # the scan repeats units: one block, or a group with one MoE
      prefix = config_lib.dense_prefix(cfg)  # DeepSeek's first dense layers: a stack of their own before the units
      if cfg.scan_layers:
        def make_stack(count, build):
          @nnx.split_rngs(splits=count)
          @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
          def make(rngs):
            return build(rngs)
          return make(rngs)
        if prefix:
          self.dense_layers = make_stack(prefix, lambda r: layers.Block(cfg, rngs=r, moe=False))
        self.layers = make_stack(
            (cfg.num_layers - prefix) // unit,
            lambda r: layers.LayerGroup(cfg, rngs=r) if unit > 1 else layers.Block(
                cfg, rngs=r, moe=config_lib.is_moe_layer(cfg, prefix)))
      else:
        self.layers = nnx.List([layers.Block(cfg, rngs=rngs, moe=config_lib.is_moe_layer(cfg, i))
                                for i in range(cfg.num_layers)])
      self.final_norm = layers.Norm(cfg, rngs=rngs)
      if not cfg.tie_embeddings:
        self.unembed = layers.param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), cfg)
      if cfg.mtp_depth:  # last: the main model's parameters are drawn as without them
        self.mtp = nnx.List([layers.MultiTokenHead(cfg, rngs=rngs) for _ in range(cfg.mtp_depth)])

  def __call__(self, tokens_BL: jax.Array, segment_ids_BL: jax.Array | None = None,
               positions_BL: jax.Array | None = None, *, return_aux: bool = False, prefix_BL: jax.Array | None = None,
               branch_BL: jax.Array | None = None, mtp: bool = False):
    """-> logits_BLV float32; with return_aux, (logits_BLV, aux): aux holds the MoE router statistics
    (model.moe.STATS, float32 scalars and the [E] expert load, averaged over the MoE layers; {} when dense), and
    with `mtp` (model.mtp_depth > 0) MTP_FEATURES: [depth, B, L, D] the normed features of the multi-token heads,
    depth d's at position i predicting token i + d + 1 (`logits` projects them)."""
    if mtp and not return_aux:
      raise ValueError("mtp=True returns the multi-token heads' features in aux: pass return_aux=True as well")
    x_BLD, aux = self.features(tokens_BL, segment_ids_BL, positions_BL, return_aux=True, prefix_BL=prefix_BL,
                               branch_BL=branch_BL, mtp=mtp)
    logits_BLV = self.logits(x_BLD)
    return (logits_BLV, aux) if return_aux else logits_BLV

  def features(self, tokens_BL: jax.Array, segment_ids_BL: jax.Array | None = None,
               positions_BL: jax.Array | None = None, cache: kv_cache.KVCache | None = None, *,
               return_aux: bool = False, prefix_BL: jax.Array | None = None, branch_BL: jax.Array | None = None,
               mtp: bool = False, normed: bool = True):
    """The final-normed residual stream x_BLD (`normed=False`: before the final norm, what the multi-token heads
    take); with a `cache` (model.kv_cache), (x_BLD, cache advanced by L);
    with return_aux (no cache), (x_BLD, MoE statistics as in __call__). With a cache the L tokens go to slots
    [index, index + L) and attend to the row's cached slots and to each other causally (a whole prompt, a chunk
    of one, or a decode step: model/layers.py Attention); segment ids then default to 1 from the row's
    `cache.start` on (0 = left padding) and positions to slot - start.

    `logits(features(...))` is `__call__`; decoding projects only the positions it samples from.
    """
    if tokens_BL.ndim != 2 or not jnp.issubdtype(tokens_BL.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer [batch, seq]; got {tokens_BL.dtype}{list(tokens_BL.shape)}")
    if cache is not None:
      if prefix_BL is not None or branch_BL is not None:
        raise ValueError("prefix_BL / branch_BL (prefix-LM, tree attention) cannot be used with a KV cache")
      if isinstance(cache, paged.PagedKVCache):
        if segment_ids_BL is None or positions_BL is None:
          raise ValueError("a paged cache (model/paged.py) needs segment ids and positions for every call: its "
                           "sequences sit at their own lengths (model.engine builds them)")
      else:
        segment_ids_BL, positions_BL = self._cache_defaults(cache, tokens_BL, segment_ids_BL, positions_BL)
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones(tokens_BL.shape, jnp.int32)
    segment_ids_BL = segment_ids_BL.astype(jnp.int32)
    if positions_BL is None:
      positions_BL = positions_from_segments(segment_ids_BL)
    natural = (tokens_BL, segment_ids_BL, positions_BL)  # the multi-token heads run in the natural order
    order_L = self._context_order(tokens_BL.shape[1]) if cache is None else None
    if order_L is not None:  # the ring's balanced layout, once for every layer (undone after the stack)
      lay = lambda a: None if a is None else jnp.take(a, order_L, axis=1)
      tokens_BL, segment_ids_BL, positions_BL, prefix_BL, branch_BL = map(
          lay, (tokens_BL, segment_ids_BL, positions_BL, prefix_BL, branch_BL))
    cos, sin = rope.tables(self.cfg, positions_BL)  # [B, L, K/2], or [2, ...]: global and local sets
    x_BLD = self.embed(tokens_BL)
    windows = config_lib.layer_windows(self.cfg)

    def apply_block(graphdef, state, x_BLD, window, *layer_cache):
      if layer_cache:
        return nnx.merge(graphdef, state)(x_BLD, segment_ids_BL, cos, sin, window, *layer_cache)
      return nnx.merge(graphdef, state)(x_BLD, segment_ids_BL, cos, sin, window, prefix_BL=prefix_BL,
                                        branch_BL=branch_BL, order_L=order_L)

    if cache is not None:
      x_BLD, cache = self._cached_layers(apply_block, x_BLD, windows, cache)
      x_BLD = self.final_norm(x_BLD) if normed else x_BLD
      if isinstance(cache, paged.PagedKVCache):  # the engine advances each sequence's length itself
        return x_BLD, cache
      return x_BLD, cache._replace(index=cache.index + tokens_BL.shape[1])
    if self.cfg.scan_layers:
      unit, prefix = config_lib.layers_per_unit(self.cfg), config_lib.dense_prefix(self.cfg)
      if prefix:
        x_BLD, _ = self._stack(nnx.split(self.dense_layers), jnp.asarray(windows[:prefix], jnp.int32), x_BLD,
                               segment_ids_BL, cos, sin, prefix_BL, branch_BL, order_L)
        windows = windows[prefix:]
      windows_U = jnp.asarray(windows, jnp.int32).reshape(-1, unit) if unit > 1 else jnp.asarray(windows, jnp.int32)
      pipelined = self.pipeline is not None and axes.mesh_size(LAYERS) > 1
      if pipelined:
        if prefix:
          raise ValueError(f"model.first_dense_layers={prefix} with mesh.stage > 1: the pipeline splits one stack "
                           "of identical layers; use first_dense_layers=0 or mesh.stage=1")
        x_BLD, stats = self._pipelined(x_BLD, windows_U, segment_ids_BL, positions_BL, prefix_BL, branch_BL)
      else:
        x_BLD, stats = self._stack(nnx.split(self.layers), windows_U, x_BLD, segment_ids_BL, cos, sin, prefix_BL,
                                   branch_BL, order_L)
    else:
      stats, pipelined = [], False
      for block, window in zip(self.layers, windows):
        graphdef, state = nnx.split(block)
        step = remat_lib.wrap(lambda s, x, graphdef=graphdef, window=window: apply_block(graphdef, s, x, window),
                              self.remat)
        x_BLD, block_stats = step(state, x_BLD)
        stats += [block_stats] if block_stats else []
      stats = jax.tree.map(lambda *v: jnp.stack(v), *stats) if stats else {}
    if order_L is not None:
      x_BLD = self._natural_order(x_BLD, order_L)
      tokens_BL, segment_ids_BL, positions_BL = natural
      if mtp:
        cos, sin = rope.tables(self.cfg, positions_BL)
    aux = {k: jnp.mean(v, axis=0) for k, v in stats.items()}  # mean over MoE layers (MaxText, Levanter)
    if stats and self.cfg.router == "sigmoid" and not pipelined:  # per layer, for the score-bias update
      aux[moe_lib.LAYER_LOAD] = stats["moe_expert_load"]
    if mtp:
      if not self.cfg.mtp_depth:
        raise ValueError("mtp=True needs model.mtp_depth > 0 (the model has no multi-token heads)")
      aux[MTP_FEATURES], mtp_loads = self._mtp(x_BLD, tokens_BL, segment_ids_BL, cos, sin, windows[-1])
      if moe_lib.LAYER_LOAD in aux:  # the heads' MoE blocks have score biases too: their loads follow the layers'
        aux[moe_lib.LAYER_LOAD] = jnp.concatenate([aux[moe_lib.LAYER_LOAD], mtp_loads])
    x_BLD = self.final_norm(x_BLD) if normed else x_BLD
    return (x_BLD, aux) if return_aux else x_BLD

  def _context_order(self, length: int):
    """int32 [length] numpy: the token index at each row position of the ring's zigzag layout under the current
    mesh (model.context_parallel='ring', model.context_layout='zigzag', mesh.sequence > 1), else None."""
    if self.cfg.context_parallel != "ring" or self.cfg.context_layout != "zigzag":
      return None
    shards = axes.mesh_size(LENGTH)
    if shards == 1:
      return None
    if length % (2 * shards):  # training refuses such a length (the Trainer); scoring runs any padded length
      attention_lib.report_once(f"model.context_layout='zigzag': a length of {length} does not split into "
                                f"2 x {shards} chunks; these calls run the contiguous layout", logging.WARNING)
      return None
    return context_lib.zigzag(length, shards)

  @staticmethod
  def _natural_order(x_BLD, order_L):
    """x_BLD from the ring's zigzag layout back to the natural order: two collective-permutes of half a shard
    each (parallel.context.unzigzag) on an even sequence axis, else a gather (which XLA does by all-gathering the
    whole length)."""
    spec = axes.spec((BATCH, LENGTH, EMBED))
    shards = axes.mesh_size(LENGTH)
    if not isinstance(spec[1], str) or shards % 2 or x_BLD.shape[0] % axes.mesh_size(BATCH):
      return axes.constrain(jnp.take(x_BLD, np.argsort(order_L), axis=1), (BATCH, LENGTH, EMBED))
    fn = functools.partial(context_lib.unzigzag, axis=spec[1], shards=shards)
    return jax.shard_map(fn, in_specs=spec, out_specs=spec, check_vma=False)(x_BLD)

  def _mtp(self, h_BLD, tokens_BL, segment_ids_BL, cos, sin, window) -> tuple[jax.Array, jax.Array | None]:
    """([depth, B, L, D] the multi-token heads' features, [depth, E] their MoE blocks' expert loads or None when
    dense): the heads in sequence, depth d combining the previous depth's h with the embedding of the token d
    places ahead (zeros' embedding past the end: those positions have no target)."""
    outs, loads = [], []
    for d, head in enumerate(self.mtp, start=1):
      ahead_BL = jnp.pad(tokens_BL[:, d:], ((0, 0), (0, d)))
      h_BLD, out_BLD, stats = head(h_BLD, self.embed(ahead_BL), segment_ids_BL, cos, sin, window)
      outs.append(out_BLD)
      loads += [stats["moe_expert_load"]] if stats else []
    return jnp.stack(outs), jnp.stack(loads) if loads else None

  def mtp_step(self, h_STD, ahead_ST, segment_ids_ST, positions_ST, cache: paged.PagedKVCache):
    """The first multi-token head over a paged cache of its own (one layer: the engine's MTP drafts): h_STD the
    main model's features before the final norm at positions_ST, ahead_ST the tokens one place ahead of them ->
    (its normed features x_STD, whose logits predict the tokens two places ahead, the updated cache)."""
    cos, sin = rope.tables(self.cfg, positions_ST)
    window = config_lib.layer_windows(self.cfg)[-1]
    _, x_STD, cache = self.mtp[0](h_STD, self.embed(ahead_ST), segment_ids_ST, cos, sin, window,
                                  cache._replace(layer=jnp.int32(0)))
    return x_STD, cache._replace(layer=None)

  def _stack(self, split_layers, windows_U, x_BLD, segment_ids_BL, cos, sin, prefix_BL=None, branch_BL=None,
             order_L=None):
    """The scanned stack (or a stage's slice of it): -> (x_BLD, stats with a leading [units] dimension); cos, sin:
    `rope.tables`, each layer taking its set by its window; order_L: the ring's token layout (None: natural)."""
    graphdef, state = split_layers
    def body(x_BLD, xs):
      layer_state, window = xs
      return nnx.merge(graphdef, layer_state)(x_BLD, segment_ids_BL, cos, sin, window, prefix_BL=prefix_BL,
                                              branch_BL=branch_BL, order_L=order_L)
    units = windows_U.shape[0]
    if self.cfg.scan_unroll == 1 or self.cfg.scan_unroll < units:
      return jax.lax.scan(remat_lib.wrap(body, self.remat, prevent_cse=False), x_BLD, (state, windows_U),
                          unroll=self.cfg.scan_unroll)
    # Fully unrolled: a loop over static slices of the stacked weights. A scan, even unrolled, collects every
    # layer's residuals for the backward pass into stacked buffers (zero-filled, then copied in and out: 10-15%
    # of a CPU step without remat); here each stays a buffer of its own, and only the weight gradients are stacked.
    body = remat_lib.wrap(body, self.remat)  # prevent_cse: outside a scan XLA would merge the recomputation away
    stats = []
    for u in range(units):
      x_BLD, unit_stats = body(x_BLD, jax.tree.map(lambda a, u=u: a[u], (state, windows_U)))
      stats.append(unit_stats)
    return x_BLD, jax.tree.map(lambda *v: jnp.stack(v), *stats)

  def _pipelined(self, x_BLD, windows_U, segment_ids_BL, positions_BL, prefix_BL=None, branch_BL=None):
    """The stack split over the `stage` mesh axis (parallel.pipeline); stats averaged like the plain scan's."""
    graphdef, state = nnx.split(self.layers)
    def stage(weights, x_bLD, side):
      (state_U, windows_u), (segment_ids_bL, positions_bL, masks) = weights, side
      seq_len = masks["rope_len"][0] if "rope_len" in masks else None
      cos, sin = rope.tables(self.cfg, positions_bL, seq_len)
      x_bLD, stats = self._stack((graphdef, state_U), windows_u, x_bLD, segment_ids_bL, cos, sin,
                                 masks.get("prefix"), masks.get("branch"))
      return x_bLD, jax.tree.map(lambda v: jnp.mean(v, axis=0), stats)
    s = self.pipeline
    masks = {k: v for k, v in (("prefix", prefix_BL), ("branch", branch_BL)) if v is not None}  # optional rows
    if self.cfg.rope_scaling == "dynamic":  # the whole batch's length (as unpipelined), on every row
      masks["rope_len"] = jnp.full(positions_BL.shape[:1], jnp.max(positions_BL) + 1, jnp.int32)
    side = (segment_ids_BL, positions_BL, masks)
    x_BLD, stats = pipeline_lib.run(stage, (state, windows_U), x_BLD, side, s)
    visits = s.stages * s.repeats * s.microbatches
    return x_BLD, jax.tree.map(lambda v: v[None] / visits, stats)  # [1] per statistic: the mean below keeps it

  def _segments(self) -> list[tuple[Any, int, int, int]]:
    """The scanned stacks in order as (stack, first layer, end layer, layers per scanned unit): the dense prefix
    (model.first_dense_layers) when there is one, then the repeated units."""
    prefix, n = config_lib.dense_prefix(self.cfg), self.cfg.num_layers
    main = (self.layers, prefix, n, config_lib.layers_per_unit(self.cfg))
    return [(self.dense_layers, 0, prefix, 1), main] if prefix else [main]

  @staticmethod
  def _cache_defaults(cache: kv_cache.KVCache, tokens_BL, segment_ids_BL, positions_BL):
    """(segment ids, positions) of a call into a KVCache: 1 from the row's `cache.start` on (0 = left padding) and
    slot - start, where not given."""
    slots_BL = cache.index + jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
    if segment_ids_BL is None:
      segment_ids_BL = (slots_BL >= cache.start[:, None]).astype(jnp.int32)
    if positions_BL is None:
      positions_BL = jnp.maximum(slots_BL - cache.start[:, None], 0)
    return segment_ids_BL, positions_BL

  def _paged_layers(self, apply_block, x_BLD, windows, cache):
    """The layer stack over a paged cache: the pools are carried through the scan and each layer writes its own
    in place (indexed by `cache.layer`), so a call costs the tokens it feeds, not a copy of the pools."""
    if not self.cfg.scan_layers:
      for i, (block, window) in enumerate(zip(self.layers, windows)):
        x_BLD, cache = apply_block(*nnx.split(block), x_BLD, window, cache._replace(layer=jnp.int32(i)))
      return x_BLD, cache._replace(layer=None)
    for stack, lo, hi, unit in self._segments():
      graphdef, state = nnx.split(stack)
      by_unit = lambda a: a.reshape(a.shape[0] // unit, unit, *a.shape[1:]) if unit > 1 else a  # noqa: E731
      def body(carry, xs):
        x_BLD, k, v = carry
        layer_state, window, index = xs
        x_BLD, out = apply_block(graphdef, layer_state, x_BLD, window, cache._replace(k=k, v=v, layer=index))
        return (x_BLD, out.k, out.v), None
      (x_BLD, k, v), _ = jax.lax.scan(body, (x_BLD, cache.k, cache.v),
                                      (state, by_unit(jnp.asarray(windows[lo:hi], jnp.int32)),
                                       by_unit(jnp.arange(lo, hi, dtype=jnp.int32))))
      cache = cache._replace(k=k, v=v)
    return x_BLD, cache._replace(k=axes.constrain(cache.k, paged.names(cache.k)),
                                 v=axes.constrain(cache.v, paged.names(cache.v)), layer=None)

  def _cached_layers(self, apply_block, x_BLD, windows, cache):
    """The layer stack with each layer's slice of the cache as scan input and its update as scan output."""
    if isinstance(cache, paged.PagedKVCache):
      return self._paged_layers(apply_block, x_BLD, windows, cache)

    def layer_view(k, v):
      return cache._replace(k=k, v=v)

    if self.cfg.scan_layers:
      def scan(stack, x_BLD, windows, k, v, unit):
        graphdef, state = nnx.split(stack)
        def body(x_BLD, xs):
          layer_state, window, k, v = xs
          x_BLD, layer = apply_block(graphdef, layer_state, x_BLD, window, layer_view(k, v))
          return x_BLD, (layer.k, layer.v)
        # MoE layer groups: the cache scanned as [units, unit, ...]
        by_unit = lambda a: a.reshape(a.shape[0] // unit, unit, *a.shape[1:]) if unit > 1 else a
        x_BLD, (k_new, v_new) = jax.lax.scan(body, x_BLD, (state, by_unit(jnp.asarray(windows, jnp.int32)),
                                                           by_unit(k), by_unit(v)))
        return x_BLD, k_new.reshape(k.shape), v_new.reshape(v.shape)
      ks, vs = [], []
      for stack, lo, hi, unit in self._segments():
        x_BLD, k, v = scan(stack, x_BLD, windows[lo:hi], cache.k[lo:hi], cache.v[lo:hi], unit)
        ks.append(k)
        vs.append(v)
      k, v = (ks[0], vs[0]) if len(ks) == 1 else (jnp.concatenate(ks), jnp.concatenate(vs))
    else:
      ks, vs = [], []
      for i, (block, window) in enumerate(zip(self.layers, windows)):
        graphdef, state = nnx.split(block)
        x_BLD, layer = apply_block(graphdef, state, x_BLD, window, layer_view(cache.k[i], cache.v[i]))
        ks.append(layer.k)
        vs.append(layer.v)
      k, v = jnp.stack(ks), jnp.stack(vs)
    return x_BLD, cache._replace(k=axes.constrain(k, kv_cache.names(k)), v=axes.constrain(v, kv_cache.names(v)))

  def logits(self, x_BLD: jax.Array) -> jax.Array:
    """float32 logits_BLV of the output projection (the tied embedding or `unembed`), soft-capped in float32 with
    model.final_logit_softcap."""
    if self.cfg.tie_embeddings:
      logits_BLV = self.embed.attend(x_BLD)
    else:
      logits_BLV = quant.project("bld,dv->blv", x_BLD, self.unembed[...].astype(config_lib.DTYPES[self.cfg.dtype]),
                                 preferred_element_type=jnp.float32)
    logits_BLV = logits_BLV.astype(jnp.float32)
    if mup.enabled(self.cfg):  # muP's output multiplier 1 / width_mult
      logits_BLV = logits_BLV * mup.output_multiplier(self.cfg)
    if self.cfg.final_logit_softcap:  # Gemma 2: cap * tanh(logits / cap)
      cap = jnp.float32(self.cfg.final_logit_softcap)
      logits_BLV = jnp.tanh(logits_BLV / cap) * cap
    return axes.constrain(logits_BLV, (BATCH, LENGTH, VOCAB))
