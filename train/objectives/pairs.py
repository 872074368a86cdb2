"""What the preference objectives (reward, dpo) share: the pair batch and one forward pass over both sides.

A batch holds B pairs (data/preference.py): `chosen_*` and `rejected_*` token arrays [B, L] and `margin` [B, L]
(the pair's margin repeated along the row). Both sides go through the model in one [2B, L] pass with rows
interleaved (chosen_0, rejected_0, chosen_1, ...): the reshape keeps each pair's two rows on the device that holds
the pair, so no data moves between shards.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

import model as model_lib
from train.objectives import base

SIDES = ("chosen", "rejected")
BATCH_KEYS = {**{f"{side}_{k}": dtype for side in SIDES for k, dtype in base.TOKEN_BATCH_KEYS.items()},
              "margin": jnp.float32}


def both(batch: Mapping[str, jax.Array], key: str) -> jax.Array:
  """[B, L] chosen and rejected `key` arrays -> [2B, L], rows (chosen_0, rejected_0, chosen_1, ...)."""
  x_B2L = jnp.stack([batch[f"chosen_{key}"], batch[f"rejected_{key}"]], axis=1)
  return model_lib.axes.constrain(x_B2L.reshape(-1, *x_B2L.shape[2:]), ("batch", "length"))


def split(x_2B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inverse of `both` on a per-row quantity [2B, ...] -> (chosen [B, ...], rejected [B, ...])."""
  x_B2 = x_2B.reshape(x_2B.shape[0] // 2, 2, *x_2B.shape[1:])
  return x_B2[:, 0], x_B2[:, 1]


def last_token(segment_ids_BL: jax.Array) -> jax.Array:
  """One-hot [B, L] float32 of each row's last non-padding token (rows are left-aligned, padding segment 0)."""
  length_B = jnp.sum((segment_ids_BL > 0).astype(jnp.int32), axis=1)
  return (jnp.arange(segment_ids_BL.shape[1])[None, :] == (length_B - 1)[:, None]).astype(jnp.float32)


def pair_count(batch: Mapping[str, jax.Array]) -> jax.Array:
  """The number of pairs in the batch (float32): the normaliser of both preference losses."""
  return jnp.asarray(batch["chosen_inputs"].shape[0], jnp.float32)


def moe_sums(aux: Mapping[str, jax.Array], grad_accum: int) -> dict[str, jax.Array]:
  """MoE router statistics of one forward pass, divided by grad_accum as `Objective.forward` does."""
  return {k: v / grad_accum for k, v in aux.items()}
