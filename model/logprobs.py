"""Log-probabilities of target tokens under a mask: per token, and summed / averaged per sequence.

One primitive for every objective and evaluation that scores tokens: the language-model and SFT losses
(`-sum log p` over masked tokens), DPO and PPO (per-sequence sums over completion tokens), and log-likelihood
evaluations. All statistics are float32 whatever the logits' dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def target_logits(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(logit of the target [B, L], logsumexp of the logits [B, L]), float32: log p(t) = first - second.

  The target logit is a masked sum over the vocabulary rather than a gather: it stays local when the vocabulary
  is sharded over the tensor axis (a gather would collect the logits on every device).
  """
  logits_BLV = logits_BLV.astype(jnp.float32)
  logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  vocab_V = jnp.arange(logits_BLV.shape[-1], dtype=targets_BL.dtype)
  target_logit_BL = jnp.sum(jnp.where(vocab_V == targets_BL[..., None], logits_BLV, 0.0), axis=-1)
  return target_logit_BL, logz_BL


def token_logprobs(logits_BLV: jax.Array, targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log p(target) [B, L], logsumexp of the logits [B, L]), float32; log p(t) = logit_t - logsumexp(logits)."""
  target_logit_BL, logz_BL = target_logits(logits_BLV, targets_BL)
  return target_logit_BL - logz_BL, logz_BL


def is_argmax(logits_NV: jax.Array, targets_N: jax.Array, target_logit_N: jax.Array) -> jax.Array:
  """bool [N]: targets_N == argmax(logits_NV, -1), argmax being the first maximal index (as jnp.argmax and
  torch.argmax return): the target's logit is the maximum and no lower index attains it. Any leading shape
  ([B, L, V] logits with [B, L] targets) works the same.

  Equal to `jnp.argmax(logits_NV, -1) == targets_N` without argmax's (value, index) reduction, which XLA:CPU runs
  as a scalar loop (6x slower at [896, 2048]); the two reductions here vectorise. target_logit_N: the targets'
  logits, float32, as `target_logits` returns them.
  """
  vocab_V = jnp.arange(logits_NV.shape[-1], dtype=targets_N.dtype)
  max_N = jnp.max(logits_NV, axis=-1)
  tie_below_N = jnp.any((logits_NV == max_N[..., None]) & (vocab_V < targets_N[..., None]), axis=-1)
  return (target_logit_N == max_N) & ~tie_below_N


def sequence_logprobs(logits_BLV: jax.Array, targets_BL: jax.Array, mask_BL: jax.Array,
                      segment_ids_BL: jax.Array | None = None, num_segments: int = 1) -> dict[str, jax.Array]:
  """Per-sequence masked log-probabilities of the targets.

  Args:
    logits_BLV: logits [B, L, V] (cast to float32).
    targets_BL: int next-token ids [B, L].
    mask_BL: float [B, L]; 1 = the token is scored (e.g. completion / assistant tokens), 0 = not.
    segment_ids_BL: int [B, L] numbering the sequences packed in a row from 1 (0 = padding); None = one
      sequence per row (segment 1 everywhere).
    num_segments: S, the largest segment id to report (rows hold at most S sequences).
  Returns:
    dict of float32 [B, S] (column s-1 = segment s): `sum` = sum_t mask_t log p(target_t) over the segment's
    tokens, `count` = sum_t mask_t, `mean` = sum / count (0 where count is 0).
  """
  logp_BL, _ = token_logprobs(logits_BLV, targets_BL)
  return sequence_sums(logp_BL, mask_BL, segment_ids_BL, num_segments)


def sequence_sums(logp_BL: jax.Array, mask_BL: jax.Array, segment_ids_BL: jax.Array | None = None,
                  num_segments: int = 1) -> dict[str, jax.Array]:
  """`sequence_logprobs` from per-token log-probabilities logp_BL [B, L] (e.g. `token_logprobs`' first output)."""
  mask_BL = mask_BL.astype(jnp.float32)
  B, L = logp_BL.shape
  if segment_ids_BL is None:
    segment_ids_BL = jnp.ones((B, L), jnp.int32)
  # Scatter-add into (row, segment) cells: O(B*L) work and memory; segment 0 (padding) lands in a dropped column.
  cell_BL = jnp.arange(B, dtype=jnp.int32)[:, None] * (num_segments + 1) + jnp.clip(segment_ids_BL, 0, num_segments)
  def per_segment(x_BL):
    out = jax.ops.segment_sum(x_BL.reshape(-1), cell_BL.reshape(-1), num_segments=B * (num_segments + 1))
    return out.reshape(B, num_segments + 1)[:, 1:]
  total_BS, count_BS = per_segment(logp_BL * mask_BL), per_segment(mask_BL)
  return {"sum": total_BS, "count": count_BS, "mean": total_BS / jnp.maximum(count_BS, 1.0)}
