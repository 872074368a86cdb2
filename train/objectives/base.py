"""What an objective declares; the Trainer (train/core/step.py) does everything else once.

An objective is small:
  - `batch_keys`: the arrays of its batch (name -> dtype, each [batch, seq_len]); the data pipeline or the RL
    loop produces them, the Trainer shards them (rows over data x fsdp, length over sequence).
  - `sums(model, batch, extras, frozen)`: additive statistics of one (micro)batch: `sum_keys`, summed over
    tokens / sequences / pairs, so microbatches add up exactly to the global batch.
  - `normalizer(batch)`: the global batch's denominator (e.g. loss tokens), computed once per step.
  - `loss(sums)`: the quantity to minimise in sum form (the Trainer differentiates loss(sums) / normalizer).
  - `metrics(sums, normalizer)`: what the step reports (always `loss`); `eval_sums` / `eval_metrics` the same
    for held-out batches.
  - `extra_params`: trainable parameters besides the model's (name -> (shape, logical axis names)), e.g. a
    reward or value head; `frozen_models`: names of frozen copies of the starting model (e.g. a DPO reference);
    `frozen_configs`: frozen models of their own model config, loaded from a directory (name -> FrozenModel, e.g.
    a distillation teacher of another size).
  - `prepare(batch, key)`: the batch the step trains on, from the loaded one and the step's PRNG key (default:
    unchanged); per-step corruption such as masked-LM masking lives here. `causal`: the model.causal the
    objective needs (a masked LM trains a bidirectional encoder).
"""
from __future__ import annotations

import abc
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from model.transformer import MTP_FEATURES

TOKEN_BATCH_KEYS = {"inputs": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
                    "loss_mask": jnp.float32}


class FrozenModel(NamedTuple):
  """A frozen model with its own config: the Trainer builds it on the run's mesh (same logical-axis rules), a
  fresh run loads its weights from `path` (train/core/setup.py), checkpoints keep them in state["frozen"]."""
  model: Any  # its validated model config (ConfigDict)
  path: str  # a meshlm run / checkpoint directory or a Hugging Face directory
  key: str  # the config key that named `path`, for error messages (e.g. "train.distill_teacher")


class Objective(abc.ABC):
  """Base class (see the module docstring); subclasses set `name` and the keys and implement every method."""
  name = ""
  batch_keys: Mapping[str, Any] = TOKEN_BATCH_KEYS
  sum_keys: tuple[str, ...] = ()
  metric_keys: tuple[str, ...] = ("loss",)
  eval_keys: tuple[str, ...] = ()
  extra_params: Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {}
  frozen_models: tuple[str, ...] = ()
  frozen_configs: Mapping[str, FrozenModel] = {}
  causal: bool = True

  def __init__(self, config):
    self.config = config

  def forward(self, model, batch: Mapping[str, jax.Array], mtp: bool = False):
    """(logits_BLV float32, MoE router statistics of this microbatch / grad_accum; {} for dense models), and with
    `mtp` a third item: the multi-token heads' features [depth, B, L, D] (model.transformer.MTP_FEATURES).

    Objectives put the statistics into their sums so the Trainer adds the MoE losses and reports the load.
    """
    logits_BLV, aux = model(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True,
                            prefix_BL=batch.get("prefix"), mtp=mtp)
    features = aux.pop(MTP_FEATURES, None)
    sums = {k: v / self.config.train.grad_accum for k, v in aux.items()}
    return (logits_BLV, sums, features) if mtp else (logits_BLV, sums)

  def prepare(self, batch: Mapping[str, jax.Array], key: jax.Array) -> Mapping[str, jax.Array]:
    """The batch to train (or evaluate) on; `key` = fold_in(train rng, step) for training, a fixed key for
    evaluation. Runs once per step on the whole global batch, before microbatching, so its randomness is a
    function of (seed, step) and a resumed run draws the same."""
    del key
    return batch

  @abc.abstractmethod
  def sums(self, model, batch: Mapping[str, jax.Array], extras: Mapping[str, jax.Array],
           frozen: Mapping[str, Any]) -> dict[str, jax.Array]:
    """See the module docstring."""

  @abc.abstractmethod
  def normalizer(self, batch: Mapping[str, jax.Array]) -> jax.Array:
    """See the module docstring."""

  @abc.abstractmethod
  def loss(self, sums: Mapping[str, jax.Array]) -> jax.Array:
    """See the module docstring."""

  @abc.abstractmethod
  def metrics(self, sums: Mapping[str, jax.Array], normalizer: jax.Array) -> dict[str, jax.Array]:
    """See the module docstring."""

  @abc.abstractmethod
  def eval_sums(self, model, batch, extras, frozen) -> dict[str, jax.Array]:
    """See the module docstring."""

  @abc.abstractmethod
  def eval_metrics(self, sums: Mapping[str, float]) -> dict[str, float]:
    """See the module docstring."""
