"""Held-out greedy accuracy of RL runs on a built-in task family, each against the run it started from, paired.

  JAX_PLATFORMS=cpu python benchmarks/rl_heldout.py --before runs/sft_arithmetic_tiny \
      --after runs/grpo_arithmetic_tiny [--after runs/dapo_arithmetic_tiny ...] [--family arithmetic]

Every distinct held-out prompt of `rl.prompts=builtin:<family>` (data/tasks.py's prompt-hash split, never trained
on by the SFT stages or RL) is answered greedily by each run, rendered with the run's chat template as its
evaluations render it, and scored by data.tasks.reward's `correct` part. Prints one JSON object: the accuracy of
each run and, for each --after run, the prompts right only before / only after and the exact McNemar test's
two-sided p-value (a binomial test of the discordant prompts against 1/2): whether the gain is more than the
chance of which prompts happen to flip.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from data import chat as chat_lib  # noqa: E402
from data import rl_prompts  # noqa: E402
from data import tasks  # noqa: E402
from train.core import chat_eval  # noqa: E402
from train.rundir import generate as run_generate  # noqa: E402


def correct_answers(workdir: str, prompts: list[str], max_new_tokens: int) -> list[bool]:
  """Whether the run's greedy answer to each prompt (one user turn) is right (data.tasks.correct)."""
  config, tokenizer, _, model, mesh, _ = run_generate.load(workdir, None)
  template = chat_lib.make_template(config.data, tokenizer)
  with jax.set_mesh(mesh):
    answers = chat_eval.greedy_answers(model, tokenizer, template, [[{"role": "user", "content": p}] for p in prompts],
                                       max_new_tokens)
  return [tasks.reward(p, answer)["correct"] == 1.0 for p, answer in zip(prompts, answers)]


def mcnemar_p(only_before: int, only_after: int) -> float:
  """Two-sided exact McNemar p-value: P(a split of the discordant prompts at least this uneven | p = 1/2)."""
  n = only_before + only_after
  tail = sum(math.comb(n, k) for k in range(min(only_before, only_after) + 1)) / 2 ** n
  return min(1.0, 2 * tail)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--before", required=True, help="the run RL started from")
  p.add_argument("--after", action="append", required=True, help="an RL run (repeatable)")
  p.add_argument("--family", default="arithmetic", choices=[f for f in tasks.FAMILIES if f != "calculator"],
                 help="the task family (calculator episodes need the tool environment: train.rl's evaluations)")
  p.add_argument("--max_new_tokens", type=int, default=20)
  args = p.parse_args()
  prompts = [c[-1]["content"] for c in rl_prompts.load(f"builtin:{args.family}", tasks.EVAL_FRACTION)["eval"]]
  before = correct_answers(args.before, prompts, args.max_new_tokens)
  out = {"family": args.family, "prompts": len(prompts), "before": {"run": args.before,
                                                                    "accuracy": sum(before) / len(prompts)}}
  out["after"] = []
  for run in args.after:
    after = correct_answers(run, prompts, args.max_new_tokens)
    only_before = sum(b and not a for b, a in zip(before, after))
    only_after = sum(a and not b for b, a in zip(before, after))
    out["after"].append({"run": run, "accuracy": sum(after) / len(prompts), "right_only_before": only_before,
                         "right_only_after": only_after, "mcnemar_p": mcnemar_p(only_before, only_after)})
  print(json.dumps(out))


if __name__ == "__main__":
  main()
