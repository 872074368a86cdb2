"""`train.objective=lm`: next-token cross-entropy over the loss mask, plus z-loss (pretraining).

loss = (1/T) sum_{t: m_t=1} -log p(x_{t+1} | x_{<=t}),   z_loss = (c/T) sum_{t: m_t=1} logsumexp(logits_t)^2,
T = sum_t m_t over the global batch (PaLM's z-loss, Chowdhery et al. 2022, sec. 5).

With data.objective_mixture (UL2 denoisers, data/denoise.py) the batch also holds `prefix` (a denoised example's
bidirectional input, passed to the model by `Objective.forward`) and the loss mask covers only its targets.
"""
from __future__ import annotations

import math

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

  def sums(self, model, batch, extras, frozen):
    del extras, frozen
    logits_BLV, moe_sums = self.forward(model, batch)
    sums = loss_lib.loss_sums(logits_BLV, batch["targets"], batch["loss_mask"], self.config.train.z_loss)
    return {**sums, **moe_sums}

  def normalizer(self, batch):
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

  def loss(self, sums):
    return sums["ce"] + sums["z"]

  def metrics(self, sums, normalizer):
    loss, z_loss = sums["ce"] / normalizer, sums["z"] / normalizer
    return {"loss": loss, "z_loss": z_loss, "total_loss": loss + z_loss, "tokens": sums["tokens"]}

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {"loss_sum": sums["ce"], "tokens": sums["tokens"]}

  def eval_metrics(self, sums):
    """eval_loss = held-out cross-entropy per loss token (nats); eval_perplexity = exp(eval_loss)."""
    if sums["tokens"] == 0:
      raise ValueError("the eval batches hold no loss tokens; raise data.eval_fraction or set train.eval_every=0")
    eval_loss = sums["loss_sum"] / sums["tokens"]
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 80.0))}
