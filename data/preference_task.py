"""The built-in synthetic preference task (`builtin:preference`): instruct prompts (data/instruct.py) with their
correct answer chosen and a programmatically wrong one rejected. Its own module so that data/sources.py can open
it without importing the chat machinery of data/preference.py (which reads sources)."""
from __future__ import annotations

import json

import numpy as np

from data import instruct


def wrong_answer(family: str, answer: str, rng: np.random.Generator) -> str:
  """A wrong answer to an instruct item (data/instruct.py), different from `answer` by construction:
  addition with the carry into the hundreds slipped (dropped: 132 -> 32, or added: 87 -> 187), reversal in the
  original order (or a rotation), sorting descending or shuffled, conversion by the wrong power of ten.

  The addition slip is one a reader spots from the size of the operands (a + b >= 100 or not) without the exact
  digits: the tiny SFT model cannot add exactly (14% of its held-out sums are right; given the correct leading
  digits it predicts the last one in 22% of cases), and with slips in the last digits (sums off by 1-20) neither
  the reward model nor DPO built on it got past chance on those pairs."""
  if family == "addition":
    total = int(answer)
    return str(total - 100 if total >= 100 else total + 100)
  if family == "conversion":
    return answer[:-1] if answer.endswith("0") else answer + "0"
  parts = answer.split(" ")
  if family == "sorting":
    candidates = [" ".join(sorted(parts, reverse=True)), " ".join(rng.permutation(parts))]
  else:  # reversal: the letters as given, or rotated
    candidates = [" ".join(reversed(parts)), " ".join(parts[1:] + parts[:1])]
  wrong = [c for c in candidates if c != answer]
  if wrong:
    return wrong[int(rng.integers(0, len(wrong)))]
  return answer + " " + parts[0]  # all letters / digits equal: an extra one is still wrong


def pair(seed: int, index: int) -> dict:
  """Pair `index` of the built-in task: the prompt of instruct item `index`, its correct answer chosen and a wrong
  one (`wrong_answer`) rejected; {"family", "prompt", "chosen", "rejected"}."""
  record = instruct.item(seed, index)
  prompt, answer = record["messages"][0]["content"], record["messages"][1]["content"]
  rng = np.random.default_rng([seed, index, 1])
  return {"family": record["family"], "prompt": prompt, "chosen": answer,
          "rejected": wrong_answer(record["family"], answer, rng)}


class PreferenceTask(instruct.InstructTask):
  """`builtin:preference`: `size` generated pairs (JSON text) with the instruct task's prompt-hash split, so no
  held-out prompt of either task is trained on by the other."""

  def __init__(self, name: str = "preference", seed: int = 0, size: int = 40_000, eval_fraction: float = 0.02):
    super().__init__(name, seed, size, eval_fraction)

  def __getitem__(self, index: int) -> str:
    return json.dumps(pair(self.seed, int(index)))
