"""Multi-turn environments of `python -m train.rl` (rl.env): episodes in which the policy's turns alternate with
the environment's, the return credited to the policy's tokens only.

An environment is an object with
  reset(prompt: str) -> str                         the first user turn's text for the episode's prompt
  step(text: str) -> (observation | None, reward, done)
                                                    the policy's turn (stop tokens removed) in; the next user turn's
                                                    text (None when done), this step's reward (a float or a dict of
                                                    named parts, as rl.reward's functions) and whether it ended
rl.env is `builtin:calculator` (`Calculator`) or `py:MODULE:CLASS`, a class called with no arguments, one
instance per episode. The episode's return is the sum of its steps' rewards; an episode still running after
rl.max_turns policy turns, or whose next turn would not fit train.seq_len + 1 tokens, or whose policy turn was cut
at rl.max_new_tokens, ends there with the rewards it has. Observations enter the transcript as user turns of the
run's chat template; their tokens (and the template's tokens around them) carry no loss (train/rl/rollouts.py).
"""
from __future__ import annotations

import importlib
from typing import Callable

from data import tasks


class Calculator:
  """The built-in tool environment for data.tasks' prompts: a turn that is exactly `<tool>EXPRESSION</tool>` is
  answered with `<result>VALUE</result>` (data.tasks.tool_result: integers, + - * and parentheses); any other turn
  ends the episode and is scored by data.tasks.reward ({"correct", "format"}). `tools=False` makes a tool call
  end the episode like any other answer (scored 0 correct and the format penalty): the task without the tool."""

  def __init__(self, tools: bool = True):
    self.tools, self.prompt = tools, None

  def reset(self, prompt: str) -> str:
    self.prompt = prompt
    return prompt

  def step(self, text: str):
    call = tasks.TOOL_CALL.fullmatch(text)
    if call is not None and self.tools:
      return tasks.tool_result(call.group(1)), 0.0, False
    return None, tasks.reward(self.prompt, text), True


def factory(spec: str) -> Callable[[], object]:
  """A function making one environment per episode for rl.env (module docstring); ValueError naming the problem."""
  if spec == "builtin:calculator":
    return Calculator
  if spec == "builtin:calculator_no_tool":
    return lambda: Calculator(tools=False)
  kind, _, target = spec.partition(":")
  module, _, name = target.rpartition(":")
  if kind != "py" or not module or not name:
    raise ValueError(f"rl.env={spec!r} must be builtin:calculator, builtin:calculator_no_tool or py:MODULE:CLASS")
  try:
    cls = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"rl.env={spec!r}: cannot load {name} from module {module} ({e})") from None
  if not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
    raise ValueError(f"rl.env={spec!r}: {module}.{name} has no reset(prompt) and step(text) methods")
  return cls
