"""The config a run actually uses: the requested one reconciled with its run directory and `train.init_from`.

Read before anything is written or compiled, so that a mismatch fails with a message naming the keys (exit 2)
instead of deep inside a restore:
- resuming: the model must be the one the checkpoint was trained with (`check_resume`); the learning-rate
  schedule keeps the checkpoint's horizon unless `train.schedule_steps` says otherwise (`keep_schedule`);
- `train.init_from` (a meshlm run or a Hugging Face directory): `config.model` is taken from the checkpoint
  (`model_from_init`); explicit overrides may change only keys that do not change the function it computes.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import ml_collections

from configs import ConfigError
from model import config as model_config
from train.core import checkpoint as ckpt_lib

# Model keys that say how the function is computed, not which function: a run may set them freely over a
# checkpoint's (layer scan and its unrolling, attention and dropless expert kernels and their blocks, compute and
# parameter dtypes, the unused init scale).
_SPLASH = ("splash_block_q", "splash_block_kv", "splash_block_kv_compute", "splash_block_q_bwd", "splash_block_kv_bwd",
           "pallas_interpret")
_KERNELS = (*_SPLASH, "moe_impl", "megablox_tile_m", "megablox_tile_k", "megablox_tile_n")
FUNCTION_PRESERVING = ("scan_layers", "attention_impl", "attention_block_size", "attention_query_block", "dtype",
                       "param_dtype", "init_std", "scan_unroll", "context_parallel", "context_layout", *_KERNELS)
# Of those, the ones a resumed run may change: the others change the saved state's layout or dtype.
RESUME_FREE = ("attention_impl", "attention_block_size", "attention_query_block", "dtype", "scan_unroll",
               "context_parallel", "context_layout", *_KERNELS)
# The keys a run started from a checkpoint with train.context_extension=True takes from its own config: the
# context length and the positions' encoding change, the parameters' shapes do not.
CONTEXT_EXTENSION = ("max_seq_len", "rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_len",
                     "rope_low_freq_factor", "rope_high_freq_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
                     "rope_attention_factor", "rope_yarn_truncate", "rope_mscale_all_dim", "rope_local_theta")


def is_hf_dir(path: str) -> bool:
  """A Hugging Face model directory: config.json beside safetensors weights."""
  return (os.path.isfile(os.path.join(path, "config.json"))
          and any(f.endswith(".safetensors") for f in os.listdir(path)))


def saved_run_config(checkpoint_dir: str, step: int | None = None) -> tuple[int, dict[str, Any]] | None:
  """(step, resolved config dict) of the latest (or given) checkpoint under `checkpoint_dir`; None when there is
  none. Opens the directory read-only: nothing is created or cleaned up."""
  if not os.path.isdir(checkpoint_dir):
    return None
  checkpointer = ckpt_lib.Checkpointer(checkpoint_dir, read_only=True)
  try:
    step = checkpointer.latest_step() if step is None else step
    if step is None:
      return None
    return step, dict(checkpointer.metadata(step).get("config") or {})
  finally:
    checkpointer.close()


def from_saved(saved: dict[str, Any]) -> ml_collections.ConfigDict:
  """The config a checkpoint's saved (JSON) config describes: configs/base.py with the saved values (lists back to
  tuples where the default is a tuple). Keys the checkpoint predates keep base's defaults, which compute what the
  code of its time did (a new key's default is the old behaviour, or a function-preserving setting such as
  model.attention_query_block), so older runs still load. Keys or sections this version does not know raise
  ConfigError naming them."""
  import configs  # pylint: disable=g-import-not-at-top
  config = configs.load_config_file("base")
  for section, values in saved.items():
    if section not in config:
      raise ConfigError(f"the run's config has a section {section!r} this meshlm does not know")
    for key, value in values.items():
      if key not in config[section]:
        raise ConfigError(f"the run's config key {section}.{key} is unknown to this meshlm version")
      old = config[section][key]
      config[section][key] = tuple(tuple(v) if isinstance(v, list) else v for v in value) \
          if isinstance(old, tuple) else value
  return config


def _as_json(value: Any) -> Any:
  """A config value as the JSON metadata stores it (tuples become lists), so a saved value compares equal."""
  return list(value) if isinstance(value, tuple) else value


def _differences(requested: ml_collections.ConfigDict, saved: dict[str, Any], skip: Sequence[str]) -> list[str]:
  return [f"model.{k}: checkpoint {saved[k]!r}, requested {requested[k]!r}"
          for k in requested if k not in skip and k in saved and _as_json(saved[k]) != _as_json(requested[k])]


def check_resume(config: ml_collections.ConfigDict, saved: dict[str, Any], where: str) -> None:
  """Raises ConfigError when `config.model` differs from the checkpoint's (`saved`, a config dict) in a key
  that a resumed run cannot change, naming every differing key with both values."""
  diffs = _differences(config.model, saved.get("model", {}), RESUME_FREE)
  if diffs:
    raise ConfigError(f"the run directory's checkpoint {where} was trained with another model config:\n  "
                      + "\n  ".join(diffs) + "\nuse the same model keys to resume, or another --workdir for a new run")


def keep_schedule(config: ml_collections.ConfigDict, saved: dict[str, Any]) -> str | None:
  """Keeps the checkpoint's learning-rate horizon on resume unless train.schedule_steps is set.

  Sets `config.train.schedule_steps` (in place) and returns a warning stating the schedule used when the
  requested horizon differs from the checkpoint's; None when they agree.
  """
  t, saved_t = config.train, saved.get("train", {})
  if "steps" not in saved_t:
    return None
  saved_horizon = int(saved_t.get("schedule_steps") or saved_t["steps"])
  if t.schedule_steps:
    if t.schedule_steps == saved_horizon:
      return None
    return (f"train.schedule_steps={t.schedule_steps}: the {t.schedule} schedule now spans {t.schedule_steps} "
            f"steps (the checkpoint's spanned {saved_horizon}); the learning rate changes at the resume step")
  if t.steps == saved_horizon:
    return None
  t.schedule_steps = saved_horizon
  if t.steps == saved_t["steps"]:  # resuming as before: the horizon was settled (and reported) when it changed
    return None
  return (f"train.steps={t.steps} differs from the checkpoint's schedule horizon of {saved_horizon} steps: keeping "
          f"the checkpoint's {t.schedule} schedule (warmup {t.warmup_steps}, peak {t.lr:g}, floor "
          f"{t.min_lr_ratio:g} x peak at step {saved_horizon}"
          + (", then held there" if t.steps > saved_horizon else "")
          + f"); set train.schedule_steps=N to stretch it to N steps instead")


def source_model(config: ml_collections.ConfigDict) -> tuple[dict[str, Any], str]:
  """The model config dict of `train.init_from` and a description of where it came from."""
  return model_at(config.train.init_from, "train.init_from")


def model_at(path: str, key: str) -> tuple[dict[str, Any], str]:
  """The model config dict of a meshlm run / checkpoints/<step> directory (its latest checkpoint's) or a Hugging
  Face directory (its config.json), and a description of where it came from; ConfigError naming `key` (the config
  key that gave `path`) when there is none."""
  if not os.path.isdir(path):
    raise ConfigError(f"{key}={path!r} is not a directory; give a meshlm run directory, a "
                      "checkpoints/<step> directory or a Hugging Face model directory")
  if is_hf_dir(path):
    from model import hf  # pylint: disable=g-import-not-at-top
    with open(os.path.join(path, "config.json")) as f:
      try:
        return dict(hf.config_from_hf(json.load(f))), f"{path}/config.json"
      except (ValueError, KeyError) as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
  try:
    directory, step = ckpt_lib.find_checkpoint_dir(path)
    found = saved_run_config(directory, step)
  except ckpt_lib.CheckpointError as e:
    raise ConfigError(f"{key}={path!r}: {e}") from None
  if found is None or "model" not in found[1]:
    raise ConfigError(f"{key}={path!r}: its checkpoint holds no saved config, so config.model cannot "
                      "be taken from it")
  return found[1]["model"], f"{directory}/{found[0]}"


def frozen_model(path: str, key: str, run_model: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The validated model config of a frozen model of its own size read from `path` (`model_at`; a distillation
  teacher): the checkpoint's or config.json's keys, with `run_model`'s RESUME_FREE ones (kernels, compute dtype:
  how it runs on this run's devices, not what it computes). ConfigError naming `key`."""
  source, where = model_at(path, key)
  try:
    cfg = from_saved({"model": dict(source)}).model
    for k in RESUME_FREE:
      cfg[k] = run_model[k]
    return model_config.validate(cfg)
  except ValueError as e:  # ConfigError included
    raise ConfigError(f"{key}={path!r} ({where}): {e}") from None


def model_from(config: ml_collections.ConfigDict, source: dict[str, Any], where: str,
               overrides: Sequence[str]) -> list[str]:
  """Sets `config.model` (in place) from a checkpoint's model config `source`; returns notes on changed keys.

  Keys in FUNCTION_PRESERVING keep the run's values, and so do CONTEXT_EXTENSION's with
  train.context_extension=True where the config sets them (an override, or a value other than the default; noted). Every other key takes the checkpoint's value, whatever the config file
  said; an explicit `--config.model.KEY` override (listed in `overrides`) of such a key that disagrees with the
  checkpoint raises ConfigError naming the key and both values.
  """
  explicit = {k.split(".", 1)[1] for k in overrides if k.startswith("model.")}
  extending = bool(config.train.get("context_extension", False))
  notes = []
  for key in config.model:
    if key in FUNCTION_PRESERVING or key not in source or _as_json(source[key]) == _as_json(config.model[key]):
      continue
    if extending and key in CONTEXT_EXTENSION and (key in explicit or _as_json(config.model[key]) != _as_json(
        model_config.default_model_config()[key])):  # a key the config leaves at its default keeps the checkpoint's
      notes.append(f"model.{key}={config.model[key]!r} (the checkpoint has {source[key]!r}: context extension)")
      continue
    if key in explicit:
      raise ConfigError(f"--config.model.{key}={config.model[key]!r} contradicts {where}, which has "
                        f"model.{key}={source[key]!r}: {key} changes the function the weights compute; drop the "
                        f"override (only {', '.join(FUNCTION_PRESERVING)} may differ, and with "
                        "train.context_extension=True the context length and RoPE keys)")
    notes.append(f"model.{key}={source[key]!r} (config file: {config.model[key]!r})")
    config.model[key] = tuple(source[key]) if isinstance(source[key], list) else source[key]
  return notes


def layout(abstract_state: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  """The state's leaves as {"params/embed/embedding": (shape, dtype name)}, keyed as Checkpointer.state_layout."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return {"/".join(map(str, k)): (tuple(v.shape), str(v.dtype))
          for k, v in ocp.tree.to_flat_dict(abstract_state).items()}


def layout_cause(config: ml_collections.ConfigDict, saved_config: dict[str, Any]) -> str:
  """Why a resumed run's train state differs from its checkpoint's, from the two configs: another train.objective
  (its own state: reward head, value head, frozen models), else the keys that shape the optimizer or the dtypes
  that differ, else the general advice."""
  saved_train, saved_model = saved_config.get("train", {}), saved_config.get("model", {})
  if saved_train.get("objective", config.train.objective) != config.train.objective:
    return (f"the checkpoint was trained with train.objective={saved_train['objective']!r} and this run asks for "
            f"{config.train.objective!r}: train the new objective in a new --workdir, starting from this one with "
            "--config.train.init_from=<this workdir>")
  changed = [f"train.{k}" for k in ("clip_norm", "weight_decay")
             if (saved_train.get(k, config.train[k]) > 0) != (config.train[k] > 0)]
  changed += ["model.param_dtype"] if saved_model.get("param_dtype", config.model.param_dtype) != \
      config.model.param_dtype else []
  if changed:
    return (f"{', '.join(changed)} changed (the optimizer's parts change when train.clip_norm or train.weight_decay "
            "switches between 0 and > 0, the dtypes with model.param_dtype); resume with the checkpoint's settings "
            "(its config.json) or start a new --workdir")
  return ("resume with the checkpoint's settings (its config.json) or start a new --workdir")


def check_state_layout(wanted: dict[str, Any], saved: dict[str, Any], where: str, limit: int = 4,
                       cause: str | None = None) -> None:
  """Raises ConfigError when the train state this config builds (`wanted`, from `layout`) is not the one saved in
  the checkpoint (`saved`, from Checkpointer.state_layout): leaves missing on either side or of another shape or
  dtype, a few of each named, then `cause` (`layout_cause`). Restoring such a checkpoint would otherwise fail deep
  inside orbax."""
  problems = []
  missing = sorted(set(wanted) - set(saved))
  extra = sorted(set(saved) - set(wanted))
  changed = sorted(k for k in set(wanted) & set(saved) if wanted[k] != saved[k])
  if missing:
    problems.append(f"{len(missing)} leaves this config needs are not in the checkpoint: "
                    + ", ".join(missing[:limit]))
  if extra:
    problems.append(f"{len(extra)} leaves of the checkpoint are not in this config's state: " + ", ".join(extra[:limit]))
  for k in changed[:limit]:
    problems.append(f"{k}: checkpoint {saved[k][0]} {saved[k][1]}, this config {wanted[k][0]} {wanted[k][1]}")
  if problems:
    cause = cause or ("the optimizer's parts change when train.clip_norm or train.weight_decay switches between 0 "
                      "and > 0, and the dtypes with model.param_dtype; resume with the checkpoint's settings (its "
                      "config.json) or start a new --workdir")
    raise ConfigError(f"the train state saved in {where} does not fit this config:\n  " + "\n  ".join(problems)
                      + f"\n{cause}")
