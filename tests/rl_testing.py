"""Reward functions for the RL tests (`rl.reward=py:rl_testing:NAME`; tests/ is on sys.path)."""
import math

CALLS = {"flaky": 0, "bad": 0}


def length(prompt: str, completion: str) -> float:
  """A dense reward any policy can move: the completion's length in characters / 10."""
  del prompt
  return len(completion) / 10


def flaky(prompt: str, completion: str) -> float:
  """Call i raises when i % 5 == 0, returns NaN when i % 5 == 1, else `length`; CALLS counts both."""
  i = CALLS["flaky"]
  CALLS["flaky"] += 1
  if i % 5 in (0, 1):
    CALLS["bad"] += 1
  if i % 5 == 0:
    raise RuntimeError("reward service unavailable")
  return math.nan if i % 5 == 1 else length(prompt, completion)


class EchoEnv:
  """A two-turn environment (rl.env=py:rl_testing:EchoEnv): the first turn gets OBSERVATION back, the second
  ends the episode with reward 1 + its length / 10 (parts "done" and "length")."""
  OBSERVATION = "ok"

  def reset(self, prompt: str) -> str:
    self.turns = 0
    return prompt

  def step(self, text: str):
    self.turns += 1
    if self.turns == 1:
      return self.OBSERVATION, 0.0, False
    return None, {"done": 1.0, "length": len(text) / 10}, True
