"""AdamW with global-norm clipping, a weight-decay mask and the learning-rate schedules (optax).

The transformation returned by `make` yields the update for a learning rate of 1: clip -> Adam -> + decoupled
weight decay. The step multiplies it by -schedule(step), with `step` the train state's counter, so the learning
rate is a function of the step (it keeps advancing over skipped non-finite steps) and the reported lr is
exactly the one applied. With a constant schedule this is `optax.chain(clip, optax.adamw(lr, mask=...))`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "wsd", "constant")


def horizon(train_cfg) -> int:
  """The step count the schedule spans: train.schedule_steps, or train.steps when that is 0."""
  return int(train_cfg.get("schedule_steps", 0) or train_cfg.steps)


def schedule(train_cfg) -> Callable[[jax.Array], jax.Array]:
  """Learning rate as a function of the 0-based step (float32), from config.train.

  With peak = lr, W = warmup_steps, T = schedule_steps or else steps (the horizon), m = min_lr_ratio and
  warm(t) = min(1, (t + 1) / W):
    cosine:   peak * warm(t) for t < W, then peak * (m + (1 - m) * (1 + cos(pi * p)) / 2),
              p = (t - W) / (T - W) clipped to [0, 1];
    wsd:      peak * warm(t) until D = T - round(decay_fraction * T), then linear from peak to m * peak at T;
    constant: peak * warm(t).
  """
  peak, warmup, total = float(train_cfg.lr), int(train_cfg.warmup_steps), horizon(train_cfg)
  kind, floor = train_cfg.schedule, float(train_cfg.min_lr_ratio)
  if kind not in SCHEDULES:
    raise ValueError(f"config.train.schedule={kind!r} is not one of {', '.join(SCHEDULES)}")
  if warmup < 0 or total < 1:
    raise ValueError(f"config.train.warmup_steps={warmup} must be >= 0 and the schedule horizon {total} >= 1")
  decay_start = total - int(round(float(train_cfg.decay_fraction) * total))
  if kind == "wsd" and not 0 <= train_cfg.decay_fraction <= 1:
    raise ValueError(f"config.train.decay_fraction={train_cfg.decay_fraction} must lie in [0, 1]")

  def lr_fn(step):
    t = jnp.asarray(step, jnp.float32)
    warm = jnp.minimum(1.0, (t + 1.0) / warmup) if warmup > 0 else jnp.float32(1.0)
    if kind == "constant":
      return peak * warm
    if kind == "cosine":
      p = jnp.clip((t - warmup) / max(total - warmup, 1), 0.0, 1.0)
      cosine = floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(math.pi * p))
      return peak * jnp.where(t < warmup, warm, cosine)
    p = jnp.clip((t - decay_start) / max(total - decay_start, 1), 0.0, 1.0)
    return peak * jnp.where(t < warmup, warm, 1.0 - (1.0 - floor) * p)

  return lr_fn


def path_name(path: Sequence[Any]) -> str:
  """'layers/attn/q/kernel' for a jax key path."""
  parts = []
  for k in path:
    parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
  return "/".join(parts)


def decay_mask(params: Any, exclude: Sequence[str]) -> Any:
  """Pytree of bools like `params`: True where weight decay applies (no `exclude` substring in the path)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(s in path_name(path) for s in exclude), params)


def make(train_cfg, lr_multipliers: Any = None) -> optax.GradientTransformation:
  """clip_by_global_norm(clip_norm) -> scale_by_adam(b1, b2, eps) [-> lr_multipliers] -> add_decayed_weights(
  weight_decay, mask).

  The result is the unit-learning-rate AdamW update; multiply by -schedule(step) (train.step does).
  `lr_multipliers` (muP, model/mup.py: a pytree of floats that is a prefix of the parameters) scale the Adam
  direction per parameter and not the decay term, so a parameter with learning rate lr * m still decays by
  lr * weight_decay per step (the `mup` package's MuAdamW multiplies weight_decay by 1/m for the same effect).
  """
  parts = []
  if train_cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(train_cfg.clip_norm)))
  parts.append(optax.scale_by_adam(b1=float(train_cfg.b1), b2=float(train_cfg.b2), eps=float(train_cfg.eps)))
  if lr_multipliers is not None and any(m != 1.0 for m in jax.tree.leaves(lr_multipliers)):
    parts.append(_scale_per_parameter(lr_multipliers))
  if train_cfg.weight_decay > 0:
    exclude = tuple(train_cfg.decay_exclude)
    parts.append(optax.add_decayed_weights(float(train_cfg.weight_decay), mask=lambda p: decay_mask(p, exclude)))
  return optax.chain(*parts)


