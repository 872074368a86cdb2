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
  group advantages (GRPO, Shao et al. 2024): A_i = (r_i - mean_group r) / (std r + 1e-4), std over the group
               (rl.scale_rewards=group), over the whole batch (batch) or no division (none: Dr. GRPO, Liu et al. 2025);
               std with Bessel's correction, as TRL (trl/trainer/grpo_trainer.py, `nanstd` in trl/trainer/utils.py)
  clip-higher (DAPO, Yu et al. 2025): clip(ratio_t, 1 - eps_low, 1 + eps_high), eps_low = rl.clip, eps_high = rl.clip_high
  sequence ratio (GSPO, Zheng et al. 2025): s_i = exp((1/|y_i|) sum_t (logp_t - old_logp_t)), clipped per sequence
  aggregation of a per-token loss l over the rows i with completion masks m (rl.loss; TRL's loss_type):
    grpo, gspo   (1/R) sum_i (sum_t m l / sum_t m)   R = rollout rows (DeepSeekMath's per-sequence mean)
    dapo         (1/T) sum_i sum_t m l               T = completion tokens of the step's batch (DAPO eq. 8)
    dr_grpo      (1/(R L_max)) sum_i sum_t m l       L_max = rl.max_new_tokens (Dr. GRPO: no length normalisation)
  truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
               RL training"; TRL's token_truncate mode): when the sampler's policy mu lags the learner's (asynchronous
               rollouts), the clipped term is weighted per token by w_t = min(exp(old_logp_t - mu_logp_t), rl.tis_cap)
  soft overlong punishment (DAPO eq. 13), L_c = rl.overlong_buffer: 0 for |y| <= L_max - L_c,
               ((L_max - L_c) - |y|) / L_c up to L_max, -1 beyond
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


def ptx_sums(objective, logits_over_T_BLV, batch, loss: str | None = None) -> dict[str, jax.Array]:
  """{"ptx": the ptx tokens' summed negative log-likelihood at temperature 1, "ptx_tokens"} ({} when off); with
  `loss` (rl.loss) also "ptx_loss", that likelihood aggregated as the policy terms are (`aggregate`)."""
  from model import logprobs  # pylint: disable=g-import-not-at-top
  r = objective.config.rl
  if not r.ptx_coef:
    return {}
  mask_BL = batch["ptx_mask"].astype(jnp.float32)
  logp_BL, _ = logprobs.token_logprobs(logits_over_T_BLV * r.temperature, batch["targets"])
  out = {"ptx": -jnp.sum(logp_BL * mask_BL), "ptx_tokens": jnp.sum(mask_BL)}
  if loss is not None:
    out["ptx_loss"] = aggregate(-logp_BL, mask_BL, loss)
  return out


def ptx_metrics(objective, sums) -> dict[str, jax.Array]:
  if not objective.config.rl.ptx_coef:
    return {}
  return {"ptx_nll": sums["ptx"] / jnp.maximum(sums["ptx_tokens"], 1.0)}


def clipped_policy_loss(logp_BL, old_logp_BL, adv_BL, clip: float,
                        clip_high: float | None = None) -> tuple[jax.Array, jax.Array]:
  """(per-token clipped surrogate loss [B, L], 1.0 where the clipped branch was taken [B, L]); module docstring.
  `clip_high` (None or 0: `clip`) is DAPO's upper clip range; logp / old_logp may be [B, 1] (GSPO's sequence
  log-ratio, broadcast over the tokens)."""
  ratio_BL = jnp.exp(logp_BL - old_logp_BL)
  unclipped_BL = ratio_BL * adv_BL
  clipped_BL = jnp.clip(ratio_BL, 1.0 - clip, 1.0 + (clip_high or clip)) * adv_BL
  return -jnp.minimum(unclipped_BL, clipped_BL), (clipped_BL < unclipped_BL).astype(jnp.float32)


def importance_weighted(x_BL, batch) -> jax.Array:
  """x [B, L] times the batch's truncated importance weights `tis_weight` (module docstring) when it has them."""
  return x_BL * batch["tis_weight"] if "tis_weight" in batch else x_BL


def tis_weights(old_logp_BL, sampler_logp_BL, mask_BL, cap: float) -> np.ndarray:
  """TIS weights [B, L]: min(exp(old_logp - sampler_logp), cap) on the masked tokens, 1 elsewhere (NumPy)."""
  w = np.minimum(np.exp(np.asarray(old_logp_BL, np.float64) - np.asarray(sampler_logp_BL, np.float64)), cap)
  return np.where(np.asarray(mask_BL) > 0, w, 1.0).astype(np.float32)


def sequence_log_ratio(logp_BL, old_logp_BL, mask_BL) -> jax.Array:
  """GSPO's log importance ratio per sequence [B, 1]: the masked mean of logp - old_logp (0 for empty rows)."""
  mask_BL = mask_BL.astype(jnp.float32)
  return (jnp.sum((logp_BL - old_logp_BL) * mask_BL, axis=1, keepdims=True)
          / jnp.maximum(jnp.sum(mask_BL, axis=1, keepdims=True), 1.0))


LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")


def aggregate(x_BL, mask_BL, loss: str) -> jax.Array:
  """The numerator of rl.loss's aggregation of a per-token loss (module docstring): per-sequence means summed for
  grpo / gspo, the masked sum for dapo / dr_grpo. Divided by `loss_normalizer`'s figure."""
  mask_BL = mask_BL.astype(jnp.float32)
  if loss in ("grpo", "gspo"):
    return jnp.sum(jnp.sum(x_BL * mask_BL, axis=1) / jnp.maximum(jnp.sum(mask_BL, axis=1), 1.0))
  if loss in ("dapo", "dr_grpo"):
    return jnp.sum(x_BL * mask_BL)
  raise ValueError(f"unknown rl.loss {loss!r}; use one of {', '.join(LOSSES)}")


def loss_normalizer(batch, loss: str, max_new_tokens: int) -> jax.Array:
  """rl.loss's denominator for a batch (module docstring): R, T or R x L_max, at least 1. The rollout rows R are
  the rows with tokens that are not PPO-ptx rows (a rollout whose loss mask was zeroed still counts, as in TRL's
  mean over the batch)."""
  if loss == "dapo":
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
  rollout_B = jnp.any(batch["segment_ids"] > 0, axis=1)
  if "ptx_mask" in batch:
    rollout_B &= ~jnp.any(batch["ptx_mask"] > 0, axis=1)
  rows = jnp.maximum(jnp.sum(rollout_B.astype(jnp.float32)), 1.0)
  return rows * max_new_tokens if loss == "dr_grpo" else rows


def overlong_penalty(lengths, max_new_tokens: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong punishment per completion (module docstring), 0 when `buffer` is 0; lengths in tokens."""
  lengths = np.asarray(lengths, np.float64)
  if not buffer:
    return np.zeros_like(lengths)
  start = max_new_tokens - buffer
  return np.where(lengths <= start, 0.0, np.where(lengths <= max_new_tokens, (start - lengths) / buffer, -1.0))


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


def ppo_token_rewards(scores_B, kl_BL, mask_BL, kl_coef: float) -> jax.Array:
  """PPO's per-token rewards [B, L] (Ziegler et al. 2019; TRL's PPOTrainer): -kl_coef * kl_t on every completion
  token (kl_t = logp_t - ref_logp_t, the k1 estimate) plus the sequence's score [B] on its last completion token
  (none on a row without completion tokens)."""
  mask_BL = jnp.asarray(mask_BL, jnp.float32)
  rewards_BL = -kl_coef * jnp.asarray(kl_BL, jnp.float32) * mask_BL
  any_B = jnp.any(mask_BL > 0, axis=1)
  last_B = jnp.where(any_B, mask_BL.shape[1] - 1 - jnp.argmax(mask_BL[:, ::-1], axis=1), 0)
  return rewards_BL.at[jnp.arange(mask_BL.shape[0]), last_B].add(jnp.where(any_B, jnp.asarray(scores_B), 0.0))


def whiten(x_BL: np.ndarray, mask_BL: np.ndarray, eps: float = 1e-8) -> np.ndarray:
  """(x - mean) / (std + eps) over the masked entries (mean and population std over them); 0 elsewhere."""
  m = np.asarray(mask_BL, np.float64) > 0
  x = np.asarray(x_BL, np.float64)
  mean, std = x[m].mean(), x[m].std()
  return np.where(m, (x - mean) / (std + eps), 0.0).astype(np.float32)


def group_advantages(rewards_NG, valid_NG, scale: str = "group", eps: float = 1e-4) -> jax.Array:
  """GRPO advantages [N, G] of N prompts x G samples over the valid samples (module docstring): r - group mean,
  divided by std + eps of the group (`scale`=group), of every valid reward of the batch (batch) or not (none);
  std with Bessel's correction (0 for a single sample); 0 for invalid samples (dropped rollouts, whose reward may
  be NaN)."""
  valid_NG = jnp.asarray(valid_NG, bool)
  r_NG = jnp.where(valid_NG, jnp.asarray(rewards_NG, jnp.float32), 0.0)
  axis = None if scale == "batch" else 1
  count_N1 = jnp.sum(valid_NG, axis=1, keepdims=True)
  mean_N1 = jnp.sum(r_NG, axis=1, keepdims=True) / jnp.maximum(count_N1, 1)
  center = jnp.sum(r_NG, axis=axis, keepdims=True) / jnp.maximum(jnp.sum(valid_NG, axis=axis, keepdims=True), 1)
  n = jnp.sum(valid_NG, axis=axis, keepdims=True)
  var = jnp.sum(jnp.where(valid_NG, jnp.square(r_NG - center), 0.0), axis=axis, keepdims=True) / jnp.maximum(n - 1, 1)
  adv_NG = r_NG - mean_N1
  if scale in ("group", "batch"):
    adv_NG = adv_NG / (jnp.sqrt(var) + eps)
  elif scale != "none":
    raise ValueError(f"unknown rl.scale_rewards {scale!r}; use group, batch or none")
  return jnp.where(valid_NG, adv_NG, 0.0)


def zero_variance_groups(rewards_NG, valid_NG) -> np.ndarray:
  """[N] True where a group's valid rewards are all equal (or fewer than two are valid): no learning signal,
  the groups DAPO's dynamic sampling drops."""
  r_NG, v_NG = np.asarray(rewards_NG, np.float64), np.asarray(valid_NG, bool)
  hi_N, lo_N = np.max(np.where(v_NG, r_NG, -np.inf), axis=1), np.min(np.where(v_NG, r_NG, np.inf), axis=1)
  return (np.sum(v_NG, axis=1) < 2) | (hi_N == lo_N)
