"""`train.objective=prefix_lm`: the prefix language model (Raffel et al. 2020, "T5", sec. 3.2.1; UL2's
S-denoiser, Tay et al. 2022, sec. 3.1.2) on the decoder.

Each document (segment) of a packed row is split at a uniformly random point: its first k tokens, k uniform in
[1, n-1] for a segment of n >= 2 tokens, form the prefix, which attends bidirectionally within itself
(model/attention.py prefix mask); the rest is predicted left to right and sees the whole prefix. The loss covers
only the target tokens:

  loss = (1/T) sum_{t: m_t=1, t >= k-1} -log p(x_{t+1} | x_{<=t}, prefix),   T = number of such positions

(position k-1, the prefix's last token, predicts the first target token; it sees only the prefix, so nothing
leaks). The split is drawn in `prepare` from the step's key, so a resumed run splits exactly as before.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from train.objectives import lm


def prefix_split(key: jax.Array, segment_ids_BL: jax.Array) -> jax.Array:
  """int32 [B, L]: the prefix length k of each token's segment, k = 1 + floor(u * (n - 1)), u ~ U[0, 1) drawn
  once per (row, segment), n the segment's token count."""
  B, L = segment_ids_BL.shape
  cell_BL = jnp.arange(B, dtype=jnp.int32)[:, None] * (L + 1) + segment_ids_BL
  n_cells = jax.ops.segment_sum(jnp.ones((B * L,), jnp.int32), cell_BL.reshape(-1), num_segments=B * (L + 1))
  n_BL = n_cells[cell_BL]
  u_BL = jax.random.uniform(key, (B * (L + 1),))[cell_BL]
  return (1 + jnp.floor(u_BL * (n_BL - 1))).astype(jnp.int32)


class PrefixLanguageModel(lm.LanguageModel):
  """Next-token loss on the targets after a random bidirectional prefix per document (module docstring)."""
  name = "prefix_lm"

  def prepare(self, batch, key):
    k_BL = prefix_split(key, batch["segment_ids"])
    prefix_BL = (batch["positions"] < k_BL) & (batch["segment_ids"] > 0)
    targets_BL = (batch["positions"] >= k_BL - 1).astype(batch["loss_mask"].dtype)
    return dict(batch, prefix=prefix_BL.astype(jnp.int32), loss_mask=batch["loss_mask"] * targets_BL)
