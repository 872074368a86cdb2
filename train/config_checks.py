"""The train package's config checks, registered with configs.validate when train/ is imported (train/__init__.py).

Conditional keys of the sections the training commands own (`train`, `rl`, `log`): keys that act only under a
condition, refused (or, for train.xla_overlap, warned about) where they cannot act (configs.validate.Conditional).
Importing this module also imports `data`, so a training command always checks the data section too.

Facts known only later: `stage` and `platform` (the Trainer's mesh, train/core/step.py), `command` ("rl" in
`python -m train.rl`'s own checks, train/rl/loop.py _check_rl).
"""
from __future__ import annotations

import data  # noqa: F401  pylint: disable=unused-import  (registers the data section's checks)
from configs import validate
from data import config_checks as data_checks

# The platforms train.core.step.OVERLAP_OPTIONS has options for (a test keeps the two equal).
OVERLAP_PLATFORMS = ("tpu", "gpu")
_PIPELINE = ("pipeline_microbatches", "pipeline_repeats", "pipeline_remat")
_DISTILL = ("distill_teacher", "distill_teacher_recipe", "distill_loss", "distill_temperature", "distill_top_k",
            "distill_lm_weight")
_PPO_ONLY = ("gamma", "lam", "value_clip", "vf_coef", "ent_coef", "whiten_advantages")
_GRPO_ONLY = ("loss", "scale_rewards", "dynamic_sampling")


def _stages(config, facts):
  stage = facts.get("stage", config.mesh.stage)
  return None if stage == -1 else stage > 1  # -1: all remaining devices, known with the mesh


def _sequence(config, facts):
  del facts
  sequence = config.mesh.sequence
  return None if sequence == -1 else sequence > 1  # -1: all remaining devices, known with the mesh


def _platform(config, facts):
  del config
  return facts["platform"] in OVERLAP_PLATFORMS if "platform" in facts else None


def _loss_scaling(config, facts):
  del facts
  mode = config.train.loss_scale
  if mode not in ("auto", "dynamic", "none"):
    return None  # the optimizer refuses it, naming the key
  return mode == "dynamic" or (mode == "auto" and config.model.dtype == "float16")


def _evaluates(config, facts, needs_tasks=False, needs_chat=False):
  """Whether the evaluations run, with eval tasks / chat data: `python -m train`'s every train.eval_every steps;
  train.rl's every rl.eval_every iterations, which answer held-out chat prompts (needs_chat) but run no tasks.
  Before the command is known (a config file on its own) a key acts if either command's evaluations use it."""
  if "command" not in facts:
    return any(_evaluates(config, {**facts, "command": c}, needs_tasks, needs_chat) for c in ("train", "rl"))
  rl = facts["command"] == "rl"
  if rl and (needs_tasks or not needs_chat or config.rl.eval_every == 0):
    return False
  if not rl and config.train.eval_every == 0:
    return False
  if needs_tasks and not config.train.eval_tasks:
    return False
  if needs_chat:
    kinds = data_checks.source_kinds(config.data)
    return None if kinds is None else bool(kinds & {"chat", "preference"})
  return True


def _has_chat(config):
  kinds = data_checks.source_kinds(config.data)
  return None if kinds is None else "chat" in kinds


def _row(key, condition, acts, why="", **kw):
  return validate.Conditional(key, condition, acts, why=why, **kw)


_EVAL_ROWS = (
    _row("train.eval_generations", "data.sources has a chat or preference source and the run evaluates "
         "(train.eval_every > 0; train.rl: rl.eval_every > 0)", lambda c, f: _evaluates(c, f, needs_chat=True),
         "held-out prompts come from the chat and preference sources' eval split", needs=("command",)),
    _row("train.eval_tasks", "train.eval_every > 0 (python -m train; train.rl evaluates with rl.eval_*)",
         _evaluates, "the tasks run at each evaluation", needs=("command",)),
    _row("train.eval_tasks_limit", "train.eval_tasks is set and train.eval_every > 0 (python -m train)",
         lambda c, f: _evaluates(c, f, needs_tasks=True), "it caps the documents per eval task",
         needs=("command",)),
)

