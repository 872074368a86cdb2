"""Config checks, run by `configs.parse` (and again by training): ranges, each package's validator, conditional keys.

Types are checked when overrides are applied (configs/loader.py); this module checks values: a key outside its
range raises ConfigError naming the key, its value and the allowed range, before anything runs (the CLIs exit 2).
Keys absent from a config (the curation config has no `train` section) are skipped.

Each package validates its own section; configs imports no data/, train/ or evals/ module, so they push their
checks in here when imported (data/__init__.py and train/__init__.py import their `config_checks` modules, and
every command lives under one of them, so its checks are registered before it parses a config):
  register(name, fn)    fn(config) raises ValueError/ConfigError naming the key, may return warnings
  conditional(*rows)    `Conditional` rows: keys that act only under a condition (a silent no-op elsewhere)
`model.*` keys are checked by the model's own validation and its `CONDITIONAL_KEYS` table (model/config.py, which
imports nothing from configs), pulled from here.

A conditional key set away from its default (configs/base.py) where its condition fails is an error (ConfigError
naming the key and the condition; the CLIs exit 2) or, with severity "warn", a warning; so is an error-severity
key that only the config file set when the command line idled it (`explicit`: the keys given there). Conditions that read facts
known only later (`platform`, the resolved `stage` count: the Trainer's mesh; `command`: `python -m train.rl`)
are re-checked there with `check_conditional(config, **facts)`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Collection, Iterable, Mapping

import ml_collections

from configs.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Range:
  """lo <= x <= hi (strict where `*_open`); `special` lists extra allowed values with their meaning."""
  lo: float = -math.inf
  hi: float = math.inf
  lo_open: bool = False
  hi_open: bool = False
  special: tuple[tuple[Any, str], ...] = ()

  def admits(self, x) -> bool:
    if any(x == v for v, _ in self.special):
      return True
    above = x > self.lo if self.lo_open else x >= self.lo
    below = x < self.hi if self.hi_open else x <= self.hi
    return math.isfinite(x) and above and below

  def describe(self) -> str:
    if self.hi == math.inf:
      text = f"{'>' if self.lo_open else '>='} {self.lo:g}"
    else:
      text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
    return text + "".join(f", or {v} ({why})" for v, why in self.special)


_POSITIVE = Range(lo=0, lo_open=True)
_AT_LEAST_1 = Range(lo=1)
_AT_LEAST_0 = Range(lo=0)
_FRACTION = Range(lo=0, hi=1)
_MESH = Range(lo=1, special=((-1, "all remaining devices"),))
_DCN = Range(lo=1, special=((-1, "all remaining slices/hosts"),))

# Every numeric key outside `model` (tuples: the range of each element).
RANGES: dict[str, Range] = {
    **{f"mesh.{a}": _MESH for a in ("data", "fsdp", "tensor", "sequence", "expert", "stage")},
    "mesh.dcn_data": _DCN,
    "mesh.dcn_fsdp": _DCN,
    "train.steps": _AT_LEAST_1,
    "train.batch_size": _AT_LEAST_1,
    "train.seq_len": Range(lo=2),  # inputs and targets are the sequence shifted by one
    "train.grad_accum": _AT_LEAST_1,
    "train.lr": _POSITIVE,
    "train.min_lr_ratio": _FRACTION,
    "train.warmup_steps": _AT_LEAST_0,
    "train.decay_fraction": _FRACTION,
    "train.b1": Range(lo=0, hi=1, hi_open=True),
    "train.b2": Range(lo=0, hi=1, hi_open=True),
    "train.eps": _POSITIVE,
    "train.muon_momentum": Range(lo=0, hi=1, hi_open=True),
    "train.muon_ns_steps": _AT_LEAST_1,
    "train.muon_rms": Range(lo=0, lo_open=True, special=((0, "width scaling sqrt(max(1, fan_out / fan_in))"),)),
    "train.adafactor_decay_rate": Range(lo=0, hi=1, lo_open=True),
    "train.adafactor_clip": Range(lo=0, lo_open=True, special=((0, "no clipping"),)),
    "train.adafactor_momentum": Range(lo=0, hi=1, hi_open=True),
    "train.adafactor_min_dim_to_factor": _AT_LEAST_1,
    "train.schedule_free_weight_lr_power": _AT_LEAST_0,
    "train.weight_decay": _AT_LEAST_0,
    "train.clip_norm": Range(lo=0, lo_open=True, special=((0, "no clipping"),)),
    "train.z_loss": _AT_LEAST_0,
    "train.seed": _AT_LEAST_0,
    "train.log_every": _AT_LEAST_1,
    "train.eval_every": Range(lo=1, special=((0, "no evaluation"),)),
    "train.eval_steps": _AT_LEAST_1,
    "train.max_nonfinite": _AT_LEAST_1,
    "train.debug_nan_steps": _AT_LEAST_1,
    "train.peak_tflops": Range(lo=0, lo_open=True, special=((0, "look the device up"),)),
    "train.schedule_steps": Range(lo=1, special=((0, "train.steps"),)),
    "train.moe_aux_loss": _AT_LEAST_0,
    "train.router_z_loss": _AT_LEAST_0,
    "train.router_bias_update_rate": _AT_LEAST_0,
    "train.mtp_loss_weight": _AT_LEAST_0,
    "train.eval_tasks_limit": Range(lo=1, special=((0, "all documents"),)),
    "train.eval_generations": _AT_LEAST_0,
    "train.eval_max_new_tokens": _AT_LEAST_1,
    "train.lora_rank": _AT_LEAST_0,
    "train.lora_alpha": _POSITIVE,
    "train.lora_dropout": Range(lo=0, hi=1, hi_open=True),
    "train.reward_center": _AT_LEAST_0,
    "train.dpo_beta": _POSITIVE,
    "train.dpo_label_smoothing": Range(lo=0, hi=0.5, hi_open=True),
    "train.dpo_rpo_alpha": _AT_LEAST_0,
    "rl.ptx_coef": _AT_LEAST_0,
    "train.distill_beta": _FRACTION,
    "train.distill_temperature": _POSITIVE,
    "train.distill_top_k": Range(lo=1, special=((0, "the whole vocabulary"),)),
    "train.distill_lm_weight": _AT_LEAST_0,
    "train.pipeline_microbatches": Range(lo=1, special=((0, "mesh.stage"),)),
    "train.pipeline_repeats": _AT_LEAST_1,
    "train.loss_scale_init": _AT_LEAST_1,
    "train.loss_scale_period": _AT_LEAST_1,
    "train.mlm_rate": Range(lo=0, hi=1, lo_open=True),
    "train.mlm_mask_fraction": _FRACTION,
    "train.mlm_random_fraction": _FRACTION,
    "data.weights": _POSITIVE,
    "data.tokenizer_vocab_size": Range(lo=1, special=((0, "model.vocab_size"),)),
    "data.tokenizer_character_coverage": Range(lo=0, hi=1, lo_open=True),
    "data.tokenizer_max_sentences": _AT_LEAST_1,
    "data.packing_bins": _AT_LEAST_1,
    "data.shuffle_seed": _AT_LEAST_0,
    "data.eval_fraction": Range(lo=0, hi=1, hi_open=True),
    "data.worker_count": _AT_LEAST_0,
    "data.prefetch": _AT_LEAST_0,
    "data.fim_rate": _FRACTION,
    "data.fim_spm_rate": _FRACTION,
    "data.ul2_r_mean_span": Range(lo=1),
    "data.ul2_r_rate": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "data.ul2_x_mean_span": Range(lo=1),
    "data.ul2_x_rate": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "checkpoint.every": Range(lo=1, special=((0, "only at the end"),)),
    "checkpoint.keep": _AT_LEAST_1,
    "checkpoint.keep_period": Range(lo=1, special=((0, "off"),)),
    "distributed.num_processes": Range(lo=1, special=((0, "from the environment"),)),
    "distributed.process_id": Range(lo=0, special=((-1, "from the environment"),)),
    "distributed.local_device_ids": _AT_LEAST_0,
    "distributed.timeout_s": _AT_LEAST_1,
    "rl.eval_fraction": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "rl.iterations": _AT_LEAST_1,
    "rl.prompts_per_iteration": _AT_LEAST_1,
    "rl.samples_per_prompt": _AT_LEAST_1,
    "rl.max_new_tokens": _AT_LEAST_1,
    "rl.temperature": _POSITIVE,
    "rl.kl_coef": _AT_LEAST_0,
    "rl.kl_target": Range(lo=0, lo_open=True, special=((0, "fixed rl.kl_coef"),)),
    "rl.kl_horizon": _POSITIVE,
    "rl.gamma": _FRACTION,
    "rl.lam": _FRACTION,
    "rl.clip": _POSITIVE,
    "rl.clip_high": Range(lo=0, lo_open=True, special=((0, "rl.clip"),)),
    "rl.dynamic_sampling_rounds": _AT_LEAST_1,
    "rl.max_turns": _AT_LEAST_1,
    "rl.max_staleness": _AT_LEAST_0,
    "rl.rollout_devices": _AT_LEAST_0,
    "rl.tis_cap": Range(lo=1),
    "rl.overlong_buffer": Range(lo=1, special=((0, "off"),)),
    "rl.value_clip": _POSITIVE,
    "rl.vf_coef": _AT_LEAST_0,
    "rl.ent_coef": _AT_LEAST_0,
    "rl.epochs": _AT_LEAST_1,
    "rl.length_penalty": _AT_LEAST_0,
    "rl.missing_eos_penalty": _AT_LEAST_0,
    "rl.max_bad_rewards": _AT_LEAST_1,
    "rl.eval_every": Range(lo=1, special=((0, "no evaluation"),)),
    "rl.eval_prompts": _AT_LEAST_1,
    "rl.eval_best_of": Range(lo=1, special=((0, "off"),)),
    "rl.seed": _AT_LEAST_0,
}


def profile_window(spec: str) -> tuple[int, int] | None:
  """train.profile_steps "A:B" -> (A, B) with 1 <= A < B (steps A..B-1 are traced); "" -> None; else ConfigError."""
  if not spec:
    return None
  parts = str(spec).split(":")
  try:
    first, end = (int(p) for p in parts)
  except ValueError:
    first, end = 0, 0
  if len(parts) != 2 or not 1 <= first < end:
    raise ConfigError(f"train.profile_steps={spec!r} must be \"A:B\" with 1 <= A < B (traces steps A..B-1, e.g. "
                      "\"10:13\"), or \"\" for no trace")
  return first, end


def _get(config: ml_collections.ConfigDict, dotted: str):
  node = config
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return None
    node = node[part]
  return node


Validator = Callable[[ml_collections.ConfigDict], "Iterable[str] | None"]
SEVERITIES = ("warn", "error")


@dataclasses.dataclass(frozen=True)
class Conditional:
  """A key that acts only when `acts(config, facts)` holds (module docstring).

  `condition` says when, in words naming keys ("mesh.stage > 1"); `why` what the key does or the fix. `acts`
  returns None when it cannot tell yet (a fact in `needs` not known: `stage` with mesh.stage=-1, `platform`
  before there is a mesh); such rows are checked again where the fact is known.
  """
  key: str
  condition: str
  acts: Callable[[ml_collections.ConfigDict, Mapping[str, Any]], "bool | None"]
  severity: str = "error"
  why: str = ""
  needs: tuple[str, ...] = ()


_VALIDATORS: dict[str, Validator] = {}
_CONDITIONALS: dict[tuple[str, str], Conditional] = {}


def register(name: str, fn: Validator) -> None:
  """Adds (or replaces: re-imports are harmless) the validator `name`, which `check` runs on every config."""
  _VALIDATORS[name] = fn


def conditional(*rows: Conditional) -> None:
  """Adds conditional-key rows (replacing a row of the same key and condition)."""
  for row in rows:
    if row.severity not in SEVERITIES:
      raise ValueError(f"{row.key}: severity {row.severity!r} is not one of {', '.join(SEVERITIES)}")
    _CONDITIONALS[(row.key, row.condition)] = row


def conditional_rows() -> list[Conditional]:
  """Every conditional row: the registered ones, then the model's (model/config.py CONDITIONAL_KEYS)."""
  from model import config as model_config  # pylint: disable=g-import-not-at-top
  model_rows = [Conditional(f"model.{key}", condition,
                            lambda config, facts, acts=acts: acts(config.model), "error", why)
                for key, condition, acts, why in model_config.CONDITIONAL_KEYS]
  return list(_CONDITIONALS.values()) + model_rows


