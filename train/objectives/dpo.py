"""`train.objective=dpo`: direct preference optimisation against a frozen reference (the starting weights).

Per pair (chosen c, rejected r), with sequence log-probabilities summed over the completion tokens only
(`*_loss_mask`: the prompt is context, not scored), policy pi and reference pi_ref:

  h = [log pi(c) - log pi_ref(c)] - [log pi(r) - log pi_ref(r)]             (nats)
  sigmoid  l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (DPO, Rafailov et al. 2023, eq. 7;
                                                                           eps = train.dpo_label_smoothing:
                                                                           conservative DPO, Mitchell 2023)
  ipo      l = (h - 1 / (2 beta))^2                                         (IPO, Azar et al. 2023, eq. 17, tau = beta)
  hinge    l = max(0, 1 - beta h)                                           (SLiC-HF, Zhao et al. 2023, as TRL's hinge)

loss = (1/N) sum_pairs [l + alpha nll(c)], N = pairs in the global batch, where nll(c) = -log pi(c) / |c| is the
chosen completion's mean per-token negative log-likelihood and alpha = train.dpo_rpo_alpha (RPO: Pang et al. 2024,
"Iterative Reasoning Preference Optimization", eq. 3; TRL's rpo_alpha averages over the batch's chosen tokens
instead of per pair); 0 leaves the preference loss alone (no z-loss). The NLL term keeps the chosen answers likely:
the sigmoid loss alone only widens the margin and can lower both sides' likelihood, moving probability to tokens
neither answer has (Pal et al. 2024, Smaug / DPOP), which costs greedy answers. `nll` is logged.
Implicit rewards (TRL's): chosen_reward = beta [log pi(c) - log pi_ref(c)], rejected_reward likewise,
reward_margin = chosen_reward - rejected_reward = beta h, reward_accuracy = fraction of pairs with margin > 0
(exactly 0 at the first step, where the policy is the reference and every margin is 0).
kl = the per-token KL(pi(.|prefix) || pi_ref(.|prefix)) over the whole vocabulary, summed over each sequence's
completion tokens and averaged over the 2N sequences: the KL along the preference data's completions (an exact
per-position quantity, not a sample estimate of the KL between sequence distributions).

Memory: the reference is a frozen copy of the weights (no gradients, no optimizer state) and its log-probabilities
are computed in every step without a backward pass, which costs one extra forward (about a third of a training
step's FLOPs) and no stored activations; precomputing them once over the dataset would save that forward but
tie the data to one reference and one tokenisation, so it is not done.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model import logprobs
from train.objectives import base
from train.objectives import distill
from train.objectives import pairs

LOSSES = ("sigmoid", "ipo", "hinge")
REFERENCE = "reference"


def dpo_losses(policy_chosen_B: jax.Array, policy_rejected_B: jax.Array, reference_chosen_B: jax.Array,
               reference_rejected_B: jax.Array, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0) -> jax.Array:
  """Per-pair preference losses [B] from sequence log-probabilities [B] (nats); formulas in the module docstring."""
  h_B = (policy_chosen_B - reference_chosen_B) - (policy_rejected_B - reference_rejected_B)
  if loss_type == "sigmoid":
    return (1.0 - label_smoothing) * jax.nn.softplus(-beta * h_B) + label_smoothing * jax.nn.softplus(beta * h_B)
  if loss_type == "ipo":
    return jnp.square(h_B - 1.0 / (2.0 * beta))
  if loss_type == "hinge":
    return jax.nn.relu(1.0 - beta * h_B)
  raise ValueError(f"config.train.dpo_loss={loss_type!r} is not one of {', '.join(LOSSES)}")


def token_kl(logits_BLV: jax.Array, reference_logits_BLV: jax.Array) -> jax.Array:
  """KL(softmax(logits) || softmax(reference_logits)) at every position [B, L], float32 nats."""
  logp_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
  logq_BLV = jax.nn.log_softmax(reference_logits_BLV.astype(jnp.float32), axis=-1)
  return distill.kl_divergence(logp_BLV, logq_BLV)


class DirectPreference(base.Objective):
  """DPO / IPO / hinge against the frozen reference (module docstring)."""
  name = "dpo"
  batch_keys = pairs.BATCH_KEYS
  frozen_models = (REFERENCE,)
  sum_keys = ("loss_sum", "pairs", "correct", "chosen", "rejected", "kl", "nll")
  metric_keys = ("loss", "reward_accuracy", "chosen_reward", "rejected_reward", "reward_margin", "kl", "nll",
                 "pairs")
  eval_keys = ("loss_sum", "pairs", "correct", "chosen", "rejected", "kl", "nll")

  def __init__(self, config):
    super().__init__(config)
    t = config.train
    if t.dpo_loss not in LOSSES:
      raise ValueError(f"config.train.dpo_loss={t.dpo_loss!r} is not one of {', '.join(LOSSES)}")
    if t.dpo_label_smoothing and t.dpo_loss != "sigmoid":
      raise ValueError(f"config.train.dpo_label_smoothing={t.dpo_label_smoothing} applies to the sigmoid loss only "
                       f"(config.train.dpo_loss={t.dpo_loss!r}); set it to 0 or use dpo_loss=sigmoid")

  def sequence_logprobs(self, model, batch) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """(completion log-probabilities [2B] in `pairs.both` row order, logits [2B, L, V], completion mask [2B, L],
    MoE sums) of `model` on a pair batch."""
    logits_2BLV, aux = model(pairs.both(batch, "inputs"), pairs.both(batch, "segment_ids"),
                             pairs.both(batch, "positions"), return_aux=True)
    mask_2BL = pairs.both(batch, "loss_mask")
    logp_2B = logprobs.sequence_logprobs(logits_2BLV, pairs.both(batch, "targets"), mask_2BL)["sum"][:, 0]
    return logp_2B, logits_2BLV, mask_2BL, pairs.moe_sums(aux, self.config.train.grad_accum)

  def sums(self, model, batch, extras, frozen):
    del extras
    t = self.config.train
    policy_2B, logits_2BLV, mask_2BL, moe = self.sequence_logprobs(model, batch)
    reference_2B, reference_logits_2BLV, _, _ = jax.lax.stop_gradient(
        self.sequence_logprobs(frozen[REFERENCE], batch))
    (policy_c, policy_r), (reference_c, reference_r) = pairs.split(policy_2B), pairs.split(reference_2B)
    losses_B = dpo_losses(policy_c, policy_r, reference_c, reference_r, t.dpo_beta, t.dpo_loss,
                          t.dpo_label_smoothing)
    chosen_B, rejected_B = t.dpo_beta * (policy_c - reference_c), t.dpo_beta * (policy_r - reference_r)
    kl = jnp.sum(jax.lax.stop_gradient(token_kl(logits_2BLV, reference_logits_2BLV)) * mask_2BL)
    tokens_c, _ = pairs.split(jnp.sum(mask_2BL, axis=1))
    nll_B = -policy_c / jnp.maximum(tokens_c, 1.0) * (tokens_c > 0)  # padding pairs have no tokens: 0
    return {"loss_sum": jnp.sum(losses_B + t.dpo_rpo_alpha * nll_B),
            "pairs": jnp.asarray(losses_B.shape[0], jnp.float32),
            "correct": jnp.sum((chosen_B > rejected_B).astype(jnp.float32)), "chosen": jnp.sum(chosen_B),
            "rejected": jnp.sum(rejected_B), "kl": kl, "nll": jnp.sum(nll_B), **moe}

  def normalizer(self, batch):
    return pairs.pair_count(batch)

  def loss(self, sums):
    return sums["loss_sum"]

  def metrics(self, sums, normalizer):
    chosen, rejected = sums["chosen"] / normalizer, sums["rejected"] / normalizer
    return {"loss": sums["loss_sum"] / normalizer, "reward_accuracy": sums["correct"] / normalizer,
            "chosen_reward": chosen, "rejected_reward": rejected, "reward_margin": chosen - rejected,
            "kl": sums["kl"] / (2.0 * normalizer), "nll": sums["nll"] / normalizer, "pairs": sums["pairs"]}

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {k: sums[k] for k in self.eval_keys}

  def eval_metrics(self, sums):
    """Held-out `metrics` with an eval_ prefix: eval_loss, eval_reward_accuracy, eval_reward_margin, eval_kl,
    eval_nll."""
    if sums["pairs"] == 0:
      raise ValueError("the eval batches hold no pairs; raise data.eval_fraction or set train.eval_every=0")
    n = sums["pairs"]
    return {"eval_loss": sums["loss_sum"] / n, "eval_reward_accuracy": sums["correct"] / n,
            "eval_chosen_reward": sums["chosen"] / n, "eval_rejected_reward": sums["rejected"] / n,
            "eval_reward_margin": (sums["chosen"] - sums["rejected"]) / n, "eval_kl": sums["kl"] / (2 * n),
            "eval_nll": sums["nll"] / n}
