"""The built-in instruction task (`builtin:instruct`): short verifiable conversations generated from a seed.

Families (each answer is checkable by exact match):
  addition    "What is 47 + 85?" -> "132"                        (two 2-digit numbers)
  reversal    "Reverse the letters: k q a m" -> "m a q k"        (3-5 lowercase letters)
  sorting     "Sort the digits: 7 2 9 4" -> "2 4 7 9"             (3-5 digits)
  conversion  "Convert 7 km to m." -> "7000"                     (km->m, kg->g, L->mL, m->cm, cm->mm)
Item i belongs to family i % 4 and is drawn from a generator seeded by (seed, i), so the task is the same on
every machine. The held-out split is chosen by a hash of the prompt text, so a held-out prompt never occurs in
the training split, even when the generator repeats it.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

FAMILIES = ("addition", "reversal", "sorting", "conversion")
_UNITS = (("km", "m", 1000), ("kg", "g", 1000), ("L", "mL", 1000), ("m", "cm", 100), ("cm", "mm", 10))
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def item(seed: int, index: int) -> dict:
  """Record `index` of the task: {"family", "messages": [user, assistant]}."""
  rng = np.random.default_rng([seed, index])
  family = FAMILIES[index % len(FAMILIES)]
  if family == "addition":
    a, b = (int(x) for x in rng.integers(10, 100, size=2))
    prompt, answer = f"What is {a} + {b}?", str(a + b)
  elif family == "reversal":
    letters = [_LETTERS[int(i)] for i in rng.integers(0, 26, size=int(rng.integers(3, 6)))]
    prompt, answer = f"Reverse the letters: {' '.join(letters)}", " ".join(reversed(letters))
  elif family == "sorting":
    digits = [int(d) for d in rng.integers(0, 10, size=int(rng.integers(3, 6)))]
    prompt, answer = f"Sort the digits: {' '.join(map(str, digits))}", " ".join(map(str, sorted(digits)))
  else:
    src, dst, factor = _UNITS[int(rng.integers(0, len(_UNITS)))]
    n = int(rng.integers(1, 1000))
    prompt, answer = f"Convert {n} {src} to {dst}.", str(n * factor)
  return {"family": family, "messages": [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": answer}]}


def held_out(prompt: str, eval_fraction: float) -> bool:
  """Whether a prompt belongs to the held-out split (a stable hash of its text, independent of the index)."""
  h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
  return (h % 1_000_000) < eval_fraction * 1_000_000


class InstructTask:
  """A chat source of `size` generated records (JSON text), with its own prompt-hash train/eval split."""

  def __init__(self, name: str = "instruct", seed: int = 0, size: int = 40_000, eval_fraction: float = 0.02):
    self.name, self.seed, self.size, self.eval_fraction = name, seed, size, eval_fraction
    self._splits: dict[str, np.ndarray] | None = None

  def __len__(self) -> int:
    return self.size

  def record(self, index: int) -> dict:
    """Record `index` as a dict (`item`); subclasses generate other tasks (data/tasks.py)."""
    return item(self.seed, index)

  def __getitem__(self, index: int) -> str:
    return json.dumps(self.record(int(index)))

  def split_indices(self, split: str) -> np.ndarray:
    """Sorted indices of `split` ("train" | "eval")."""
    if split not in ("train", "eval"):
      raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if self._splits is None:
      flags = np.array([held_out(self.record(i)["messages"][0]["content"], self.eval_fraction)
                        for i in range(self.size)])
      self._splits = {"eval": np.flatnonzero(flags), "train": np.flatnonzero(~flags)}
    return self._splits[split]

  def __getstate__(self):
    return dict(self.__dict__, _splits=None)
