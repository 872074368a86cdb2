"""Scoring texts with a trained reward model (`train.objective=reward` run): API and command line.

    python -m train.reward --workdir RUN [--step N] --input FILE [--output FILE] [--batch_size 32]

Each text is one of:
  - a JSON chat record (`{"messages": [...]}` or `{"prompt": ..., "completion": ...}`, data/chat.py), rendered with
    the run's chat template exactly as the reward model was trained on pairs (prompt turns, then the completion);
  - any other string: plain text, scored as [BOS] + its tokens.
A sequence longer than model.max_seq_len keeps its last max_seq_len tokens (the reward is read at the last one).
The reward is the head's scalar at the last token (train/objectives/reward.py), in the units the Bradley-Terry
loss gives it: r_a - r_b is the log-odds that text a is preferred to text b.

FILE holds one text per line: a JSON object line is a chat record, `{"text": "..."}` plain text; empty lines are
skipped. The output (stdout by default) is one JSON line `{"reward": r}` per input line, in order. Exit codes: 0
done, 2 bad arguments, an unusable run (not a reward run, no checkpoint) or an unreadable input line (named).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Sequence

import numpy as np

_BUCKET = 16  # sequence lengths are padded to a multiple of this (bounds the number of compiled shapes)


class ScoreError(ValueError):
  """A run directory or input that cannot be scored; the message names it and the fix."""


def _encode(text: str, tokenizer, template) -> list[int]:
  """Token ids of one text (module docstring)."""
  from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  record = None
  if text.lstrip().startswith("{"):
    try:
      record = json.loads(text)
    except json.JSONDecodeError:
      record = None
  if isinstance(record, dict) and ("messages" in record or "prompt" in record):
    return template.render(chat_lib.parse_record(record))[0]
  return tokenizer_lib.prompt_ids(tokenizer, tokenizer.encode(text))


def load_scorer(workdir: str, step: int | None = None, batch_size: int = 32) -> Callable[[list[str]], list[float]]:
  """Loads the reward run `workdir` (checkpoint `step`, default the latest) once; returns `score(texts) -> rewards`
  (one float per text, module docstring), which batches `batch_size` texts per forward pass."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  import parallel  # pylint: disable=g-import-not-at-top
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  from parallel import rules as rules_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import chat as chat_run  # pylint: disable=g-import-not-at-top
  from train.core import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  from train.objectives import reward as reward_objective  # pylint: disable=g-import-not-at-top

  try:
    run = restore.load_run(workdir, step)
  except restore.RunError as e:
    raise ScoreError(str(e)) from None
  if run.config.train.get("objective") != reward_objective.RewardModel.name:
    raise ScoreError(f"{workdir} was trained with train.objective={run.config.train.get('objective')!r}, not "
                     "'reward': it has no reward head; give a reward-model run (python -m train --config=reward_tiny)")
  directory, _ = ckpt_lib.find_checkpoint_dir(workdir)
  head = jax.ShapeDtypeStruct((run.config.model.d_model,), jnp.float32,
                              sharding=NamedSharding(run.mesh, PartitionSpec()))
  checkpointer = ckpt_lib.Checkpointer(directory, read_only=True)
  try:
    head_D = checkpointer.restore_subtree({"params": {reward_objective.HEAD: head}}, run.step)["params"]
  finally:
    checkpointer.close()
  head_D = head_D[reward_objective.HEAD]
  tokenizer = tokenizer_lib.load(run.tokenizer_path)
  template = chat_run.template_for_run(run.config, tokenizer, run.chat_template)
  graphdef, params = nnx.split(run.model)
  max_len = int(run.config.model.max_seq_len)
  shards = rules_lib.axis_size(run.mesh, dict(run.rules)["batch"])
  rows = -(-batch_size // shards) * shards  # a multiple of the batch shards

  @jax.jit
  def rewards(params, head_D, tokens_BL, segment_ids_BL):
    with parallel.activate(run.mesh, run.rules, inside_jit=True):
      return reward_objective.sequence_rewards(nnx.merge(graphdef, params), head_D, tokens_BL, segment_ids_BL)[0]

  def score(texts: list[str]) -> list[float]:
    if isinstance(texts, str):
      raise TypeError("score() takes a list of texts, not one string")
    out: list[float] = []
    for start in range(0, len(texts), rows):
      chunk = [_encode(t, tokenizer, template)[-max_len:] for t in texts[start:start + rows]]
      length = min(max_len, -(-max(len(ids) for ids in chunk) // _BUCKET) * _BUCKET)
      tokens = np.full((rows, length), tokenizer.pad_id, np.int32)
      segments = np.zeros((rows, length), np.int32)
      segments[len(chunk):, 0] = 1  # filler rows: one token, scores dropped
      for i, ids in enumerate(chunk):
        tokens[i, :len(ids)], segments[i, :len(ids)] = ids, 1
      with parallel.activate(run.mesh, run.rules):
        r_B = rewards(params, head_D, jnp.asarray(tokens), jnp.asarray(segments))
      out.extend(float(r) for r in np.asarray(jax.device_get(r_B))[:len(chunk)])
    return out

  return score


def score(workdir: str, texts: list[str], step: int | None = None) -> list[float]:
  """Rewards of `texts` (module docstring) under the reward run `workdir` at checkpoint `step` (default latest)."""
  return load_scorer(workdir, step)(list(texts))


def read_input(path: str) -> list[str]:
  """The texts of an input file (module docstring); ScoreError naming the line for an unusable one."""
  from data import files  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise ScoreError(f"--input {path!r} is not a file; give a file with one text (JSON line) per line")
  texts = []
  for number, line in enumerate(files.decode_utf8(files.read_bytes(path), path).splitlines(), 1):
    if not line.strip():
      continue
    record, error = files.parse_json(line, f"{path}:{number}")
    if error or not isinstance(record, dict):
      raise ScoreError(error or f"{path}:{number}: a line must be a JSON object (a chat record or {{\"text\": ...}})")
    if "text" in record:
      if not isinstance(record["text"], str):
        raise ScoreError(f"{path}:{number}: 'text' must be a string")
      texts.append(record["text"])
    elif "messages" in record or ("prompt" in record and "completion" in record):
      texts.append(json.dumps(record))
    else:
      raise ScoreError(f"{path}:{number}: the line has neither 'text' nor a chat record ('messages' or 'prompt' + "
                       f"'completion'); it has {sorted(record)}")
  return texts


def main(argv: Sequence[str] | None = None) -> int:
  from train.__main__ import _default_platform  # pylint: disable=g-import-not-at-top
  _default_platform()  # before the first JAX import
  p = argparse.ArgumentParser(prog="python -m train.reward", description=__doc__.split("\n")[0],
                              epilog="Exit codes: 0 done, 2 bad arguments, run or input.")
  p.add_argument("--workdir", required=True, help="reward-model run directory (train.objective=reward)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--input", required=True, help="JSONL file: one chat record or {\"text\": ...} per line")
  p.add_argument("--output", default="", help="JSONL file for the rewards (default: stdout)")
  p.add_argument("--batch_size", type=int, default=32, help="texts per forward pass")
  args = p.parse_args(argv)
  try:
    if args.batch_size < 1:
      raise ScoreError(f"--batch_size={args.batch_size} must be >= 1")
    texts = read_input(args.input)
    from data import chat as chat_lib  # pylint: disable=g-import-not-at-top
    try:
      rewards = load_scorer(args.workdir, args.step, args.batch_size)(texts)
    except chat_lib.ChatError as e:
      raise ScoreError(f"{args.input}: {e}") from None
  except ScoreError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  lines = "".join(json.dumps({"reward": r}) + "\n" for r in rewards)
  if args.output:
    with open(args.output + ".tmp", "w") as f:
      f.write(lines)
    os.replace(args.output + ".tmp", args.output)
  else:
    sys.stdout.write(lines)
  return 0


if __name__ == "__main__":
  sys.exit(main())
