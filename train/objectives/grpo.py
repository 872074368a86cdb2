"""`train.objective=grpo`: GRPO's clipped objective with group-normalised advantages and an optional KL term.

The batch is a rollout batch as for PPO (train/objectives/ppo.py) without values or returns: `advantages` holds,
on every completion token of a sample, its group-normalised reward (policy.group_advantages; no critic). With
beta = rl.kl_coef and T = completion tokens of the global batch (token-level mean, as DAPO and TRL's
loss_type="dapo"; DeepSeekMath averages per sequence first):

  loss = (1/T) sum_t m_t [ -min(ratio_t A, clip(ratio_t, 1-eps, 1+eps) A) + beta * k3(logp_t, ref_logp_t) ]

k3 = exp(ref - logp) - (ref - logp) - 1 is the low-variance, non-negative KL estimator GRPO uses (Shao et al.
2024, eq. 4). With beta = 0 no reference model is kept. `eval_sums` scores a rollout (policy and reference
log-probs per token).
"""
from __future__ import annotations

import jax.numpy as jnp

from model import logprobs
from train.objectives import base
from train.objectives import policy
from train.objectives.ppo import RL_BATCH_KEYS


class GroupRelativePolicyOptimization(base.Objective):
  """Clipped surrogate with group advantages + beta * k3 KL over the completion tokens (module docstring)."""
  name = "grpo"
  batch_keys = RL_BATCH_KEYS
  sum_keys = ("policy", "kl", "entropy", "clipped", "ratio_dev", "tokens")
  metric_keys = ("loss", "policy_loss", "kl_k3", "entropy", "clip_frac", "ratio_dev", "tokens")
  eval_keys = ("logp", "ref_logp")

  def __init__(self, config):
    super().__init__(config)
    self.frozen_models = ("reference",) if config.rl.kl_coef > 0 else ()
    policy.with_ptx(self)

  def _logp(self, model, batch):
    logits_BLV = model(batch["inputs"], batch["segment_ids"], batch["positions"]) / self.config.rl.temperature
    return logprobs.token_logprobs(logits_BLV, batch["targets"])[0], logits_BLV

  def sums(self, model, batch, extras, frozen):
    del extras
    logp_BL, logits_BLV = self._logp(model, batch)
    mask_BL = batch["loss_mask"].astype(jnp.float32)
    pg_BL, clipped_BL = policy.clipped_policy_loss(logp_BL, batch["old_logp"], batch["advantages"],
                                                   self.config.rl.clip)
    kl_BL = jnp.zeros_like(logp_BL)
    if self.frozen_models:
      kl_BL = policy.kl_estimate(logp_BL, self._logp(frozen["reference"], batch)[0], "k3")
    total = lambda x_BL: jnp.sum(x_BL * mask_BL)
    return {"policy": total(pg_BL), "kl": total(kl_BL), "entropy": total(policy.entropy(logits_BLV)),
            "clipped": total(clipped_BL), "ratio_dev": total(jnp.abs(jnp.exp(logp_BL - batch["old_logp"]) - 1.0)),
            "tokens": jnp.sum(mask_BL), **policy.ptx_sums(self, logits_BLV, batch)}

  def normalizer(self, batch):
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

  def loss(self, sums):
    r = self.config.rl
    return sums["policy"] + r.kl_coef * sums["kl"] + (r.ptx_coef * sums["ptx"] if r.ptx_coef else 0.0)

  def metrics(self, sums, normalizer):
    """Means per completion token; kl_k3 = the k3 estimate of KL(policy || reference) (0 without a reference)."""
    mean = lambda k: sums[k] / normalizer
    return {"loss": self.loss(sums) / normalizer, "policy_loss": mean("policy"), "kl_k3": mean("kl"),
            "entropy": mean("entropy"), "clip_frac": mean("clipped"), "ratio_dev": mean("ratio_dev"),
            "tokens": sums["tokens"], **policy.ptx_metrics(self, sums)}

  def eval_sums(self, model, batch, extras, frozen):
    """Per-token rollout scores [B, L]: the policy's and the reference's log-probs (the policy's when beta=0)."""
    del extras
    logp_BL, _ = self._logp(model, batch)
    ref_logp_BL = self._logp(frozen["reference"], batch)[0] if self.frozen_models else logp_BL
    return {"logp": logp_BL, "ref_logp": ref_logp_BL}

  def eval_metrics(self, sums):
    """Means of the scores over every position (the RL loop reads the per-token arrays themselves)."""
    return {f"eval_{k}_mean": float(jnp.mean(jnp.asarray(v))) for k, v in sums.items()}
