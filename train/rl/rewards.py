"""Rewards of `python -m train.rl` (rl.reward): a Python function of (prompt, completion) or a reward-model run.

`py:MODULE:FUNCTION` is called with (prompt text, completion text) -> a float, or a dict of named parts (e.g.
data.tasks.reward's {"correct", "format"}) whose sum is the reward and each of which is kept (`Reward.scored`,
logged as reward_<name>_mean); `rm:RUN` is a reward-model run scored
through `train.rundir.reward.load_scorer` on the conversation + completion as a chat record (`reward_text`). A
reward that raises or is not finite comes back as NaN and is recorded in `Reward.failures`.
"""
from __future__ import annotations

import importlib
import json
import math
import os
from typing import Sequence

import numpy as np

from train.core import checkpoint as ckpt_lib
from train.core.setup import SetupError


def reward_text(conversation: Sequence[dict], completion: str) -> str:
  """What a reward model scores for one rollout: the conversation and the completion as a JSON chat record, which
  `train.reward` renders with the reward run's own template, as its preference pairs were in training."""
  return json.dumps({"messages": list(conversation) + [{"role": "assistant", "content": completion}]})


def add_parts(parts: dict[str, np.ndarray], value, i: int, n: int) -> float:
  """A reward `value` (a float, or a dict of named parts) as a float, each part added to parts[name][i] (an array
  of n, zeros when new)."""
  if isinstance(value, dict):
    total = 0.0
    for name, part in value.items():
      parts.setdefault(str(name), np.zeros(n))[i] += float(part)
      total += float(part)
    return total
  return float(value)


class Reward:
  """rl.reward as a batch function: (prompts, completions, texts) -> float64 [N], NaN where a reward raised or
  was not finite. `texts` (`reward_text`: the conversation + completion as a chat record) is what a reward model
  scores."""

  def __init__(self, spec: str):
    self.spec, self.failures = spec, []
    kind, _, target = spec.partition(":")
    self._pair = self._batch = None
    if kind == "py":
      module, _, name = target.rpartition(":")
      if not module or not name:
        raise SetupError(f"rl.reward={spec!r} must be py:MODULE:FUNCTION, e.g. "
                         "py:data.rl_prompts:greater_reward")
      try:
        self._pair = getattr(importlib.import_module(module), name)
      except (ImportError, AttributeError) as e:
        raise SetupError(f"rl.reward={spec!r}: cannot load {name} from module {module} ({e}); give an "
                         "importable module (on PYTHONPATH) and a function (prompt, completion) -> float") from None
      if not callable(self._pair):
        raise SetupError(f"rl.reward={spec!r}: {module}.{name} is not callable")
    elif kind == "rm":
      if not os.path.isdir(target):
        raise SetupError(f"rl.reward={spec!r}: no reward-model run directory {target!r}; train one "
                         "(docs/post-training.md) or fix the path")
      try:
        from train.rundir import reward as reward_lib  # pylint: disable=g-import-not-at-top
        self._batch = reward_lib.load_scorer(target)
      except (ImportError, ValueError, FileNotFoundError, ckpt_lib.CheckpointError) as e:
        raise SetupError(f"rl.reward={spec!r}: cannot load a reward model from {target}: {e}") from None
    else:
      raise SetupError(f"rl.reward={spec!r} must be py:MODULE:FUNCTION or rm:RUN_DIRECTORY")

  def _fail(self, what: str) -> float:
    self.failures.append(what)
    return math.nan

  def __call__(self, prompts: Sequence[str], completions: Sequence[str], texts: Sequence[str]) -> np.ndarray:
    return self.scored(prompts, completions, texts)[0]

  def scored(self, prompts: Sequence[str], completions: Sequence[str],
             texts: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(rewards [N] float64, NaN where a reward failed; the named parts {name: [N]} of a py: function returning a
    dict, else {}). Safe to call from the asynchronous rollout thread and the learner at once."""
    parts: dict[str, np.ndarray] = {}
    if self._batch is not None:
      try:
        out = np.asarray(self._batch(list(texts)), np.float64).reshape(-1)
        if out.shape[0] != len(texts):
          raise ValueError(f"the scorer returned {out.shape[0]} rewards for {len(texts)} texts")
      except Exception as e:  # pylint: disable=broad-except  (a bad scorer call drops the batch, counted)
        return np.array([self._fail(f"{type(e).__name__}: {e}") for _ in texts]), parts
      for i in np.flatnonzero(~np.isfinite(out)):
        out[i] = self._fail(f"the reward model's score {out[i]} for text {texts[i]!r} is not finite")
    else:
      out = np.empty(len(prompts))
      for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        try:
          out[i] = add_parts(parts, self._pair(prompt, completion), i, len(prompts))
        except Exception as e:  # pylint: disable=broad-except  (user code: any error drops this sample)
          out[i] = self._fail(f"{type(e).__name__}: {e}")
          continue
        if not math.isfinite(out[i]):
          out[i] = self._fail(f"the reward {out[i]} for completion {completion!r} is not finite")
    return out, parts
