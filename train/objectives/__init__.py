"""Training objectives of the one Trainer (`train.objective`): one module per objective (see base.py)."""
from __future__ import annotations

from train.objectives.base import FrozenModel, Objective, TOKEN_BATCH_KEYS
from train.objectives.distill import Distillation
from train.objectives.dpo import DirectPreference
from train.objectives.grpo import GroupRelativePolicyOptimization
from train.objectives.lm import LanguageModel
from train.objectives.mlm import MaskedLanguageModel
from train.objectives.ppo import ProximalPolicyOptimization
from train.objectives.prefix_lm import PrefixLanguageModel
from train.objectives.reward import RewardModel
from train.objectives.sft import SupervisedFineTuning

OBJECTIVES = {cls.name: cls for cls in (LanguageModel, SupervisedFineTuning, RewardModel, DirectPreference,
                                         ProximalPolicyOptimization, GroupRelativePolicyOptimization,
                                         MaskedLanguageModel, PrefixLanguageModel, Distillation)}


def make(config) -> Objective:
  """The objective named by config.train.objective (ValueError naming the key otherwise)."""
  name = config.train.objective
  if name not in OBJECTIVES:
    raise ValueError(f"config.train.objective={name!r} is not one of {', '.join(OBJECTIVES)}")
  return OBJECTIVES[name](config)


__all__ = ["OBJECTIVES", "FrozenModel", "Objective", "TOKEN_BATCH_KEYS", "make"]
