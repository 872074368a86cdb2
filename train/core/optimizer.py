"""The optimizers (train.optimizer), global-norm clipping, the weight-decay mask and the learning-rate schedules,
all through optax.

The transformation returned by `make` yields the update for a learning rate of 1 (a unit update u): clip -> the
optimizer's direction -> + decoupled weight decay. The step applies params - schedule(step) * u, with `step` the
train state's counter, so the learning rate is a function of the step (it keeps advancing over skipped non-finite
steps) and the reported lr is exactly the one applied. With a constant schedule adamw is
`optax.chain(clip, optax.adamw(lr, mask=...))`. Sign conventions differ between optax's aliases: `optax.adafactor`
and `optax.contrib.muon` end in a descent step (scale(-lr)); here their directions are built without it.

  adamw               Adam direction m_hat / (sqrt(v_hat) + eps) (Loshchilov & Hutter 2019)
  lion                sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g (Chen et al. 2023, "Symbolic Discovery
                      of Optimization Algorithms"; the paper's b2 = 0.99, train.b2's default is AdamW's 0.95)
  adafactor           g / sqrt(factored second moment) clipped to block RMS train.adafactor_clip (Shazeer & Stern
                      2018); matrices keep row and column means instead of a full second moment
  muon                matrices: Newton-Schulz-orthogonalised (Nesterov) momentum, scaled by
                      train.muon_rms * sqrt(max(fan_in, fan_out)) so its RMS matches AdamW's and one lr serves both
                      (Liu et al. 2025, "Muon is Scalable for LLM Training"), or with train.muon_rms=0 by
                      sqrt(max(1, fan_out / fan_in)) (Jordan 2024); embeddings, output projection, norms, biases
                      and objective heads: the AdamW direction
  schedule_free_adamw Defazio et al. 2024, "The Road Less Scheduled": the update includes the learning rate
                      (`brings_lr`); the train state keeps the averaged parameters x (what evaluation and export
                      see) and the step takes the gradient at y = b1 x + (1 - b1) z (`gradient_point`)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon", "adafactor", "lion", "schedule_free_adamw")
STATE_DTYPES = ("float32", "bfloat16")


def check(train_cfg) -> None:
  """ValueError naming the key for an unknown optimizer or state dtype, or a schedule-free run with a schedule."""
  if train_cfg.optimizer not in OPTIMIZERS:
    raise ValueError(f"config.train.optimizer={train_cfg.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
  if train_cfg.opt_state_dtype not in STATE_DTYPES:
    raise ValueError(f"config.train.opt_state_dtype={train_cfg.opt_state_dtype!r} is not one of "
                     f"{', '.join(STATE_DTYPES)}")
  if train_cfg.optimizer == "schedule_free_adamw" and train_cfg.schedule != "constant":
    raise ValueError(f"config.train.schedule={train_cfg.schedule!r} with train.optimizer=schedule_free_adamw: "
                     "schedule-free averaging replaces the decay; set train.schedule=constant (warmup_steps "
                     "still applies)")
  coeffs = tuple(train_cfg.muon_ns_coeffs)
  if train_cfg.optimizer == "muon" and (len(coeffs) % 3 or not coeffs or len(coeffs) // 3 > train_cfg.muon_ns_steps):
    raise ValueError(f"config.train.muon_ns_coeffs={coeffs} must be one (a, b, c) triple, or up to "
                     f"train.muon_ns_steps={train_cfg.muon_ns_steps} triples flattened (one per iteration)")


def brings_lr(train_cfg) -> bool:
  """Whether `make`'s update already includes the learning rate and sign (schedule-free)."""
  return train_cfg.optimizer == "schedule_free_adamw"


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


