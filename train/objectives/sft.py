"""`train.objective=sft`: supervised fine-tuning on rendered conversations.

The batch is the language model's, built by the chat pipeline (data/chat.py): `loss_mask` is 1 on the assistant
tokens (each assistant turn's content and its end-of-turn marker; every token with data.chat_loss=all) and 0 on
system/user turns, role markers and padding. The loss is the mean negative log-likelihood of those tokens over
the global batch, computed with the shared per-sequence primitive (model.logprobs):

  loss = -(1/T) sum_c sum_{t in c, m_t=1} log p(x_{t+1} | x_{<=t}),  T = sum_t m_t    (TRL's SFTTrainer with
  assistant-only loss: the token-level mean over the batch)

plus the z-loss as for `lm`; `sequences` counts the conversations that have at least one loss token.
"""
from __future__ import annotations

import jax.numpy as jnp

from model import logprobs
from train.objectives import lm


class SupervisedFineTuning(lm.LanguageModel):
  """Per-conversation masked log-likelihood sums (packed rows: conversations are segments)."""
  name = "sft"
  sum_keys = ("ce", "z", "tokens", "sequences")
  metric_keys = ("loss", "z_loss", "total_loss", "tokens", "sequences")

  def sums(self, model, batch, extras, frozen):
    del extras, frozen
    logits_BLV, moe_sums = self.forward(model, batch)
    logp_BL, logz_BL = logprobs.token_logprobs(logits_BLV, batch["targets"])
    seq = logprobs.sequence_sums(logp_BL, batch["loss_mask"], batch["segment_ids"],
                                 num_segments=batch["inputs"].shape[1])
    mask_BL = batch["loss_mask"].astype(jnp.float32)
    return {"ce": -jnp.sum(seq["sum"]), "z": self.config.train.z_loss * jnp.sum(jnp.square(logz_BL) * mask_BL),
            "tokens": jnp.sum(seq["count"]), "sequences": jnp.sum((seq["count"] > 0).astype(jnp.float32)),
            **moe_sums}

  def metrics(self, sums, normalizer):
    return dict(super().metrics(sums, normalizer), sequences=sums["sequences"])
