"""`train.objective=lm`: next-token cross-entropy over the loss mask, plus z-loss (pretraining).

loss = (1/T) sum_{t: m_t=1} -log p(x_{t+1} | x_{<=t}),   z_loss = (c/T) sum_{t: m_t=1} logsumexp(logits_t)^2,
T = sum_t m_t over the global batch (PaLM's z-loss, Chowdhery et al. 2022, sec. 5).

With model.mtp_depth = D > 0 (DeepSeek-V3 sec. 2.2) the loss adds (w / D) sum_d L_d, w = train.mtp_loss_weight,
L_d = (1/T) sum_{t: m_{t+d}=1, same document} -log p_d(x_{t+d+1} | h_t^d), the same T as the main loss (as the
paper's 1/T); `mtp_loss` = (1/D) sum_d L_d is logged.

With data.objective_mixture (UL2 denoisers, data/denoise.py) the batch also holds `prefix` (a denoised example's
bidirectional input, passed to the model by `Objective.forward`) and the loss mask covers only its targets.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from train.core import loss as loss_lib
from train.objectives import base


class LanguageModel(base.Objective):
  """Token-level cross-entropy under `loss_mask`; the step minimises (ce + z) / tokens."""
  name = "lm"
  sum_keys = ("ce", "z", "tokens")
  metric_keys = ("loss", "z_loss", "total_loss", "tokens")
  eval_keys = ("loss_sum", "tokens")

  def __init__(self, config):
    super().__init__(config)
    if self.name == "lm" and config.data.get("objective_mixture"):
      self.batch_keys = {**base.TOKEN_BATCH_KEYS, "prefix": jnp.int32}
    self.mtp_depth = config.model.mtp_depth
    if self.mtp_depth:
      self.sum_keys, self.metric_keys = (*self.sum_keys, "mtp_ce"), (*self.metric_keys, "mtp_loss")

  def sums(self, model, batch, extras, frozen):
    del extras, frozen
    logits_BLV, moe_sums, *features = self.forward(model, batch, mtp=bool(self.mtp_depth))
    sums = loss_lib.loss_sums(logits_BLV, batch["targets"], batch["loss_mask"], self.config.train.z_loss)
    if self.mtp_depth:
      sums["mtp_ce"] = mtp_ce(model, features[0], batch)
    return {**sums, **moe_sums}

  def normalizer(self, batch):
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

  def loss(self, sums):
    mtp = self.config.train.mtp_loss_weight / self.mtp_depth * sums["mtp_ce"] if self.mtp_depth else 0.0
    return sums["ce"] + sums["z"] + mtp

  def metrics(self, sums, normalizer):
    loss, z_loss = sums["ce"] / normalizer, sums["z"] / normalizer
    out = {"loss": loss, "z_loss": z_loss, "total_loss": loss + z_loss, "tokens": sums["tokens"]}
    if self.mtp_depth:
      out["mtp_loss"] = sums["mtp_ce"] / (self.mtp_depth * normalizer)
      out["total_loss"] += self.config.train.mtp_loss_weight * out["mtp_loss"]
    return out

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {"loss_sum": sums["ce"], "tokens": sums["tokens"]}

  def eval_metrics(self, sums):
    """eval_loss = held-out cross-entropy per loss token (nats); eval_perplexity = exp(eval_loss)."""
    if sums["tokens"] == 0:
      raise ValueError("the eval batches hold no loss tokens; raise data.eval_fraction or set train.eval_every=0")
    eval_loss = sums["loss_sum"] / sums["tokens"]
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 80.0))}


def mtp_ce(model, features_DBLD, batch) -> jax.Array:
  """Sum over depths d = 1..D of the cross-entropy sums of the multi-token heads: depth d at position t predicts
  targets[t + d] (the token d + 1 ahead), counted where loss_mask[t + d] = 1 and t, t + d are in one document."""
  total = jnp.float32(0.0)
  seg_BL = batch["segment_ids"]
  for d in range(1, features_DBLD.shape[0] + 1):
    ahead = lambda a_BL, d=d: jnp.pad(a_BL[:, d:], ((0, 0), (0, d)))
    mask_BL = ahead(batch["loss_mask"]) * (ahead(seg_BL) == seg_BL)
    total += loss_lib.loss_sums(model.logits(features_DBLD[d - 1]), ahead(batch["targets"]), mask_BL, 0.0)["ce"]
  return total
