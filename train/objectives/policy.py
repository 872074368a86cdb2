"""Policy-gradient math shared by the PPO and GRPO objectives and the RL loop (train/rl/loop.py).

Everything is per token on the [B, L] layout of a training batch: position t scores `targets[t]`, the completion
tokens carry mask 1. Log-probabilities are natural logs of softmax(logits / temperature).

  ratio_t      = exp(logp_t - old_logp_t)
  policy loss  = -min(ratio_t A_t, clip(ratio_t, 1 - eps, 1 + eps) A_t)            (Schulman et al. 2017, eq. 7)
  value loss   = 1/2 max((V_t - R_t)^2, (clip(V_t, V_old_t - eps_v, V_old_t + eps_v) - R_t)^2)
                                                                 (OpenAI baselines ppo2; TRL PPOTrainer)
  KL estimators of KL(pi || ref) from a sample of pi, d = logp - ref_logp (Schulman, "Approximating KL
  divergence", 2020):  k1 = d,  k2 = d^2 / 2,  k3 = exp(-d) - 1 + d   (k3: unbiased, >= 0; GRPO's choice)
  GAE          delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lam)^l delta_{t+l}   (Schulman et al. 2016)
  group advantages (GRPO, Shao et al. 2024): A_i = (r_i - mean_group r) / (std_group r + eps)
  PPO-ptx (Ouyang et al. 2022, eq. 2): with rl.ptx_coef = gamma, rows of held-in SFT conversations ride along in
               the batch (`ptx_mask` 1 on their assistant tokens, loss_mask 0) and the loss adds
               gamma * sum_t ptx_mask_t (-log p_t) at temperature 1, divided by the same T as the policy terms
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-sample estimate of KL(pi || ref) from log-probabilities of tokens drawn from pi (module docstring)."""
  d = logp - ref_logp
  if kind == "k1":
    return d
  if kind == "k2":
    return 0.5 * jnp.square(d)
  if kind == "k3":
    return jnp.expm1(-d) + d
  raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def with_ptx(objective) -> None:
  """Adds the PPO-ptx sums (`ptx`, `ptx_tokens`) and metric (`ptx_nll`, their mean per token) to a policy
  objective when rl.ptx_coef > 0 (module docstring)."""
  if objective.config.rl.ptx_coef:
    objective.sum_keys = (*objective.sum_keys, "ptx", "ptx_tokens")
    objective.metric_keys = (*objective.metric_keys, "ptx_nll")


def ptx_sums(objective, logits_over_T_BLV, batch) -> dict[str, jax.Array]:
  """{"ptx": the ptx tokens' summed negative log-likelihood at temperature 1, "ptx_tokens"} ({} when off)."""
  from model import logprobs  # pylint: disable=g-import-not-at-top
  r = objective.config.rl
  if not r.ptx_coef:
    return {}
  mask_BL = batch["ptx_mask"].astype(jnp.float32)
  logp_BL, _ = logprobs.token_logprobs(logits_over_T_BLV * r.temperature, batch["targets"])
  return {"ptx": -jnp.sum(logp_BL * mask_BL), "ptx_tokens": jnp.sum(mask_BL)}


def ptx_metrics(objective, sums) -> dict[str, jax.Array]:
  if not objective.config.rl.ptx_coef:
    return {}
  return {"ptx_nll": sums["ptx"] / jnp.maximum(sums["ptx_tokens"], 1.0)}


def clipped_policy_loss(logp_BL, old_logp_BL, adv_BL, clip: float) -> tuple[jax.Array, jax.Array]:
  """(per-token clipped surrogate loss [B, L], 1.0 where the clipped branch was taken [B, L]); module docstring."""
  ratio_BL = jnp.exp(logp_BL - old_logp_BL)
  unclipped_BL = ratio_BL * adv_BL
  clipped_BL = jnp.clip(ratio_BL, 1.0 - clip, 1.0 + clip) * adv_BL
  return -jnp.minimum(unclipped_BL, clipped_BL), (clipped_BL < unclipped_BL).astype(jnp.float32)


def clipped_value_loss(values_BL, old_values_BL, returns_BL, clip: float) -> tuple[jax.Array, jax.Array]:
  """(per-token clipped value loss [B, L], 1.0 where the clipped error was the larger [B, L])."""
  v_clipped_BL = old_values_BL + jnp.clip(values_BL - old_values_BL, -clip, clip)
  plain_BL, clipped_BL = jnp.square(values_BL - returns_BL), jnp.square(v_clipped_BL - returns_BL)
  return 0.5 * jnp.maximum(plain_BL, clipped_BL), (clipped_BL > plain_BL).astype(jnp.float32)


def entropy(logits_BLV: jax.Array) -> jax.Array:
  """Entropy of softmax(logits) per position [B, L] (nats): -sum_v p_v log p_v."""
  logp_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp_BLV) * logp_BLV, axis=-1)


def gae(rewards_BL, values_BL, mask_BL, gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
  """(advantages [B, L], returns = advantages + values [B, L]) over each row's masked (completion) tokens.

  The masked tokens of a row are one episode in order; positions outside the mask are skipped (their advantage
  is 0) and the value after the last masked token is 0 (the episode ends there). A reverse `lax.scan`.
  """
  mask = jnp.asarray(mask_BL, jnp.float32)
  rewards, values = jnp.asarray(rewards_BL, jnp.float32) * mask, jnp.asarray(values_BL, jnp.float32) * mask

  def back(carry, xs):
    next_value_B, next_adv_B = carry
    r_B, v_B, m_B = xs
    delta_B = r_B + gamma * next_value_B - v_B
    adv_B = delta_B + gamma * lam * next_adv_B
    # Unmasked positions pass the carry through unchanged (they are not steps of the episode).
    return (jnp.where(m_B > 0, v_B, next_value_B), jnp.where(m_B > 0, adv_B, next_adv_B)), adv_B * m_B

  zeros_B = jnp.zeros(rewards.shape[0], jnp.float32)
  _, adv_LB = jax.lax.scan(back, (zeros_B, zeros_B), (rewards.T, values.T, mask.T), reverse=True)
  adv_BL = adv_LB.T
  return adv_BL, (adv_BL + values) * mask


def whiten(x_BL: np.ndarray, mask_BL: np.ndarray, eps: float = 1e-8) -> np.ndarray:
  """(x - mean) / (std + eps) over the masked entries (mean and population std over them); 0 elsewhere."""
  m = np.asarray(mask_BL, np.float64) > 0
  x = np.asarray(x_BL, np.float64)
  mean, std = x[m].mean(), x[m].std()
  return np.where(m, (x - mean) / (std + eps), 0.0).astype(np.float32)


def group_advantages(rewards_NG, valid_NG, eps: float = 1e-4) -> jax.Array:
  """GRPO advantages [N, G] of N prompts x G samples: (r - group mean) / (group std + eps) over the valid samples
  of each group (population std); 0 for invalid samples (dropped rollouts, whose reward may be NaN)."""
  valid_NG = jnp.asarray(valid_NG, bool)
  r_NG = jnp.where(valid_NG, jnp.asarray(rewards_NG, jnp.float32), 0.0)
  count_N1 = jnp.maximum(jnp.sum(valid_NG, axis=1, keepdims=True), 1)
  mean_N1 = jnp.sum(r_NG, axis=1, keepdims=True) / count_N1
  std_N1 = jnp.sqrt(jnp.sum(jnp.where(valid_NG, jnp.square(r_NG - mean_N1), 0.0), axis=1, keepdims=True) / count_N1)
  return jnp.where(valid_NG, (r_NG - mean_N1) / (std_N1 + eps), 0.0)