def _optimizer_is(*kinds):
  return lambda c, f: c.train.optimizer in kinds


_OPTIMIZER_ROWS = (
    *(_row(f"train.{k}", "train.optimizer=muon", _optimizer_is("muon"))
      for k in ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_coeffs", "muon_rms")),
    *(_row(f"train.{k}", "train.optimizer=adafactor", _optimizer_is("adafactor"))
      for k in ("adafactor_decay_rate", "adafactor_clip", "adafactor_momentum", "adafactor_min_dim_to_factor")),
    _row("train.schedule_free_weight_lr_power", "train.optimizer=schedule_free_adamw",
         _optimizer_is("schedule_free_adamw")),
    *(_row(f"train.{k}", "train.optimizer is adamw, muon, lion or schedule_free_adamw",
           _optimizer_is("adamw", "muon", "lion", "schedule_free_adamw"), "adafactor has no first or second "
           "moment decay of its own (train.adafactor_*)") for k in ("b1", "b2")),
    _row("train.eps", "train.optimizer is adamw, muon or schedule_free_adamw",
         _optimizer_is("adamw", "muon", "schedule_free_adamw"), "lion's sign update and adafactor have no epsilon"),
)

validate.conditional(
    *(_row(f"train.{k}", "mesh.stage > 1", _stages, "pipeline parallelism (docs/pipeline.md)", needs=("stage",))
      for k in _PIPELINE),
    _row("train.context_extension", "train.init_from or train.base_recipe is set",
         lambda c, f: bool(c.train.init_from or c.train.base_recipe),
         "it lets a run started from a checkpoint change the context length and RoPE keys"),
    _row("model.context_parallel", "mesh.sequence > 1", _sequence,
         "it chooses how attention crosses the sequence axis (docs/parallel.md)"),
    _row("train.xla_overlap", "the devices are TPUs or GPUs", _platform,
         "XLA's collective-overlap options (train.core.step.OVERLAP_OPTIONS) exist for those only",
         severity="warn", needs=("platform",)),
    *(_row(f"train.{k}", "model.num_experts > 0", lambda c, f: c.model.num_experts > 0, "a dense model has no router")
      for k in ("moe_aux_loss", "router_z_loss")),
    _row("train.mtp_loss_weight", "model.mtp_depth > 0", lambda c, f: c.model.mtp_depth > 0,
         "the model has no multi-token heads"),
    _row("model.mtp_depth", "train.objective is lm or prefix_lm (python -m train)",
         lambda c, f: c.train.objective in ("lm", "prefix_lm") and f.get("command") != "rl",
         "the multi-token heads are trained by the next-token objectives only", needs=("command",)),
    _row("train.router_bias_update_rate", "model.num_experts > 0 and model.router='sigmoid'",
         lambda c, f: c.model.num_experts > 0 and c.model.router == "sigmoid",
         "only the sigmoid router chooses experts with a score bias"),
    *(_row(f"train.{k}", "loss scaling is on (train.loss_scale=dynamic, or auto with model.dtype=float16)",
           _loss_scaling) for k in ("loss_scale_init", "loss_scale_period")),
    *(_row(f"train.{k}", "train.lora_rank > 0", lambda c, f: c.train.lora_rank > 0, "LoRA adapters are off")
      for k in ("lora_alpha", "lora_targets", "lora_rslora", "lora_dropout", "lora_base_quant",
                "lora_base_double_quant")),
    *(_row(f"train.{k}", "train.objective=dpo", lambda c, f: c.train.objective == "dpo")
      for k in ("dpo_beta", "dpo_loss", "dpo_label_smoothing", "dpo_rpo_alpha")),
    _row("train.reward_center", "train.objective=reward", lambda c, f: c.train.objective == "reward"),
    *(_row(f"train.{k}", "train.objective=distill", lambda c, f: c.train.objective == "distill",
           "it configures knowledge distillation (train/objectives/distill.py)") for k in _DISTILL),
    _row("train.distill_beta", "train.objective=distill and train.distill_loss=jsd",
         lambda c, f: c.train.objective == "distill" and c.train.distill_loss == "jsd",
         "beta interpolates the generalised JSD's mixture only"),
    *(_row(f"train.{k}", "train.objective=mlm", lambda c, f: c.train.objective == "mlm")
      for k in ("mlm_rate", "mlm_mask_fraction", "mlm_random_fraction")),
    *_EVAL_ROWS,
    *_OPTIMIZER_ROWS,
    _row("train.decay_fraction", "train.schedule='wsd'", lambda c, f: c.train.schedule == "wsd"),
    _row("train.min_lr_ratio", "train.schedule is 'cosine' or 'wsd'", lambda c, f: c.train.schedule != "constant",
         "the constant schedule never decays"),
    _row("rl.kl_target", "rl.algorithm=ppo", lambda c, f: c.rl.algorithm == "ppo",
         "it is the target of PPO's adaptive KL controller; grpo keeps rl.kl_coef fixed"),
    _row("rl.kl_horizon", "rl.algorithm=ppo and rl.kl_target > 0",
         lambda c, f: c.rl.algorithm == "ppo" and c.rl.kl_target > 0, "the adaptive KL controller's horizon"),
    *(_row(f"rl.{k}", "rl.algorithm=ppo", lambda c, f: c.rl.algorithm == "ppo", "GRPO and best_of_n have no critic")
      for k in _PPO_ONLY),
    *(_row(f"rl.{k}", "rl.algorithm is ppo or grpo", lambda c, f: c.rl.algorithm in ("ppo", "grpo"),
           "best_of_n fine-tunes on its best samples with the sft objective")
      for k in ("clip", "clip_high", "kl_coef", "mask_truncated")),
    *(_row(f"rl.{k}", "rl.algorithm=grpo", lambda c, f: c.rl.algorithm == "grpo",
           "it configures the GRPO family's loss and sampling") for k in _GRPO_ONLY),
    _row("rl.dynamic_sampling_rounds", "rl.algorithm=grpo and rl.dynamic_sampling=True",
         lambda c, f: c.rl.algorithm == "grpo" and c.rl.dynamic_sampling, "it bounds dynamic sampling's rounds"),
    *(_row(f"rl.{k}", "rl.async_rollouts=True", lambda c, f: c.rl.async_rollouts,
           "the synchronous loop samples with the learner's own policy") for k in ("max_staleness", "rollout_devices",
                                                                                  "tis_cap")),
    _row("rl.max_turns", "rl.env is set", lambda c, f: bool(c.rl.env), "one completion per prompt is one turn"),
    _row("rl.reward", "rl.env is empty", lambda c, f: not c.rl.env, "the environment's step() gives the rewards"),
    _row("rl.overlong_buffer", "rl.algorithm is ppo, grpo or best_of_n", lambda c, f: c.rl.algorithm != "gkd",
         "gkd trains on every completion whatever its reward (the shaped reward is only reported)"),
    *(_row(f"rl.{k}", "rl.algorithm is ppo, grpo or best_of_n", lambda c, f: c.rl.algorithm != "gkd",
           "gkd trains on every completion whatever its reward (the shaped reward is only reported)")
      for k in ("length_penalty", "missing_eos_penalty")),
    _row("rl.ptx_coef", "rl.algorithm is ppo, grpo or best_of_n and data.sources has a chat source",
         lambda c, f: c.rl.algorithm != "gkd" and _has_chat(c),
         "its rows are the chat sources' conversations, mixed into the policy updates"),
    *(_row(f"rl.{k}", "rl.eval_every > 0", lambda c, f: c.rl.eval_every > 0, "held-out evaluation is off")
      for k in ("eval_prompts", "eval_best_of")),
    _row("log.wandb_project", "log.wandb=True", lambda c, f: c.log.wandb, "nothing is logged to Weights & Biases"),
)


def _optimizer(config):
  """train.optimizer's choices and the keys it constrains (train/core/optimizer.py check), before anything runs."""
  if "train" not in config or "optimizer" not in config.train:
    return
  from train.core import optimizer  # jax and optax: imported when a train config is checked, not before
  optimizer.check(config.train)


validate.register("train.optimizer", _optimizer)
