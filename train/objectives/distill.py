"""`train.objective=distill`: knowledge distillation from a frozen teacher (off-policy: on the data's tokens).

At every loss token t (loss_mask = 1) the student's and the teacher's next-token distributions over the vocabulary
are compared, both from their logits divided by the temperature T = train.distill_temperature:

  p_S = softmax(z_S / T),   p_T = softmax(z_T / T),   KL(p || q) = sum_v p_v (log p_v - log q_v)   (nats, float32)

  forward_kl   D = KL(p_T || p_S)                      (Hinton et al. 2015; mean-seeking: the student covers the
                                                        teacher's mass)
  reverse_kl   D = KL(p_S || p_T)                      (mode-seeking; MiniLLM, Gu et al. 2023)
  jsd          D = beta KL(p_T || M) + (1 - beta) KL(p_S || M),   M = beta p_T + (1 - beta) p_S,
               beta = train.distill_beta in (0, 1); beta = 0 is forward_kl and beta = 1 reverse_kl exactly (as
               TRL's GKDTrainer.generalized_jsd_loss defines them: the JSD itself tends to 0 at both ends)
               (generalised JSD, Agarwal et al. 2023, "On-policy distillation of language models" eq. 1)

Top-k (k = train.distill_top_k > 0): the sums run over S_t = the k tokens of largest teacher logit at position t
only, and both distributions are renormalised over S_t (p_T = softmax of the teacher's k logits, p_S = softmax of
the student's logits at the same k tokens): the student's mass outside S_t is not constrained. k = 0 = the whole
vocabulary.

The temperature divides both models' logits as in TRL's generalized_jsd_loss, and the divergence is NOT multiplied
by T^2 (Hinton et al. scale by T^2 to keep the soft targets' gradients comparable to the hard targets' when mixing
the two; TRL's GKD does not, and neither does this objective: with T != 1 and distill_lm_weight > 0, scale the
weight instead).

  loss = (1/N) sum_{t: m_t=1} [D_t + w (-log p_S(x_{t+1}))],   N = sum_t m_t over the global batch,
  w = train.distill_lm_weight (the student's next-token cross-entropy on the data's targets at temperature 1; 0 =
  pure distillation), plus the z-loss as for `lm` (train.z_loss).

Metrics: `loss` (above, without z-loss), `distill_divergence` (mean D), `lm_loss` (the student's cross-entropy per
loss token), `teacher_lm_loss` (the teacher's), `z_loss`, `total_loss`, `tokens`; evaluations eval_loss,
eval_distill_divergence, eval_lm_loss, eval_teacher_lm_loss.

The teacher: train.distill_teacher, a meshlm run (its latest checkpoint) or a Hugging Face directory, of any size
but with the student's vocabulary (a vocab_size mismatch is refused naming both). Its model config is read from that
directory (train.rundir.runconfig.frozen_model); the Trainer builds it as a frozen model of its own config
(`frozen_configs`), sharded on the student's mesh by the same rules, and a fresh run loads its weights
(train/core/setup.py); checkpoints keep it in the frozen state, as DPO keeps its reference, so a resumed run does
not read the teacher's directory for weights. Each step runs the teacher forward without a backward pass (no
activations kept for it). On-policy distillation (GKD with lambda = 1: the batches are the student's own
completions) is `python -m train.rl` with rl.algorithm=gkd, which trains this objective on its rollouts.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from train.core import loss as loss_lib
from train.objectives import base

LOSSES = ("forward_kl", "reverse_kl", "jsd")
TEACHER = "teacher"


def kl_divergence(logp_BLV: jax.Array, logq_BLV: jax.Array) -> jax.Array:
  """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last axis, from log-probabilities [..., V]: [...] nats."""
  return jnp.sum(jnp.exp(logp_BLV) * (logp_BLV - logq_BLV), axis=-1)


def token_divergence(student_logits_BLV: jax.Array, teacher_logits_BLV: jax.Array, loss: str = "forward_kl",
                     beta: float = 0.5, temperature: float = 1.0, top_k: int = 0) -> jax.Array:
  """The per-token divergence D [B, L] (float32 nats; module docstring) of the student's from the teacher's
  distributions, from their logits [B, L, V] (any float dtype). The teacher's side gets no gradient only if the
  caller stops it (the objective does)."""
  student_BLV = student_logits_BLV.astype(jnp.float32) / temperature
  teacher_BLV = teacher_logits_BLV.astype(jnp.float32) / temperature
  if top_k:
    teacher_BLV, top_BLK = jax.lax.top_k(teacher_BLV, top_k)
    student_BLV = jnp.take_along_axis(student_BLV, top_BLK, axis=-1)
  logp_s_BLV = jax.nn.log_softmax(student_BLV, axis=-1)
  logp_t_BLV = jax.nn.log_softmax(teacher_BLV, axis=-1)
  if loss == "forward_kl" or (loss == "jsd" and beta == 0.0):
    return kl_divergence(logp_t_BLV, logp_s_BLV)
  if loss == "reverse_kl" or (loss == "jsd" and beta == 1.0):
    return kl_divergence(logp_s_BLV, logp_t_BLV)
  if loss != "jsd":
    raise ValueError(f"config.train.distill_loss={loss!r} is not one of {', '.join(LOSSES)}")
  # log M in log space: log(beta p_T + (1 - beta) p_S) without leaving it (tiny probabilities stay finite).
  log_m_BLV = jnp.logaddexp(logp_t_BLV + math.log(beta), logp_s_BLV + math.log1p(-beta))
  return beta * kl_divergence(logp_t_BLV, log_m_BLV) + (1.0 - beta) * kl_divergence(logp_s_BLV, log_m_BLV)


class Distillation(base.Objective):
  """Per-token divergence to the frozen teacher over the loss mask, plus optionally the data's cross-entropy."""
  name = "distill"
  sum_keys = ("divergence", "ce", "z", "teacher_ce", "tokens")
  metric_keys = ("loss", "distill_divergence", "lm_loss", "teacher_lm_loss", "z_loss", "total_loss", "tokens")
  eval_keys = ("divergence", "ce", "teacher_ce", "tokens")

  def __init__(self, config):
    super().__init__(config)
    from train.rundir import runconfig  # pylint: disable=g-import-not-at-top  (reads the teacher's directory)
    t, m = config.train, config.model
    if t.distill_loss not in LOSSES:
      raise ValueError(f"config.train.distill_loss={t.distill_loss!r} is not one of {', '.join(LOSSES)}")
    if not t.distill_teacher:
      raise ValueError("config.train.objective='distill' needs config.train.distill_teacher: a meshlm run directory "
                       "or a Hugging Face directory (python -m train and python -m train.rl set it from "
                       "train.distill_teacher_recipe)")
    teacher = runconfig.frozen_model(t.distill_teacher, "train.distill_teacher", m)
    if teacher.vocab_size != m.vocab_size:
      raise ValueError(f"train.distill_teacher={t.distill_teacher!r}: the teacher's vocab_size={teacher.vocab_size} "
                       f"differs from the student's model.vocab_size={m.vocab_size}; distillation compares "
                       "distributions over one vocabulary: give the student the teacher's tokenizer and vocab_size")
    if not teacher.causal:
      raise ValueError(f"train.distill_teacher={t.distill_teacher!r} is a bidirectional encoder (model.causal="
                       "False); the teacher must be a decoder predicting the next token")
    if t.distill_top_k > m.vocab_size:
      raise ValueError(f"config.train.distill_top_k={t.distill_top_k} exceeds model.vocab_size={m.vocab_size}")
    self.frozen_configs = {TEACHER: base.FrozenModel(teacher, t.distill_teacher, "train.distill_teacher")}

  def _divergence(self, logits_BLV, teacher_logits_BLV):
    t = self.config.train
    return token_divergence(logits_BLV, teacher_logits_BLV, t.distill_loss, t.distill_beta, t.distill_temperature,
                            t.distill_top_k)

  def sums(self, model, batch, extras, frozen):
    del extras
    logits_BLV, moe_sums = self.forward(model, batch)
    teacher_logits_BLV = jax.lax.stop_gradient(
        frozen[TEACHER](batch["inputs"], batch["segment_ids"], batch["positions"]))
    mask_BL = batch["loss_mask"].astype(jnp.float32)
    student = loss_lib.loss_sums(logits_BLV, batch["targets"], mask_BL, self.config.train.z_loss)
    teacher = loss_lib.loss_sums(teacher_logits_BLV, batch["targets"], mask_BL, 0.0)
    divergence = jnp.sum(self._divergence(logits_BLV, teacher_logits_BLV) * mask_BL)
    return {"divergence": divergence, "ce": student["ce"], "z": student["z"], "teacher_ce": teacher["ce"],
            "tokens": student["tokens"], **moe_sums}

  def normalizer(self, batch):
    return jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)

  def loss(self, sums):
    return sums["divergence"] + self.config.train.distill_lm_weight * sums["ce"] + sums["z"]

  def metrics(self, sums, normalizer):
    divergence, ce = sums["divergence"] / normalizer, sums["ce"] / normalizer
    loss, z_loss = divergence + self.config.train.distill_lm_weight * ce, sums["z"] / normalizer
    return {"loss": loss, "distill_divergence": divergence, "lm_loss": ce,
            "teacher_lm_loss": sums["teacher_ce"] / normalizer, "z_loss": z_loss, "total_loss": loss + z_loss,
            "tokens": sums["tokens"]}

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {k: sums[k] for k in self.eval_keys}

  def eval_metrics(self, sums):
    """Held-out `metrics` with an eval_ prefix (per loss token, nats): eval_loss, eval_distill_divergence,
    eval_lm_loss, eval_teacher_lm_loss."""
    if sums["tokens"] == 0:
      raise ValueError("the eval batches hold no loss tokens; raise data.eval_fraction or set train.eval_every=0")
    n = sums["tokens"]
    divergence, ce = sums["divergence"] / n, sums["ce"] / n
    return {"eval_loss": divergence + self.config.train.distill_lm_weight * ce, "eval_distill_divergence": divergence,
            "eval_lm_loss": ce, "eval_teacher_lm_loss": sums["teacher_ce"] / n}
