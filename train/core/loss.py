"""Token cross-entropy under a loss mask, plus z-loss, in float32.

Functions return sums (not means) and the token count, so gradient accumulation can add microbatches and divide
once: the result is then exactly the mean over all tokens of the global batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model import logprobs


def loss_sums(logits_BLV: jax.Array, targets_BL: jax.Array, loss_mask_BL: jax.Array,
              z_loss_coef: float) -> dict[str, jax.Array]:
  """Masked loss sums over a batch.

  Args:
    logits_BLV: float logits [batch, length, vocab] (cast to float32 here).
    targets_BL: int32 next-token ids [batch, length].
    loss_mask_BL: float [batch, length]; 1 = the token counts, 0 = padding (or prompt).
    z_loss_coef: coefficient c of the z-loss c * logsumexp(logits)^2.
  Returns:
    dict of float32 scalars: `ce` (sum of -log p(target) over masked tokens, nats), `z` (sum of the z-loss
    terms), `tokens` (sum of the mask).
  """
  mask_BL = loss_mask_BL.astype(jnp.float32)
  target_logit_BL, logz_BL = logprobs.target_logits(logits_BLV, targets_BL)
  ce = jnp.sum((logz_BL - target_logit_BL) * mask_BL)
  z = z_loss_coef * jnp.sum(jnp.square(logz_BL) * mask_BL)
  return {"ce": ce, "z": z, "tokens": jnp.sum(mask_BL)}


def mean_loss(logits_BLV, targets_BL, loss_mask_BL, z_loss_coef: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """(cross-entropy per token, z-loss per token), each over the masked tokens (0 when none are masked in)."""
  s = loss_sums(logits_BLV, targets_BL, loss_mask_BL, z_loss_coef)
  tokens = jnp.maximum(s["tokens"], 1.0)
  return s["ce"] / tokens, s["z"] / tokens