def make(train_cfg, lr_multipliers: Any = None, muon_dims: Any = None,
         muon_layouts: Any = None) -> optax.GradientTransformation:
  """clip_by_global_norm(clip_norm) -> the train.optimizer direction [-> lr_multipliers] -> add_decayed_weights(
  weight_decay, mask), with its state kept in train.opt_state_dtype.

  The result is the unit-learning-rate update; multiply by -schedule(step) (train.step does), except for
  schedule_free_adamw whose update already is the step (`brings_lr`). `lr_multipliers` (muP, model/mup.py: a
  pytree of floats that is a prefix of the parameters) scale the direction per parameter and not the decay term, so
  a parameter with learning rate lr * m still decays by lr * weight_decay per step (the `mup` package's MuAdamW
  multiplies weight_decay by 1/m for the same effect). `muon_dims` (muon only): a prefix tree of the parameters,
  `optax.contrib.MuonDimensionNumbers` where Muon applies and None where AdamW does (`muon_dimension_numbers`);
  `muon_layouts`: the same prefix tree with a sharding per Muon matrix stack in which each device holds whole
  matrices (`muon_layout`), or None where the parameter's own layout is kept.
  """
  check(train_cfg)
  parts = []
  if train_cfg.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(float(train_cfg.clip_norm)))
  kind = train_cfg.optimizer
  if kind == "schedule_free_adamw":
    parts.append(_schedule_free(train_cfg, lr_multipliers))
    return _state_in(optax.chain(*parts), train_cfg.opt_state_dtype)
  parts.append(_direction(train_cfg, muon_dims, muon_layouts))
  if lr_multipliers is not None and any(m != 1.0 for m in jax.tree.leaves(lr_multipliers)):
    parts.append(_scale_per_parameter(lr_multipliers))
  if train_cfg.weight_decay > 0:
    parts.append(_decay(train_cfg))
  return _state_in(optax.chain(*parts), train_cfg.opt_state_dtype)


def _decay(train_cfg) -> optax.GradientTransformation:
  exclude = tuple(train_cfg.decay_exclude)
  return optax.add_decayed_weights(float(train_cfg.weight_decay), mask=lambda p: decay_mask(p, exclude))


def _adam(train_cfg) -> optax.GradientTransformation:
  return optax.scale_by_adam(b1=float(train_cfg.b1), b2=float(train_cfg.b2), eps=float(train_cfg.eps))


def _direction(train_cfg, muon_dims: Any, muon_layouts: Any = None) -> optax.GradientTransformation:
  """The unit update of adamw, lion, adafactor or muon (module docstring), before decay."""
  kind, t = train_cfg.optimizer, train_cfg
  if kind == "adamw":
    return _adam(t)
  if kind == "lion":
    return optax.scale_by_lion(b1=float(t.b1), b2=float(t.b2))
  if kind == "adafactor":
    parts = [optax.scale_by_factored_rms(factored=True, decay_rate=float(t.adafactor_decay_rate),
                                         min_dim_size_to_factor=int(t.adafactor_min_dim_to_factor))]
    if t.adafactor_clip > 0:
      parts.append(optax.clip_by_block_rms(float(t.adafactor_clip)))
    if t.adafactor_momentum > 0:
      parts.append(optax.ema(float(t.adafactor_momentum), debias=False))
    return optax.chain(*parts)
  if muon_dims is None:
    raise ValueError("train.optimizer=muon needs the parameters' dimension numbers (muon_dimension_numbers)")
  return _muon(t, muon_dims, muon_layouts)


def _muon(t, muon_dims: Any, muon_layouts: Any = None) -> optax.GradientTransformation:
  """Muon on the parameters with dimension numbers, the AdamW direction on the others (optax.contrib.muon's
  partition, without its final descent step, and with plain Adam, not Nesterov Adam, beside Muon)."""
  is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  labels = lambda params: jax.tree.map(lambda d, sub: jax.tree.map(lambda _: "adam" if d is None else "muon", sub),
                                       muon_dims, params, is_leaf=is_dims)
  masked = lambda x: isinstance(x, optax.MaskedNode)

  def dims_of_muon_leaves(updates):
    # The muon branch sees optax.MaskedNode where AdamW applies; its dimension tree must have the same structure.
    return jax.tree.map(lambda d, sub: jax.tree.map(lambda u: optax.MaskedNode() if masked(u) else d, sub,
                                                    is_leaf=masked),
                        muon_dims, updates, is_leaf=is_dims)

  coeffs = tuple(float(c) for c in t.muon_ns_coeffs)
  coeffs = coeffs if len(coeffs) == 3 else tuple(coeffs[i:i + 3] for i in range(0, len(coeffs), 3))
  muon = optax.chain(
      _relayout(muon_layouts),
      optax.contrib.scale_by_muon(ns_coeffs=coeffs, ns_steps=int(t.muon_ns_steps), beta=float(t.muon_momentum),
                                  nesterov=bool(t.muon_nesterov), weight_dimension_numbers=dims_of_muon_leaves),
      _scale_by_shape(dims_of_muon_leaves, float(t.muon_rms)))
  return optax.partition({"muon": muon, "adam": _adam(t)}, labels)


