"""Built-in verifiable tasks for reinforcement learning (`rl.prompts=builtin:tasks` or one family) and their
cold-start conversations (the chat source `builtin:tasks`), answered in a tagged format.

Families (the answer goes between <answer> and </answer>; item i belongs to family i % 4):
  arithmetic      "Compute 47 + 85." -> "<answer>132</answer>"   (two 2-digit numbers; + or -, never negative)
  number_sorting  "Sort the numbers: 42 7 19" -> "<answer>7 19 42</answer>"   (3-4 numbers below 100)
  countdown       "Reach 25 with 3 4 7 using + - *." -> "<answer>3*7+4</answer>", or any expression that uses
                  each given number exactly once with + - * and parentheses and evaluates to the target
  calculator      "Calculate 347 + 585." -> "<answer>932</answer>"   (3-digit numbers, + or -), the task of the
                  tool environment (train/rl/env.py): the model may first write "<tool>347+585</tool>" and gets
                  "<result>932</result>" back as the next user turn; half the cold-start conversations use the
                  tool, half answer at once
The prompt alone decides the answer, so no constant or prompt-independent completion scores above chance.

`reward(prompt, completion)` returns its parts, kept apart as TRL keeps one reward function per criterion:
  correct  1.0 when the text inside the first <answer>...</answer> is right for the prompt, else 0.0
  format   0.0 when the whole completion is one <answer>...</answer> and nothing else, else -FORMAT_PENALTY
train.rl sums them and logs each (reward_correct_mean, reward_format_mean). The held-out split is chosen by a
hash of the prompt text with EVAL_FRACTION, the same for the RL prompts and the chat source, so a held-out
prompt is never trained on by either.
"""
from __future__ import annotations

import ast
import re
from collections import Counter

import numpy as np

from data import instruct

FAMILIES = ("arithmetic", "number_sorting", "countdown", "calculator")
EVAL_FRACTION = 0.05
SIZE = 30_000
FORMAT_PENALTY = 0.5
_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.S)
TOOL_CALL = re.compile(r"\s*<tool>([^<>]*)</tool>\s*")
_WHOLE = re.compile(r"\s*<answer>[^<>]*</answer>\s*")
_ARITHMETIC = re.compile(r"^(?:Compute|Calculate) (\d+) ([+-]) (\d+)\.$")
_SORTING = re.compile(r"^Sort the numbers: ([\d ]+)$")
_COUNTDOWN = re.compile(r"^Reach (-?\d+) with ([\d ]+) using \+ - \*\.$")


