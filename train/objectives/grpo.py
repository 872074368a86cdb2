"""`train.objective=grpo`: the GRPO family's clipped objectives with group-normalised advantages and an optional KL.

The batch is a rollout batch as for PPO (train/objectives/ppo.py) without values or returns: `advantages` holds,
on every completion token of a sample, its group-normalised reward (policy.group_advantages; no critic). With
beta = rl.kl_coef, the per-token loss

  l_t = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta * k3(logp_t, ref_logp_t)

is aggregated by rl.loss (policy.aggregate / policy.loss_normalizer, TRL's loss_type in
trl/trainer/grpo_trainer.py `_compute_loss`):
  grpo     rho = exp(logp_t - old_logp_t), the per-sequence mean of l, averaged over rollouts (Shao et al. 2024)
  dr_grpo  the same rho, sum of l over the batch / (rollouts x rl.max_new_tokens) (Liu et al. 2025, "Understanding
           R1-Zero-Like Training"); with rl.scale_rewards=auto also no std division of the rewards
  dapo     the same rho, sum of l over the batch / its completion tokens (Yu et al. 2025, eq. 8)
  gspo     rho = exp(mean_t (logp_t - old_logp_t)) per sequence, clipped per sequence, aggregated as grpo
           (Zheng et al. 2025, "Group Sequence Policy Optimization")
The clipped term is multiplied by the rollout's truncated importance weight `tis_weight` (policy.py; 1 unless
rollouts are asynchronous). k3 = exp(ref - logp) - (ref - logp) - 1 is the low-variance, non-negative KL estimator GRPO uses (Shao et al.
2024, eq. 4). With beta = 0 no reference model is kept. PPO-ptx rows (rl.ptx_coef) are aggregated the same way
over their own tokens. `eval_sums` scores a rollout (policy and reference log-probs per token).
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
  sum_keys = ("policy", "kl", "kl_tokens", "entropy", "clipped", "ratio_dev", "tokens")
  metric_keys = ("loss", "policy_loss", "kl_k3", "entropy", "clip_frac", "ratio_dev", "tokens")
  eval_keys = ("logp", "ref_logp")

  def __init__(self, config):
    super().__init__(config)
    self.frozen_models = ("reference",) if config.rl.kl_coef > 0 else ()
    policy.with_ptx(self)
    if config.rl.ptx_coef:
      self.sum_keys = (*self.sum_keys, "ptx_loss")

  def _logp(self, model, batch):
    logits_BLV = model(batch["inputs"], batch["segment_ids"], batch["positions"]) / self.config.rl.temperature
    return logprobs.token_logprobs(logits_BLV, batch["targets"])[0], logits_BLV

  def sums(self, model, batch, extras, frozen):
    del extras
    r = self.config.rl
    logp_BL, logits_BLV = self._logp(model, batch)
    mask_BL = batch["loss_mask"].astype(jnp.float32)
    logp_ratio, old_ratio = logp_BL, batch["old_logp"]
    if r.loss == "gspo":
      logp_ratio, old_ratio = policy.sequence_log_ratio(logp_BL, batch["old_logp"], mask_BL), 0.0
    pg_BL, clipped_BL = policy.clipped_policy_loss(logp_ratio, old_ratio, batch["advantages"], r.clip, r.clip_high)
    pg_BL, clipped_BL = (jnp.broadcast_to(x, logp_BL.shape) for x in (pg_BL, clipped_BL))
    pg_BL = policy.importance_weighted(pg_BL, batch)
    kl_BL = jnp.zeros_like(logp_BL)
    if self.frozen_models:
      kl_BL = policy.kl_estimate(logp_BL, self._logp(frozen["reference"], batch)[0], "k3")
    total = lambda x_BL: jnp.sum(x_BL * mask_BL)
    return {"policy": policy.aggregate(pg_BL, mask_BL, r.loss), "kl": policy.aggregate(kl_BL, mask_BL, r.loss),
            "kl_tokens": total(kl_BL), "entropy": total(policy.entropy(logits_BLV)), "clipped": total(clipped_BL),
            "ratio_dev": total(jnp.abs(jnp.exp(logp_BL - batch["old_logp"]) - 1.0)), "tokens": jnp.sum(mask_BL),
            **policy.ptx_sums(self, logits_BLV, batch, r.loss)}

  def normalizer(self, batch):
    return policy.loss_normalizer(batch, self.config.rl.loss, self.config.rl.max_new_tokens)

  def loss(self, sums):
    r = self.config.rl
    return sums["policy"] + r.kl_coef * sums["kl"] + (r.ptx_coef * sums["ptx_loss"] if r.ptx_coef else 0.0)

  def metrics(self, sums, normalizer):
    """loss and policy_loss as rl.loss aggregates them; kl_k3 (the k3 estimate of KL(policy || reference), 0
    without a reference), entropy, clip_frac and ratio_dev are means per completion token."""
    per_token = lambda k: sums[k] / jnp.maximum(sums["tokens"], 1.0)
    return {"loss": self.loss(sums) / normalizer, "policy_loss": sums["policy"] / normalizer,
            "kl_k3": per_token("kl_tokens"), "entropy": per_token("entropy"), "clip_frac": per_token("clipped"),
            "ratio_dev": per_token("ratio_dev"), "tokens": sums["tokens"], **policy.ptx_metrics(self, sums)}

  def eval_sums(self, model, batch, extras, frozen):
    """Per-token rollout scores [B, L]: the policy's and the reference's log-probs (the policy's when beta=0)."""
    del extras
    logp_BL, _ = self._logp(model, batch)
    ref_logp_BL = self._logp(frozen["reference"], batch)[0] if self.frozen_models else logp_BL
    return {"logp": logp_BL, "ref_logp": ref_logp_BL}

  def eval_metrics(self, sums):
    """Means of the scores over every position (the RL loop reads the per-token arrays themselves)."""
    return {f"eval_{k}_mean": float(jnp.mean(jnp.asarray(v))) for k, v in sums.items()}