def _relayout(layouts: Any) -> optax.GradientTransformation:
  """Moves each Muon matrix stack's gradient to its `muon_layout` (whole matrices per device) before the momentum
  and the Newton-Schulz products, so the iteration runs locally instead of on matrices split over devices (where the
  partitioner gathers the operands of every product); the parameter update returns to the parameters' layout."""
  if layouts is None:
    return optax.identity()
  is_layout = lambda x: x is None or isinstance(x, jax.sharding.Sharding)
  masked = lambda x: isinstance(x, optax.MaskedNode)
  def move(sharding, sub):
    if sharding is None:
      return sub
    return jax.tree.map(lambda u: u if masked(u) else jax.lax.with_sharding_constraint(u, sharding), sub,
                        is_leaf=masked)
  def update(updates, state, params=None):
    del params
    return jax.tree.map(move, layouts, updates, is_leaf=is_layout), state
  return optax.GradientTransformation(optax.init_empty_state, update)


def muon_layout(names: Sequence[Any] | None, shape: Sequence[int], sharding: jax.sharding.NamedSharding) -> Any:
  """A sharding of a Muon matrix stack (logical axes `names`, `shape`, stored as `sharding`) in which each device
  holds whole matrices: every mesh axis the parameter is split over moves onto its layer (or expert) axis, which
  must divide evenly; None when none does (the stack keeps its layout) or nothing is split. Moving there and back
  is two all-to-alls of the stack's shard (each device exchanges (n - 1) / n of it), against an all-gather of the
  operands of every Newton-Schulz product when the matrices stay split."""
  if muon_dimension_numbers(names) is None:
    return None
  spec = tuple(sharding.spec) + (None,) * (len(names) - len(sharding.spec))
  used = tuple(a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry))
  size = math.prod(sharding.mesh.shape[a] for a in used)
  if size == 1:
    return None
  for i, name in enumerate(names):
    if name in BATCHED_AXES and shape[i] % size == 0:
      new = [None] * len(names)
      new[i] = used if len(used) > 1 else used[0]
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*new))
  return None


def place_muon_state(opt_state: Any, shardings: Any, layouts: Any) -> Any:
  """`shardings` (of `opt_state`) with Muon's momentum of each matrix stack in its `muon_layout`, where it has
  one: the momentum then meets the relaid gradient without moving, the Newton-Schulz products run on whole
  matrices, and only the finished update returns to the parameters' layout."""
  is_layout = lambda x: x is None or isinstance(x, jax.sharding.Sharding)
  key = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
  wanted = {tuple(map(key, path)): s for path, s in jax.tree_util.tree_leaves_with_path(layouts, is_leaf=is_layout)
            if s is not None}
  def pick(path, sharding):
    names = tuple(map(key, path))
    if "muon" in names and "mu" in names:
      return wanted.get(names[names.index("mu") + 1:], sharding)
    return sharding
  return jax.tree_util.tree_map_with_path(pick, shardings)


def _scale_by_shape(dims_fn: Callable[[Any], Any], rms: float) -> optax.GradientTransformation:
  """An orthogonalised update (singular values ~1, RMS ~1/sqrt(max(fan_in, fan_out))) times
  rms * sqrt(max(fan_in, fan_out)), so its RMS is `rms` (Liu et al. 2025, eq. 4), or with rms = 0 times
  sqrt(max(1, fan_out / fan_in)) (Jordan 2024); fan_in / fan_out: the products of the reduction / output axes."""
  is_dims = lambda x: isinstance(x, (optax.contrib.MuonDimensionNumbers, optax.MaskedNode))
  def fans(u, d):
    axes_ = lambda a: (a,) if isinstance(a, int) else tuple(a)
    return (math.prod(u.shape[i] for i in axes_(d.reduction_axis)),
            math.prod(u.shape[i] for i in axes_(d.output_axis)))
  def scale(u, d):
    if isinstance(d, optax.MaskedNode):
      return u
    fan_in, fan_out = fans(u, d)
    return u * (rms * math.sqrt(max(fan_in, fan_out)) if rms > 0 else math.sqrt(max(1.0, fan_out / fan_in)))
  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda d, u: scale(u, d), dims_fn(updates), updates, is_leaf=is_dims), state
  return optax.GradientTransformation(optax.init_empty_state, update)


def _schedule_free(t, lr_multipliers: Any) -> optax.GradientTransformation:
  """optax.contrib.schedule_free around Adam without momentum (optax's schedule_free_adamw) with meshlm's decay
  mask, muP multipliers and learning-rate schedule (constant after warmup; its update includes -lr)."""
  lr_fn = schedule(t)
  base = [optax.scale_by_rms(decay=float(t.b2), eps=float(t.eps), eps_in_sqrt=False, bias_correction=True)]
  if lr_multipliers is not None and any(m != 1.0 for m in jax.tree.leaves(lr_multipliers)):
    base.append(_scale_per_parameter(lr_multipliers))
  if t.weight_decay > 0:
    base.append(_decay(t))
  base.append(optax.scale_by_learning_rate(lr_fn))
  return optax.contrib.schedule_free(optax.chain(*base), learning_rate=lr_fn, b1=float(t.b1),
                                     weight_lr_power=float(t.schedule_free_weight_lr_power))


