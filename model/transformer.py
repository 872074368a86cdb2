"""The decoder-only transformer: embedding, N blocks (scanned or unrolled), final norm, output projection."""
from __future__ import annotations

from typing import Any, Mapping

import jax
import ml_collections
import jax.numpy as jnp
from flax import nnx

from model import axes
from model import config as config_lib
from model import layers
from model import remat as remat_lib
from model import rope
from model.axes import BATCH, EMBED, LAYERS, LENGTH, VOCAB


def positions_from_segments(segment_ids_BL: jax.Array) -> jax.Array:
  """int32 [B, L]: index of each token inside its (contiguous) segment, restarting at 0 per document."""
  B, L = segment_ids_BL.shape
  idx_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
  starts_BL = jnp.concatenate(
      [jnp.ones((B, 1), bool), segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]], axis=1)
  return idx_BL - jax.lax.cummax(jnp.where(starts_BL, idx_BL, 0), axis=1)


class Transformer(nnx.Module):
  """Decoder-only LM. `model(tokens_BL, segment_ids_BL=None, positions_BL=None) -> logits_BLV` (float32).

  segment_ids_BL > 0 mark packed documents (0 = padding); a token attends causally within its segment only.
  positions_BL (RoPE positions) default to the index inside each segment. `remat` names a policy in
  `model.remat.POLICIES`. The config is validated here (ValueError naming the key).
  """

  def __init__(self, cfg_model: Mapping[str, Any], *, rngs: nnx.Rngs, remat: str = "none"):
    cfg = config_lib.validate(cfg_model)
    if remat not in remat_lib.POLICIES:
      raise ValueError(f"remat={remat!r} (train.remat) is not one of {', '.join(remat_lib.POLICIES)}")
    self.cfg = ml_collections.FrozenConfigDict(cfg)
    self.remat = remat
    with axes.creation_context():
      self.embed = layers.Embed(cfg, rngs=rngs)
      unit = config_lib.layers_per_unit(cfg)  # the scan repeats units: one block, or a group with one MoE
      if cfg.scan_layers:
        @nnx.split_rngs(splits=cfg.num_layers // unit)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def make_stack(rngs):
          if unit > 1:
            return layers.LayerGroup(cfg, rngs=rngs)
          return layers.Block(cfg, rngs=rngs, moe=config_lib.is_moe_layer(cfg, 0))
        self.layers = make_stack(rngs)
      else:
        self.layers = nnx.List([layers.Block(cfg, rngs=rngs, moe=config_lib.is_moe_layer(cfg, i))
                                for i in range(cfg.num_layers)])
      self.final_norm = layers.Norm(cfg, rngs=rngs)
      if not cfg.tie_embeddings:
        self.unembed = layers.param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), cfg)

  def __call__(self, tokens_BL: jax.Array, segment_ids_BL: jax.Array | None = None,
               positions_BL: jax.Array | None = None, *, return_aux: bool = False):
    """-> logits_BLV float32; with return_aux, (logits_BLV, aux): aux holds the MoE router statistics
    (model.moe.STATS, float32 scalars averaged over the MoE layers; {} for a dense model)."""
    if tokens_BL.ndim != 2 or not jnp.issubdtype(tokens_BL.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer [batch, seq]; got {tokens_BL.dtype}{list(tokens_BL.shape)}")
    if segment_ids_BL is None:
      segment_ids_BL = jnp.ones(tokens_BL.shape, jnp.int32)
    segment_ids_BL = segment_ids_BL.astype(jnp.int32)
    if positions_BL is None:
      positions_BL = positions_from_segments(segment_ids_BL)
    cos_BLF, sin_BLF = rope.cos_sin(positions_BL, rope.inv_frequencies(self.cfg))
    x_BLD = self.embed(tokens_BL)

    def apply_block(graphdef, state, x_BLD, window):
      return nnx.merge(graphdef, state)(x_BLD, segment_ids_BL, cos_BLF, sin_BLF, window)

    windows = jnp.asarray(config_lib.layer_windows(self.cfg), jnp.int32)
    if self.cfg.scan_layers:
      graphdef, state = nnx.split(self.layers)
      def body(x_BLD, xs):
        layer_state, window = xs
        return apply_block(graphdef, layer_state, x_BLD, window)
      body = remat_lib.wrap(body, self.remat, prevent_cse=False)
      unit = config_lib.layers_per_unit(self.cfg)
      windows = windows.reshape(-1, unit) if unit > 1 else windows
      x_BLD, stats = jax.lax.scan(body, x_BLD, (state, windows))  # stats: [units] per MoE statistic
    else:
      stats = []
      for block, window in zip(self.layers, config_lib.layer_windows(self.cfg)):
        graphdef, state = nnx.split(block)
        step = remat_lib.wrap(lambda s, x, graphdef=graphdef, window=window: apply_block(graphdef, s, x, window),
                              self.remat)
        x_BLD, block_stats = step(state, x_BLD)
        stats += [block_stats] if block_stats else []
      stats = jax.tree.map(lambda *v: jnp.stack(v), *stats) if stats else {}
    aux = {k: jnp.mean(v) for k, v in stats.items()}  # mean over MoE layers (MaxText, Levanter)

    x_BLD = self.final_norm(x_BLD)
    if self.cfg.tie_embeddings:
      logits_BLV = self.embed.attend(x_BLD)
    else:
      logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, self.unembed[...].astype(config_lib.DTYPES[self.cfg.dtype]),
                              preferred_element_type=jnp.float32)
    logits_BLV = axes.constrain(logits_BLV.astype(jnp.float32), (BATCH, LENGTH, VOCAB))
    return (logits_BLV, aux) if return_aux else logits_BLV
