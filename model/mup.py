"""Maximal-update parametrization (muP; Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via
Zero-Shot Hyperparameter Transfer", Table 3 / Table 8 for Adam), `model.parametrization=mup`.

With width multiplier m = d_model / model.mup_base_width (all hidden widths — d_model, heads x head_dim, mlp_dim —
assumed to grow together), relative to the standard parametrization (SP) with the same init_std and lr:

  parameter kind (logical axes)                     init std              Adam learning rate
  hidden matrices (two or more width axes:          init_std / sqrt(m)    lr / m
    q k v o, MLP and expert gate/up/down)
  input embedding, norms, biases, router, unembed   init_std              lr
  output logits                                     multiplied by 1 / m
  attention scores                                  q.k / head_dim (instead of / sqrt(head_dim))

At m = 1 muP differs from SP only by the attention scale. The learning-rate multipliers reach optax through
train/core/optimizer.py `make` (they scale the Adam direction, not the decoupled weight decay, whose per-step factor
lr * weight_decay stays width-independent as in the `mup` package's MuAdamW); the initialisation and the two
multipliers live in the model.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from model.axes import EMBED, HEADS, KV_HEADS, MLP

WIDTH_AXES = (EMBED, HEADS, KV_HEADS, MLP)


def enabled(cfg) -> bool:
  return cfg.parametrization == "mup"


def width_mult(cfg) -> float:
  """m = d_model / mup_base_width under muP; 1 under SP."""
  return cfg.d_model / cfg.mup_base_width if enabled(cfg) else 1.0


def is_hidden(names: Sequence[Any] | None) -> bool:
  """A matrix whose fan-in and fan-out both grow with width: two or more of its logical axes are width axes."""
  return sum(n in WIDTH_AXES for n in (names or ())) >= 2


def init_std(cfg, names: Sequence[Any]) -> float:
  """Standard deviation of a normal-initialised parameter with logical axes `names` (table above)."""
  return cfg.init_std / math.sqrt(width_mult(cfg)) if is_hidden(names) else cfg.init_std


def lr_multiplier(cfg, names: Sequence[Any] | None) -> float:
  """Adam learning-rate multiplier of a parameter with logical axes `names` (table above)."""
  return 1.0 / width_mult(cfg) if is_hidden(names) else 1.0


def output_multiplier(cfg) -> float:
  """Factor on the output logits: 1 / m under muP, 1 under SP."""
  return 1.0 / width_mult(cfg)


def query_multiplier(cfg) -> float:
  """Factor on the queries that turns the kernels' 1/sqrt(head_dim) score scale into muP's 1/head_dim."""
  return 1.0 / math.sqrt(cfg.head_dim) if enabled(cfg) else 1.0
