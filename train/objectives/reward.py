"""`train.objective=reward`: a reward model trained on preference pairs with the Bradley-Terry loss.

The reward of a sequence is a scalar head w [D] on the final-normed residual stream at its last non-padding
token: r = w . x_last (the transformer trunk is the language model's, started from a pretrained or SFT run).
Per pair (chosen c, rejected r, margin m):

  loss = (1/N) sum_pairs -log sigmoid(r_c - r_r - m)                     (Bradley-Terry; margin as Llama 2, sec. 3.2.2)
  center_loss = (lambda/N) sum_pairs (r_c + r_r)^2                          (lambda = train.reward_center; TRL's
                                                                            center_rewards_coefficient, Eisenstein et
                                                                            al. 2023: keeps rewards near zero mean)

N = pairs in the global batch. The step minimises loss + center_loss; `loss` is logged alone, `center_loss` and
`total_loss` beside it. reward_accuracy = fraction of pairs with r_c > r_r; reward_margin = mean of r_c - r_r.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from train.objectives import base
from train.objectives import pairs

HEAD = "reward_head"


def bradley_terry(chosen_B: jax.Array, rejected_B: jax.Array, margin_B: jax.Array) -> jax.Array:
  """Per-pair loss -log sigmoid(r_c - r_r - m) [B] (float32), computed stably as softplus(-(r_c - r_r - m))."""
  return jax.nn.softplus(-(chosen_B - rejected_B - margin_B))


def sequence_rewards(model, head_D: jax.Array, tokens_BL: jax.Array, segment_ids_BL: jax.Array,
                     positions_BL: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(rewards r_B float32 [B], MoE statistics of the pass) of left-aligned rows (segment 1 on tokens, 0 on padding).

  r_b = head . x_BLD[b, last token of row b], x_BLD the model's final-normed features (`model.features`).
  """
  x_BLD, aux = model.features(tokens_BL, segment_ids_BL, positions_BL, return_aux=True)
  score_BL = jnp.einsum("bld,d->bl", x_BLD.astype(jnp.float32), head_D.astype(jnp.float32))
  return jnp.sum(score_BL * pairs.last_token(segment_ids_BL), axis=1), aux


class RewardModel(base.Objective):
  """Bradley-Terry pairwise loss on a scalar head (module docstring)."""
  name = "reward"
  batch_keys = pairs.BATCH_KEYS
  sum_keys = ("bt", "center", "pairs", "correct", "margin", "chosen", "rejected")
  metric_keys = ("loss", "center_loss", "total_loss", "reward_accuracy", "reward_margin", "chosen_reward",
                 "rejected_reward", "pairs")
  eval_keys = ("loss_sum", "pairs", "correct", "margin")

  def __init__(self, config):
    super().__init__(config)
    self.extra_params = {HEAD: ((config.model.d_model,), ("embed",))}

  def rewards(self, model, batch, extras) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(r_chosen [B], r_rejected [B], MoE sums) of a pair batch, both sides in one pass."""
    r_2B, aux = sequence_rewards(model, extras[HEAD], pairs.both(batch, "inputs"), pairs.both(batch, "segment_ids"),
                                 pairs.both(batch, "positions"))
    chosen_B, rejected_B = pairs.split(r_2B)
    return chosen_B, rejected_B, pairs.moe_sums(aux, self.config.train.grad_accum)

  def sums(self, model, batch, extras, frozen):
    del frozen
    chosen_B, rejected_B, moe = self.rewards(model, batch, extras)
    margin_B = batch["margin"][:, 0]
    return {"bt": jnp.sum(bradley_terry(chosen_B, rejected_B, margin_B)),
            "center": self.config.train.reward_center * jnp.sum(jnp.square(chosen_B + rejected_B)),
            "pairs": jnp.asarray(chosen_B.shape[0], jnp.float32),
            "correct": jnp.sum((chosen_B > rejected_B).astype(jnp.float32)),
            "margin": jnp.sum(chosen_B - rejected_B), "chosen": jnp.sum(chosen_B),
            "rejected": jnp.sum(rejected_B), **moe}

  def normalizer(self, batch):
    return pairs.pair_count(batch)

  def loss(self, sums):
    return sums["bt"] + sums["center"]

  def metrics(self, sums, normalizer):
    loss, center = sums["bt"] / normalizer, sums["center"] / normalizer
    return {"loss": loss, "center_loss": center, "total_loss": loss + center,
            "reward_accuracy": sums["correct"] / normalizer, "reward_margin": sums["margin"] / normalizer,
            "chosen_reward": sums["chosen"] / normalizer, "rejected_reward": sums["rejected"] / normalizer,
            "pairs": sums["pairs"]}

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {"loss_sum": sums["bt"], "pairs": sums["pairs"], "correct": sums["correct"], "margin": sums["margin"]}

  def eval_metrics(self, sums):
    """eval_loss = held-out Bradley-Terry loss per pair; eval_reward_accuracy = pairwise accuracy (r_c > r_r);
    eval_reward_margin = mean r_c - r_r."""
    if sums["pairs"] == 0:
      raise ValueError("the eval batches hold no pairs; raise data.eval_fraction or set train.eval_every=0")
    n = sums["pairs"]
    return {"eval_loss": sums["loss_sum"] / n, "eval_reward_accuracy": sums["correct"] / n,
            "eval_reward_margin": sums["margin"] / n}
