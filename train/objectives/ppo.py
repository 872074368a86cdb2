"""`train.objective=ppo`: PPO's clipped policy loss and clipped value loss on a rollout batch (train/rl/loop.py).

The batch is a language-model batch of prompt + completion rows (loss_mask 1 on the completion tokens) plus,
per token, the rollout's `old_logp` (recomputed with the training forward pass before the first epoch),
whitened `advantages`, GAE `returns` and `old_values`. The value head sits on the policy trunk: V_t = w . h_t + b
with h_t the final-norm hidden state at position t (`model.features`), w and b the objective's extra parameters;
the trunk is shared, so the value loss also shapes it (scaled by rl.vf_coef). With T = completion tokens of the
global batch:

  loss = (1/T) sum_t m_t [ policy_t + vf_coef * value_t - ent_coef * H_t ]      (train/objectives/policy.py)

where log-probabilities come from softmax(logits / rl.temperature), the distribution the sampler drew from, and
policy_t carries the rollout's truncated importance weight `tis_weight` (1 unless rollouts are asynchronous).
`eval_sums` is the rollout scorer: per-token log-probs of the policy and the frozen `reference`, and values.
"""
from __future__ import annotations

import jax.numpy as jnp

from model import logprobs
from train.objectives import base
from train.objectives import policy

RL_BATCH_KEYS = {**base.TOKEN_BATCH_KEYS, "old_logp": jnp.float32, "advantages": jnp.float32,
                 "ptx_mask": jnp.float32, "tis_weight": jnp.float32}


class ProximalPolicyOptimization(base.Objective):
  """Clipped surrogate + clipped value loss + entropy bonus over the completion tokens (module docstring)."""
  name = "ppo"
  batch_keys = {**RL_BATCH_KEYS, "returns": jnp.float32, "old_values": jnp.float32}
  sum_keys = ("policy", "value", "entropy", "clipped", "value_clipped", "approx_kl", "ratio_dev", "tokens")
  metric_keys = ("loss", "policy_loss", "value_loss", "entropy", "clip_frac", "value_clip_frac", "approx_kl",
                 "ratio_dev", "tokens")
  eval_keys = ("logp", "ref_logp", "values")
  frozen_models = ("reference",)

  def __init__(self, config):
    super().__init__(config)
    self.extra_params = {"value_head": ((config.model.d_model,), ("embed",)), "value_bias": ((1,), (None,))}
    policy.with_ptx(self)

  def _forward(self, model, batch, extras):
    """(log p(targets) [B, L], entropy [B, L], values [B, L], logits / temperature [B, L, V]) under
    softmax(logits / temperature)."""
    x_BLD = model.features(batch["inputs"], batch["segment_ids"], batch["positions"])
    logits_BLV = model.logits(x_BLD) / self.config.rl.temperature
    logp_BL, _ = logprobs.token_logprobs(logits_BLV, batch["targets"])
    values_BL = jnp.einsum("bld,d->bl", x_BLD.astype(jnp.float32), extras["value_head"]) + extras["value_bias"][0]
    return logp_BL, policy.entropy(logits_BLV), values_BL, logits_BLV

  def sums(self, model, batch, extras, frozen):
    del frozen
    r = self.config.rl
    logp_BL, entropy_BL, values_BL, logits_BLV = self._forward(model, batch, extras)
    mask_BL = batch["loss_mask"].astype(jnp.float32)
    pg_BL, clipped_BL = policy.clipped_policy_loss(logp_BL, batch["old_logp"], batch["advantages"], r.clip,
                                                   r.clip_high)
    pg_BL = policy.importance_weighted(pg_BL, batch)
    vf_BL, vclipped_BL = policy.clipped_value_loss(values_BL, batch["old_values"], batch["returns"], r.value_clip)
    total = lambda x_BL: jnp.sum(x_BL * mask_BL)
    return {"policy": total(pg_BL), "value": total(vf_BL), "entropy": total(entropy_BL),
            "clipped": total(clipped_BL), "value_clipped": total(vclipped_BL),
            "approx_kl": total(policy.kl_estimate(batch["old_logp"], logp_BL, "k3")),
            "ratio_dev": total(jnp.abs(jnp.exp(logp_BL - batch["old_logp"]) - 1.0)), "tokens": jnp.sum(mask_BL),
            **policy.ptx_sums(self, logits_BLV, batch)}

  def normalizer(self, batch):
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

  def loss(self, sums):
    r = self.config.rl
    ptx = r.ptx_coef * sums["ptx"] if r.ptx_coef else 0.0
    return sums["policy"] + r.vf_coef * sums["value"] - r.ent_coef * sums["entropy"] + ptx

  def metrics(self, sums, normalizer):
    """Means per completion token; approx_kl = k3 estimate of KL(old || new); ratio_dev = mean |ratio - 1|."""
    mean = lambda k: sums[k] / normalizer
    return {"loss": self.loss(sums) / normalizer, "policy_loss": mean("policy"), "value_loss": mean("value"),
            "entropy": mean("entropy"), "clip_frac": mean("clipped"), "value_clip_frac": mean("value_clipped"),
            "approx_kl": mean("approx_kl"), "ratio_dev": mean("ratio_dev"), "tokens": sums["tokens"],
            **policy.ptx_metrics(self, sums)}

  def eval_sums(self, model, batch, extras, frozen):
    """Per-token rollout scores [B, L]: the policy's and the reference's log-probs, and the values."""
    logp_BL, _, values_BL, _ = self._forward(model, batch, extras)
    ref_logits_BLV = frozen["reference"](batch["inputs"], batch["segment_ids"], batch["positions"])
    ref_logp_BL, _ = logprobs.token_logprobs(ref_logits_BLV / self.config.rl.temperature, batch["targets"])
    return {"logp": logp_BL, "ref_logp": ref_logp_BL, "values": values_BL}

  def eval_metrics(self, sums):
    """Means of the scores over every position (the RL loop reads the per-token arrays themselves)."""
    return {f"eval_{k}_mean": float(jnp.mean(jnp.asarray(v))) for k, v in sums.items()}
