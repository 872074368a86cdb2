"""Multi-turn episodes for `python -m train.rl` with rl.env (environments: train/rl/env.py).

Each episode's transcript is kept as token ids: the prompt, then per turn the policy's sampled tokens (kept as
sampled, never re-tokenized) and, when the episode goes on, the environment's observation as a user turn of the
chat template followed by the assistant marker. `masks` marks the completion's policy tokens 1 and the
environment's 0, so the loss and the advantages reach only the policy's tokens while the whole transcript is the
context (train/rl/rollouts.py `rows`); the sampler's log-probs are kept for the policy's tokens, in order.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from train.rl import rewards


def env_turn_ids(template, conversation, observation: str) -> list[int]:
  """Token ids that follow `conversation` (ending with the policy's turn) for the observation as a user turn and
  the generation prompt. ValueError when the template does not render the conversation as a prefix of the longer
  one (a template that rewrites earlier turns cannot be continued token by token)."""
  before = template.render(conversation)[0]
  after = template.prompt(list(conversation) + [{"role": "user", "content": observation}])
  if after[:len(before)] != before:
    raise ValueError("the chat template renders an earlier turn differently once a turn follows it; rl.env needs a "
                     "template that appends turns (the meshlm template does)")
  return after[len(before):]


def run(session, conversations, seed: int, policy=None, first_row: int = 0) -> dict[str, Any]:
  """One episode per conversation (module docstring): the roll dict of Session.sample plus `masks`; `raw` is each
  episode's return, NaN (dropped, listed in `failures`) where the environment raised. `policy` as
  Session.sample's; `first_row`: the first turn's row of conversations[0] in the sampler's keys."""
  r, n = session.config.rl, len(conversations)
  envs = [session.env_factory() for _ in conversations]
  convs = [list(c[:-1]) + [{"role": "user", "content": env.reset(c[-1]["content"])}]
           for env, c in zip(envs, conversations)]
  prompt_ids = [session.template.prompt(c) for c in convs]
  ids, masks, logps = [list(p) for p in prompt_ids], [[] for _ in convs], [[] for _ in convs]
  returns, parts, failures = np.zeros(n), {}, []
  ended, turns, longest = np.zeros(n, bool), np.zeros(n), np.zeros(n)
  stats = {"prefill_seconds": 0.0, "decode_seconds": 0.0}
  running = list(range(n))
  for turn in range(r.max_turns):
    if not running:
      break
    gen = session.generate([ids[i] for i in running], seed if turn == 0 else session.turn_seed(seed, turn), policy,
                           first_row if turn == 0 else 0)
    for k in stats:
      stats[k] += gen.stats[k]
    still = []
    for k, i in enumerate(running):
      toks = list(gen.tokens[k])
      ids[i] += toks
      masks[i] += [1] * len(toks)
      logps[i] += list(gen.logprobs[k])
      ended[i], turns[i] = bool(toks) and toks[-1] in session.stop_ids, turn + 1
      longest[i] = max(longest[i], len(toks))
      text = session.tokenizer.decode([t for t in toks if t not in session.stop_ids])
      try:
        observation, reward, done = envs[i].step(text)
        returns[i] += rewards.add_parts(parts, reward, i, n)
      except Exception as e:  # pylint: disable=broad-except  (user code: the episode is dropped, counted)
        returns[i] = math.nan
        failures.append(f"rl.env step raised {type(e).__name__}: {e}")
        continue
      if done or not ended[i] or turn + 1 == r.max_turns:
        continue
      convs[i].append({"role": "assistant", "content": text})
      extra = env_turn_ids(session.template, convs[i], observation)
      if len(ids[i]) + len(extra) + r.max_new_tokens > session.config.train.seq_len + 1:
        continue  # no room for another turn: the episode ends with the return it has
      convs[i].append({"role": "user", "content": observation})
      ids[i] += extra
      masks[i] += [0] * len(extra)
      still.append(i)
    running = still
  lengths = np.array([sum(m) for m in masks], np.float64)
  return {"prompt_ids": prompt_ids, "tokens": [ids[i][len(prompt_ids[i]):] for i in range(n)], "logprobs": logps,
          "masks": masks, **session.shaped(returns, ended, lengths, longest), "stats": stats, "parts": parts,
          "turns": turns, "failures": failures}