def _scale_per_parameter(multipliers: Any) -> optax.GradientTransformation:
  """updates * multiplier, the multipliers' tree a prefix of the updates' (optax.MaskedNode leaves, which
  with_frozen's multi_transform passes for frozen parameters, stay as they are)."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  scale = lambda m, sub: jax.tree.map(lambda u: u if masked(u) else u * m, sub, is_leaf=masked)
  return optax.stateless(lambda updates, params: jax.tree.map(scale, multipliers, updates, is_leaf=masked))


def with_frozen(tx: optax.GradientTransformation, freeze: Sequence[str]) -> optax.GradientTransformation:
  """`tx` on the parameters whose path contains none of the `freeze` substrings; a zero update (and no optimizer
  state) for the others, so they stay bit-identical (config.train.freeze)."""
  if not freeze:
    return tx
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if any(s in path_name(path) for s in freeze) else "trained", params)
  return optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)


def apply_lr(params: Any, updates: Any, lr: jax.Array) -> Any:
  """params - lr * updates, leaf by leaf, in the parameters' dtype."""
  return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)


# ---- dynamic loss scaling (float16 mixed precision) -----------------------------------------------------------
LOSS_SCALING = ("auto", "dynamic", "none")
MIN_LOSS_SCALE = 1.0  # the scale never halves below this; an overflow at this scale counts as non-finite


def uses_loss_scaling(config) -> bool:
  """Whether the step scales the loss: train.loss_scale=dynamic, or auto with model.dtype=float16 (the only
  compute dtype whose 5-bit exponent underflows small gradients: float16's smallest normal is 6.1e-5)."""
  mode = config.train.loss_scale
  if mode not in LOSS_SCALING:
    raise ValueError(f"config.train.loss_scale={mode!r} is not one of {', '.join(LOSS_SCALING)}")
  return mode == "dynamic" or (mode == "auto" and config.model.dtype == "float16")


def loss_scale_init(train_cfg) -> dict[str, jax.Array]:
  """The loss-scale state: {"scale": float32 train.loss_scale_init, "good_steps": int32 0} (finite steps in a
  row since the scale last changed)."""
  return {"scale": jnp.asarray(float(train_cfg.loss_scale_init), jnp.float32),
          "good_steps": jnp.zeros((), jnp.int32)}


def loss_scale_update(ls: dict[str, jax.Array], finite: jax.Array, train_cfg) -> dict[str, jax.Array]:
  """Dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training", sec. 3.2):

    overflow (finite=False): scale <- max(scale / 2, MIN_LOSS_SCALE), good_steps <- 0 (the step is skipped);
    finite:                  good_steps <- good_steps + 1; once it reaches N = train.loss_scale_period,
                             scale <- 2 * scale and good_steps <- 0.

  Powers of two keep scaling and unscaling exact in binary floating point.
  """
  period = int(train_cfg.loss_scale_period)
  grown = ls["good_steps"] + 1
  grow = grown >= period
  scale = jnp.where(finite, jnp.where(grow, ls["scale"] * 2.0, ls["scale"]),
                    jnp.maximum(ls["scale"] * 0.5, MIN_LOSS_SCALE))
  good_steps = jnp.where(finite & ~grow, grown, 0).astype(jnp.int32)
  return {"scale": scale.astype(jnp.float32), "good_steps": good_steps}
