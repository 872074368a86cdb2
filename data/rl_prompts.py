"""Prompts for reinforcement learning (`rl.prompts`) and the built-in verifiable task with its reward.

`rl.prompts` is either
  PATH             a JSONL file (.gz read too), one prompt per line: {"prompt": "text"} or {"messages": [...]}
                   (a conversation ending with a user turn); other fields are ignored
  builtin:tasks    the built-in verifiable tasks (data/tasks.py: arithmetic, number sorting, countdown, calculator;
                   answers tagged <answer>...</answer>, rewarded by py:data.tasks:reward); builtin:arithmetic,
                   builtin:number_sorting, builtin:countdown, builtin:calculator: one family
  builtin:greater  "Write a number greater than N." for N in [1000, 99999], answered right when the reply is a
                   whole number > N written without leading zeros (`greater_reward`; a constant 6-digit answer
                   always wins; the tasks above have no such answer)
Held-out prompts are chosen by a hash of the prompt text (data.instruct.held_out), so a held-out prompt never
occurs in training; the built-in tasks' split is data.tasks.EVAL_FRACTION, shared with the chat source
builtin:tasks, so no held-out prompt was trained on in a cold-start SFT run either.
"""
from __future__ import annotations

import re

import numpy as np

from data import chat as chat_lib
from data import files
from data import instruct

GREATER_SIZE = 20_000
_GREATER = re.compile(r"greater than (\d+)")
_NUMBER = re.compile(r"[1-9][0-9]{0,11}")  # a whole number as written: no sign, no leading zero


def greater_prompt(seed: int, index: int) -> str:
  """Prompt `index` of the built-in task (N drawn from a generator seeded by (seed, index))."""
  n = int(np.random.default_rng([seed, index]).integers(1000, 100_000))
  return f"Write a number greater than {n}."


def greater_reward(prompt: str, completion: str) -> float:
  """1.0 when `completion` (stripped) is a whole number without leading zeros greater than the prompt's N,
  else 0.0."""
  match = _GREATER.search(prompt)
  if match is None:
    raise ValueError(f"prompt {prompt!r} is not a builtin:greater prompt ('... greater than N')")
  answer = completion.strip()
  return float(_NUMBER.fullmatch(answer) is not None and int(answer) > int(match.group(1)))


def _messages(record, where: str) -> list[dict[str, str]]:
  if isinstance(record, dict) and isinstance(record.get("prompt"), str):
    return [{"role": "user", "content": record["prompt"]}]
  messages = record.get("messages") if isinstance(record, dict) else None
  if (isinstance(messages, list) and messages and all(
      isinstance(m, dict) and m.get("role") in chat_lib.ROLES and isinstance(m.get("content"), str) for m in messages)
      and messages[-1]["role"] == "user"):
    return [{"role": m["role"], "content": m["content"]} for m in messages]
  raise ValueError(f"{where}: a prompt line must be {{\"prompt\": \"text\"}} or {{\"messages\": [...]}} ending with "
                   "a user turn")


def load(spec: str, eval_fraction: float, seed: int = 0) -> dict[str, list[list[dict[str, str]]]]:
  """{"train": [...], "eval": [...]}: prompts as message lists, split by prompt-text hash (module docstring).

  Raises ValueError naming the file and line for a missing file, a bad line or an empty split.
  """
  from data import tasks  # pylint: disable=g-import-not-at-top
  builtin_tasks = {"builtin:tasks": None, **{f"builtin:{f}": f for f in tasks.FAMILIES}}
  if spec == "builtin:greater":
    texts = [greater_prompt(seed, i) for i in range(GREATER_SIZE)]
    conversations = [[{"role": "user", "content": t}] for t in texts]
  elif spec in builtin_tasks:
    if eval_fraction != tasks.EVAL_FRACTION:
      raise ValueError(f"rl.eval_fraction={eval_fraction} with rl.prompts={spec}: the built-in tasks hold out "
                       f"{tasks.EVAL_FRACTION} of their prompts, shared with the chat source builtin:tasks so no "
                       f"held-out prompt is trained on; set rl.eval_fraction={tasks.EVAL_FRACTION} or give a file")
    texts = list(dict.fromkeys(tasks.prompts(builtin_tasks[spec], seed)))  # each distinct prompt once
    conversations = [[{"role": "user", "content": t}] for t in texts]
  elif spec.startswith("builtin:"):
    raise ValueError(f"rl.prompts={spec!r}: the built-in prompt sets are {', '.join(builtin_tasks)} and "
                     "builtin:greater")
  else:
    try:
      text = files.decode_utf8(files.read_bytes(spec), spec)
    except FileNotFoundError:
      raise ValueError(f"rl.prompts={spec!r}: no such file; give a JSONL file of prompts or builtin:greater") from None
    conversations = []
    for i, line in enumerate(text.splitlines()):
      if not line.strip():
        continue
      record, problem = files.parse_json(line, f"{spec} line {i + 1}")
      if problem:
        raise ValueError(problem)
      conversations.append(_messages(record, f"{spec} line {i + 1}"))
  split = {"train": [], "eval": []}
  for conversation in conversations:
    held = instruct.held_out(conversation[-1]["content"], eval_fraction)
    split["eval" if held else "train"].append(conversation)
  for name, items in split.items():
    if not items:
      raise ValueError(f"rl.prompts={spec!r} gives no {name} prompts ({len(conversations)} in all, "
                       f"rl.eval_fraction={eval_fraction}); add prompts or change rl.eval_fraction")
  return split
