"""Preference pairs: records and rendering with the chat template (the built-in synthetic preference task is in
data/preference_task.py, re-exported here).

Records (JSONL, one per line; source kind `preference:PATH` or the built-in `builtin:preference`):
  {"prompt": "..." | [messages], "chosen": "..." | [messages], "rejected": "..." | [messages], "margin": 0.5}
A string prompt is one user turn and a string completion one assistant turn; message lists are rendered as they
are (data/chat.py). `margin` (optional, default 0) is how much more the chosen completion is preferred (the
reward-model loss asks r_chosen - r_rejected to exceed it).

Encoding: each pair becomes one batch row per side, unpacked (one sequence per row, so a pair stays whole on one
data shard): `chosen_inputs` (the whole rendered sequence t_0..t_{n-1}, its last token included so that a reward
model reads its features there), `chosen_targets` (t_1..t_{n-1}, then padding), `chosen_segment_ids` (1 on the
n tokens, 0 on padding), `chosen_positions`, `chosen_loss_mask` (1 where the target is a completion token: the
assistant turns after the prompt including their end-of-turn markers; 0 on the prompt, the last input and
padding), the same `rejected_*`, and `margin` (the pair's margin repeated along the row, so every batch array
is [rows, seq_len]).

Bad pairs are counted per reason in `data/preference_skipped_<reason>` and skipped with one warning per reason (or
raise with config.data.strict): a missing or ill-typed field (`missing_field`), identical chosen and rejected
completions (`identical`: they carry no preference), an empty completion (`empty_completion`), a pair longer than
seq_len tokens (`too_long`: truncating would cut the very tokens that differ), and the chat reasons.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from data import chat as chat_lib
from data import files
from data import sources as sources_lib
# The built-in synthetic task (builtin:preference), kept importable from here.
from data.preference_task import PreferenceTask, pair, wrong_answer  # noqa: F401  pylint: disable=unused-import

SIDES = ("chosen", "rejected")
TOKEN_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
BATCH_KEYS = tuple(f"{side}_{k}" for side in SIDES for k in TOKEN_KEYS) + ("margin",)


def _messages(value, role_of_string: str, field: str) -> list[dict[str, str]]:
  if isinstance(value, str):
    return [{"role": role_of_string, "content": value}]
  if isinstance(value, list) and value:
    return list(value)
  raise chat_lib.ChatError("missing_field", f"the pair's {field!r} must be a string or a non-empty list of "
                           f"messages, got {type(value).__name__}")


def parse_pair(record: Any) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]], float]:
  """A preference record -> (prompt messages, chosen messages, rejected messages, margin); ChatError if unusable."""
  if not isinstance(record, dict):
    raise chat_lib.ChatError("missing_field", f"a preference record must be a JSON object, got "
                             f"{type(record).__name__}")
  missing = [k for k in ("prompt", *SIDES) if k not in record]
  if missing:
    raise chat_lib.ChatError("missing_field", f"the preference record lacks {missing} (it has {sorted(record)}); "
                             "each line needs 'prompt', 'chosen' and 'rejected'")
  margin = record.get("margin", 0.0)
  if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
    raise chat_lib.ChatError("missing_field", f"the pair's 'margin' must be a finite number, got {margin!r}")
  prompt = _messages(record["prompt"], "user", "prompt")
  chosen, rejected = (_messages(record[k], "assistant", k) for k in SIDES)
  # parse_record checks roles and message shapes; the prompt is the first len(prompt) messages of each side.
  chosen, rejected = (chat_lib.parse_record({"messages": prompt + c})[len(prompt):] for c in (chosen, rejected))
  for side, msgs in zip(SIDES, (chosen, rejected)):
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
      raise chat_lib.ChatError("empty_completion", f"the {side!r} completion has no non-empty assistant turn: "
                               "nothing to compare")
  if chosen == rejected:
    raise chat_lib.ChatError("identical", "'chosen' and 'rejected' are identical: the pair states no preference")
  return chat_lib.parse_record({"messages": prompt + chosen})[:len(prompt)], chosen, rejected, float(margin)


@dataclasses.dataclass
class PairEncoder:
  """Record text -> the pair's row arrays (module docstring), each [seq_len]; or None for a skipped pair."""
  template: Any
  seq_len: int
  pad_id: int
  strict: bool = False

  def __call__(self, text: str, where: str = "preference record") -> dict[str, np.ndarray] | None:
    try:
      prompt, chosen, rejected, margin = parse_pair(json.loads(text))
      sides = [self.render(prompt, completion) for completion in (chosen, rejected)]
    except json.JSONDecodeError as e:
      return self._skip("unparseable", f"{where}: unparseable JSON ({e})")
    except chat_lib.ChatError as e:
      return self._skip(e.reason, f"{where}: {e}")
    longest = max(len(ids) for ids, _ in sides)
    if longest > self.seq_len:
      return self._skip("too_long", f"{where}: the pair needs {longest} tokens, more than config.train.seq_len="
                        f"{self.seq_len}; raise seq_len or shorten the record")
    out = {}
    for side, (ids, mask) in zip(SIDES, sides):
      n = len(ids)  # every token is an input (the reward reads the last one); the last has no target
      row = {"inputs": np.full(self.seq_len, self.pad_id, np.int32), "targets": np.full(self.seq_len, self.pad_id,
                                                                                        np.int32),
             "segment_ids": np.zeros(self.seq_len, np.int32), "positions": np.zeros(self.seq_len, np.int32),
             "loss_mask": np.zeros(self.seq_len, np.float32)}
      row["inputs"][:n], row["targets"][:n - 1] = ids, ids[1:]
      row["segment_ids"][:n], row["positions"][:n], row["loss_mask"][:n - 1] = 1, np.arange(n), mask[1:]
      out.update({f"{side}_{k}": v for k, v in row.items()})
    out["margin"] = np.full(self.seq_len, margin, np.float32)
    return out

  def render(self, prompt, completion) -> tuple[list[int], np.ndarray]:
    """(token ids of prompt + completion, completion flags per token): the completion's assistant tokens."""
    ids, flags = self.template.render(prompt + completion)
    prefix = self.template.prompt(prompt)
    if ids[:len(prefix)] != prefix:
      raise chat_lib.ChatError("template_not_prefix", "the chat template does not render the prompt with its "
                               "generation prompt as a prefix of prompt + completion; the completion is unknown")
    flags = np.asarray(flags, np.float32)
    flags[:len(prefix)] = 0.0
    return ids, flags

  def _skip(self, reason: str, message: str):
    if self.strict:
      raise ValueError(message + "; fix the record or set config.data.strict=False to skip such pairs")
    files.COUNTERS[f"preference_skipped_{reason}"] += 1
    files.warn_once(f"preference:{reason}", message + " -- skipped (counted in data/preference_skipped_" + reason
                    + ")")
    return None


is_preference_source = sources_lib.is_preference_source  # whether a parsed mixture item holds preference pairs


def _pair_messages(record: Any) -> list[dict[str, str]]:
  prompt, chosen, _, _ = parse_pair(record)
  return prompt + chosen


def eval_items(data_config, per_family: int, plan=None) -> list[chat_lib.EvalItem]:
  """`data.chat.eval_items` over the chat and the preference sources: a held-out pair's reference is its chosen
  completion's last assistant turn (for the built-in task the correct answer), its context the prompt and the
  chosen turns before it."""
  parsers = ((chat_lib.is_chat_source, chat_lib.parse_record), (sources_lib.is_preference_source, _pair_messages))
  return chat_lib.eval_items(data_config, per_family=per_family, plan=plan, parsers=parsers)