@functools.lru_cache(maxsize=1)
def _defaults() -> ml_collections.ConfigDict:
  from configs import base  # pylint: disable=g-import-not-at-top  (base builds on the model package)
  return base.get_config()


def check_conditional(config: ml_collections.ConfigDict, explicit: Collection[str] | None = None,
                      **facts) -> list[str]:
  """Raises ConfigError for the first error-severity conditional key set where it cannot act; returns the
  warnings. With `facts` (platform=, stage=, command=) only the rows reading one of them are checked.

  `explicit`: the keys given on the command line, when known. A key that only its config file set is then a
  warning, not an error: `--config=grpo_tiny --config.rl.eval_every=0` turns the preset's rl.eval_prompts inert
  by choice. None (unknown) treats every key as explicit.
  """
  warnings = []
  for row in conditional_rows():
    if facts and not set(row.needs) & set(facts):
      continue
    value, default = _get(config, row.key), _get(_defaults(), row.key)
    if value is None or default is None or value == default or row.acts(config, facts) is not False:
      continue
    known = ", ".join(f"{k}={facts[k]}" for k in row.needs if k in facts)
    message = (f"{row.key}={value!r} has no effect unless {row.condition}" + (f" (here {known})" if known else "")
               + (f": {row.why}" if row.why else "") + f"; leave it at its default {default!r} or make the "
               "condition hold")
    if row.severity == "error" and (explicit is None or row.key in explicit):
      raise ConfigError(message)
    warnings.append(message)
  return warnings