def item(seed: int, index: int) -> dict:
  """Record `index` of the tasks: {"family", "messages": [user, assistant]} with the reference answer tagged."""
  rng = np.random.default_rng([seed, index, 7])
  family = FAMILIES[index % len(FAMILIES)]
  if family == "arithmetic":
    a, op, b = _sum_or_difference(rng, 10, 100)
    prompt, answer = f"Compute {a} {op} {b}.", str(_apply(a, op, b))
  elif family == "number_sorting":
    numbers = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(3, 5)))]
    prompt, answer = f"Sort the numbers: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))
  elif family == "calculator":
    a, op, b = _sum_or_difference(rng, 100, 1000)
    prompt, answer = f"Calculate {a} {op} {b}.", str(_apply(a, op, b))
    if (index // len(FAMILIES)) % 2 == 0:  # the tool's way: call, read the result, answer
      return {"family": family, "messages": [
          {"role": "user", "content": prompt}, {"role": "assistant", "content": f"<tool>{a}{op}{b}</tool>"},
          {"role": "user", "content": tool_result(f"{a}{op}{b}")},
          {"role": "assistant", "content": f"<answer>{answer}</answer>"}]}
  else:
    a, b, c = (int(x) for x in rng.integers(1, 10, size=3))
    op1, op2 = ("+-*"[int(k)] for k in rng.integers(0, 3, size=2))
    answer = f"{a}{op1}{b}{op2}{c}"
    prompt = f"Reach {_evaluate(answer)} with {' '.join(map(str, sorted((a, b, c))))} using + - *."
  return {"family": family, "messages": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": f"<answer>{answer}</answer>"}]}


def _sum_or_difference(rng, lo: int, hi: int) -> tuple[int, str, int]:
  """(a, "+" or "-", b) with a >= b drawn from [lo, hi), so the result is never negative."""
  a, b = sorted((int(x) for x in rng.integers(lo, hi, size=2)), reverse=True)
  return a, "+-"[int(rng.integers(0, 2))], b


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b


def prompts(family: str | None, seed: int = 0) -> list[str]:
  """The prompts of one family (None: every family) among the SIZE generated items, in index order."""
  if family is not None and family not in FAMILIES:
    raise ValueError(f"unknown task family {family!r}; use one of {', '.join(FAMILIES)}")
  return [item(seed, i)["messages"][0]["content"] for i in range(SIZE)
          if family is None or FAMILIES[i % len(FAMILIES)] == family]


def tool_result(expression: str) -> str:
  """The calculator tool's reply to `expression`: "<result>VALUE</result>", or "<result>error</result>" for
  anything but integers, + - * and parentheses (at most 40 characters)."""
  try:
    if len(expression) > 40:
      raise ValueError("too long")
    return f"<result>{_evaluate(expression)}</result>"
  except ValueError:
    return "<result>error</result>"


def _evaluate(expression: str) -> int:
  """The value of an expression of integers, + - * and parentheses (ValueError for anything else)."""
  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
      left, right = value(node.left), value(node.right)
      return left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
          else left * right
    raise ValueError(f"not an expression of integers and + - *: {expression!r}")
  try:
    return value(ast.parse(expression.strip(), mode="eval").body)
  except (SyntaxError, RecursionError) as e:
    raise ValueError(f"cannot parse {expression!r}: {e}") from None


def _numbers_used(expression: str) -> Counter:
  return Counter(int(n.value) for n in ast.walk(ast.parse(expression.strip(), mode="eval"))
                 if isinstance(n, ast.Constant))


def correct(prompt: str, answer: str) -> bool:
  """Whether `answer` (the text inside the tags) is right for `prompt` (ValueError for a prompt of no family)."""
  answer = answer.strip()
  if m := _ARITHMETIC.match(prompt):
    return answer == str(_apply(int(m.group(1)), m.group(2), int(m.group(3))))
  if m := _SORTING.match(prompt):
    return answer.split() == [str(n) for n in sorted(int(x) for x in m.group(1).split())]
  if m := _COUNTDOWN.match(prompt):
    if len(answer) > 40:  # a longer expression cannot use three one-digit numbers once each
      return False
    try:
      return (_evaluate(answer) == int(m.group(1))  # parses it first: ValueError for anything but + - * of ints
              and _numbers_used(answer) == Counter(int(x) for x in m.group(2).split()))
    except ValueError:
      return False
  raise ValueError(f"prompt {prompt!r} is not a built-in task prompt (families: {', '.join(FAMILIES)})")


def reward(prompt: str, completion: str) -> dict[str, float]:
  """{"correct", "format"} of a completion (module docstring); train.rl's rl.reward=py:data.tasks:reward."""
  tagged = _TAGGED.search(completion)
  return {"correct": float(tagged is not None and correct(prompt, tagged.group(1))),
          "format": 0.0 if _WHOLE.fullmatch(completion) else -FORMAT_PENALTY}


class TaskSource(instruct.InstructTask):
  """The chat source `builtin:tasks`: the tasks' conversations with tagged answers (cold start for RL), split by
  prompt hash with EVAL_FRACTION, so the RL held-out prompts are held out here too. With `family` (the source
  `builtin:arithmetic` and so on) only that family's SIZE / 4 items: record i is item FAMILIES.index(family) + 4 i,
  the same conversation `builtin:tasks` and `rl.prompts=builtin:<family>` hold."""

  def __init__(self, name: str = "tasks", seed: int = 0, family: str | None = None):
    if family is not None and family not in FAMILIES:
      raise ValueError(f"unknown task family {family!r}; use one of {', '.join(FAMILIES)}")
    self.offset, self.stride = (0, 1) if family is None else (FAMILIES.index(family), len(FAMILIES))
    super().__init__(name, seed, SIZE // self.stride, EVAL_FRACTION)

  def record(self, index: int) -> dict:
    return item(self.seed, self.offset + self.stride * index)
