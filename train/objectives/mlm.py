"""`train.objective=mlm`: BERT's masked language model on a bidirectional encoder (model.causal=false).

Devlin et al. 2019, "BERT", sec. 3.1 and appendix A.1: each real text token is selected with probability
p = train.mlm_rate (0.15; independently per token, as Hugging Face's DataCollatorForLanguageModeling draws it);
a selected token is replaced by the mask token with probability train.mlm_mask_fraction (0.8), by a uniformly
random text token with train.mlm_random_fraction (0.1), and left unchanged otherwise (0.1). The loss is the
cross-entropy of the original token at the selected positions only (the model's output projection is the MLM
head):

  loss = (1/T) sum_{t selected} -log p(x_t | corrupted x),   T = number of selected tokens in the global batch,
  masked_accuracy = (1/T) sum_{t selected} [argmax_v logits_tv = x_t]

plus the z-loss as for `lm`. Eligible tokens: inside a document (segment > 0) and not a control piece (BOS, EOS,
PAD, the reserved chat/FIM pieces); the mask token is the tokenizer's reserved piece MASK_PIECE. The batch is the
language-model pipeline's: `inputs` (BOS + document) is the text, `targets` is not used.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from data import tokenizer as tokenizer_lib
from train.core import loss as loss_lib
from train.objectives import lm

MASK_PIECE, MASK_ID = tokenizer_lib.MASK_PIECE, tokenizer_lib.MASK_ID
FIRST_TEXT_ID = tokenizer_lib.EOS_ID + 1 + len(tokenizer_lib.RESERVED)  # byte and text pieces from here on


def mask_tokens(key: jax.Array, tokens_BL: jax.Array, eligible_BL: jax.Array, rate: float, mask_fraction: float,
                random_fraction: float, vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """(corrupted tokens_BL, selected_BL float32) under BERT's selection and 80/10/10 replacement (module doc)."""
  k_select, k_kind, k_random = jax.random.split(key, 3)
  selected_BL = eligible_BL & (jax.random.uniform(k_select, tokens_BL.shape) < rate)
  u_BL = jax.random.uniform(k_kind, tokens_BL.shape)
  random_BL = jax.random.randint(k_random, tokens_BL.shape, FIRST_TEXT_ID, vocab_size, tokens_BL.dtype)
  corrupted_BL = jnp.where(u_BL < mask_fraction, MASK_ID,
                           jnp.where(u_BL < mask_fraction + random_fraction, random_BL, tokens_BL))
  return jnp.where(selected_BL, corrupted_BL, tokens_BL), selected_BL.astype(jnp.float32)


class MaskedLanguageModel(lm.LanguageModel):
  """Cross-entropy and accuracy at the selected positions of a corrupted batch (module docstring)."""
  name = "mlm"
  causal = False
  sum_keys = ("ce", "z", "tokens", "correct")
  metric_keys = ("loss", "z_loss", "total_loss", "tokens", "masked_accuracy")
  eval_keys = ("loss_sum", "tokens", "correct")

  def prepare(self, batch, key):
    t = self.config.train
    tokens_BL = batch["inputs"]
    eligible_BL = (batch["segment_ids"] > 0) & (tokens_BL >= FIRST_TEXT_ID)
    corrupted_BL, selected_BL = mask_tokens(key, tokens_BL, eligible_BL, t.mlm_rate, t.mlm_mask_fraction,
                                            t.mlm_random_fraction, self.config.model.vocab_size)
    return dict(batch, inputs=corrupted_BL, targets=tokens_BL, loss_mask=selected_BL)

  def sums(self, model, batch, extras, frozen):
    del extras, frozen
    logits_BLV, moe_sums = self.forward(model, batch)
    sums = loss_lib.loss_sums(logits_BLV, batch["targets"], batch["loss_mask"], self.config.train.z_loss)
    hit_BL = (jnp.argmax(logits_BLV, axis=-1) == batch["targets"]).astype(jnp.float32)
    return {**sums, "correct": jnp.sum(hit_BL * batch["loss_mask"]), **moe_sums}

  def metrics(self, sums, normalizer):
    return dict(super().metrics(sums, normalizer), masked_accuracy=sums["correct"] / normalizer)

  def eval_sums(self, model, batch, extras, frozen):
    sums = self.sums(model, batch, extras, frozen)
    return {"loss_sum": sums["ce"], "tokens": sums["tokens"], "correct": sums["correct"]}

  def eval_metrics(self, sums):
    """eval_loss (nats per selected token), eval_perplexity = exp(eval_loss), eval_masked_accuracy."""
    if sums["tokens"] == 0:
      raise ValueError("the eval batches hold no selected tokens; raise data.eval_fraction or train.mlm_rate")
    eval_loss = sums["loss_sum"] / sums["tokens"]
    return {"eval_loss": eval_loss, "eval_perplexity": math.exp(min(eval_loss, 80.0)),
            "eval_masked_accuracy": sums["correct"] / sums["tokens"]}