def check(config: ml_collections.ConfigDict, explicit: Collection[str] | None = None) -> list[str]:
  """Raises ConfigError for the first bad value; returns warnings (legal but suspicious settings).
  `explicit`: the keys given on the command line, when known (`check_conditional`).

  In order: ranges, the model's validation, the registered validators, train.profile_steps, the conditional keys.
  """
  for key, allowed in RANGES.items():
    value = _get(config, key)
    if value is None:
      continue
    for x in (value if isinstance(value, tuple) else (value,)):
      if isinstance(x, bool) or not isinstance(x, (int, float)) or not allowed.admits(x):
        what = f"{key}={value!r}" + (f" (element {x!r})" if isinstance(value, tuple) else "")
        raise ConfigError(f"{what} is out of range: it must be {allowed.describe()}")
  if "model" in config:
    from model import config as model_config  # pylint: disable=g-import-not-at-top
    try:
      model_config.validate(config.model)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  t = config.get("train")
  if t is not None and "mlm_mask_fraction" in t and t.mlm_mask_fraction + t.mlm_random_fraction > 1:
    raise ConfigError(f"train.mlm_mask_fraction={t.mlm_mask_fraction} + train.mlm_random_fraction="
                      f"{t.mlm_random_fraction} exceeds 1: they split the selected tokens with the unchanged rest")
  warnings = []
  for fn in list(_VALIDATORS.values()):
    try:
      warnings += list(fn(config) or ())
    except ValueError as e:  # ConfigError included: re-raised as one, message unchanged
      raise ConfigError(str(e)) from None
  if t is not None and "profile_steps" in t:
    profile_window(t.profile_steps)
  warnings += check_conditional(config, explicit)
  if t is not None and "warmup_steps" in t and t.warmup_steps > t.steps:
    warnings.append(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}: the learning rate never "
                    f"reaches train.lr={t.lr:g} (it ends at {t.lr * t.steps / t.warmup_steps:.3g})")
  return warnings