def _state_in(tx: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
  """`tx` with its per-parameter state (float arrays of rank >= 1) stored in `dtype` between steps and updated in
  float32; scalars (counts, schedule-free's weight sums) stay as they are."""
  if dtype == "float32":
    return tx
  store, compute = jnp.dtype(dtype), jnp.float32
  def cast(tree, to):
    return jax.tree.map(lambda x: x.astype(to) if (hasattr(x, "dtype") and x.ndim and jnp.issubdtype(
        x.dtype, jnp.floating)) else x, tree)
  def init(params):
    return cast(tx.init(params), store)
  def update(updates, state, params=None):
    updates, state = tx.update(updates, cast(state, compute), params)
    return updates, cast(state, store)
  return optax.GradientTransformation(init, update)


# ---- Muon's matrices ------------------------------------------------------------------------------------------
BATCHED_AXES = ("layers", "experts")  # model.axes.LAYERS / EXPERTS: a stack of independent matrices


def logical_names(abstract_params: Any) -> Any:
  """The pure-dict tree of each parameter's logical axis names (a tuple, or None) from an nnx.State of Params."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), abstract_params,
                                       is_leaf=lambda x: isinstance(x, nnx.Variable)))


def is_names(x: Any) -> bool:
  """A leaf of `logical_names`' tree."""
  return x is None or isinstance(x, tuple)


def muon_dims_of(names: Any) -> Any:
  """`muon_dimension_numbers` of every parameter in a `logical_names` tree."""
  return jax.tree.map(muon_dimension_numbers, names, is_leaf=is_names)


def muon_dimension_numbers(names: Sequence[Any] | None) -> Any:
  """Muon's view of a parameter with logical axes `names` as a batch of matrices, or None (AdamW).

  The layer and expert axes are batch axes. Embeddings and the output projection (a vocab axis), norms, biases and
  the router (one axis left) are None. A kernel applied as x @ W has its input axes first: q/k/v [D, H, K] ->
  reduction D, output (H, K); o [H, K, D] (three axes ending in embed) -> reduction (H, K), output D; MLP and
  expert gate/up [D, F] -> D, F; down [F, D] -> F, D.
  """
  if not names or "vocab" in names:
    return None
  axes_ = [i for i, n in enumerate(names) if n not in BATCHED_AXES]
  if len(axes_) < 2:
    return None
  if len(axes_) > 2 and names[axes_[-1]] == "embed":
    return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(axes_[:-1]), output_axis=(axes_[-1],))
  return optax.contrib.MuonDimensionNumbers(reduction_axis=(axes_[0],), output_axis=tuple(axes_[1:]))


# ---- schedule-free's two sequences ------------------------------------------------------------------------------
def _schedule_free_state(opt_state: Any):
  found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.contrib.ScheduleFreeState))
           if isinstance(s, optax.contrib.ScheduleFreeState)]
  return found[0] if found else None


def _with_z(tree: Any, opt_state: Any, fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> Any:
  """fn(leaf, z, b1) per leaf with schedule-free's z (a frozen leaf, z masked, stays); `tree` without it."""
  sf = _schedule_free_state(opt_state)
  if sf is None:
    return tree
  masked = lambda n: isinstance(n, optax.MaskedNode)
  return jax.tree.map(lambda a, z: a if masked(z) else fn(a, z.astype(a.dtype), sf.b1).astype(a.dtype), tree, sf.z,
                      is_leaf=masked)


def gradient_point(params: Any, opt_state: Any) -> Any:
  """Where the step takes the gradient: schedule-free's y = b1 x + (1 - b1) z from the averaged parameters x the
  state keeps; `params` itself for every other optimizer (and for frozen parameters)."""
  return _with_z(params, opt_state, lambda x, z, b1: b1 * x + (1.0 - b1) * z)


def averaged(point: Any, opt_state: Any) -> Any:
  """The inverse of `gradient_point` after an update: schedule-free's x = (y - (1 - b1) z) / b1
  (optax.contrib.schedule_free_eval_params); `point` itself for every other optimizer."""
  return _with_z(point, opt_state, lambda y, z, b1: (y - (1.0 - b1) * z) / b1)


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


def apply_lr(params: Any, updates: Any, lr: jax.Array, included: bool = False) -> Any:
  """params - lr * updates, leaf by leaf, in the parameters' dtype; params + updates when the update already
  includes the learning rate (`included`: `brings_lr`)."""
  if included:
    return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
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
