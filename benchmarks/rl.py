"""Where a PPO iteration's wall time goes: generation vs training, and rollout tokens/s, on this machine.

  JAX_PLATFORMS=cpu python benchmarks/rl.py [--config=ppo_tiny] [--iterations 6] [--workdir DIR]

Runs `python -m train.rl`'s loop (train/rl/loop.py) for --iterations iterations of the recipe (from its base recipe's
run, made in WORKDIR/../<base> when missing; the timings below exclude it) and prints one JSON object with the
medians over the iterations after the first (which compiles the sampler and the step):
  generate_fraction        share of an iteration's rollout + update time spent sampling (rest: scoring + epochs)
  generate_seconds         wall time of the rollout (sampling + rewards) per iteration
  train_seconds            wall time of scoring (old/reference log-probs, values) + the optimizer steps
  rollout_tokens_per_sec   completion tokens per second of sampler time (prefill + decode, compilation excluded)
  train_tokens_per_sec     prompt + completion tokens (train.seq_len per row) through the step per second
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import configs  # noqa: E402
from train.core import logger as logger_lib  # noqa: E402
from train.rl import loop as rl  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="ppo_tiny")
  parser.add_argument("--iterations", type=int, default=6)
  parser.add_argument("--workdir", default=None, help="default: a fresh directory under runs/ (next to the base)")
  args = parser.parse_args()
  config = configs.load(args.config, **{"rl.iterations": args.iterations, "rl.eval_every": 0,
                                         "log.progress": False, "checkpoint.every": 0})
  os.makedirs("runs", exist_ok=True)
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_rl_", dir="runs")
  rl.run(config, workdir)
  records = [r for r in logger_lib.read_metrics(workdir) if "generate_seconds" in r][1:]
  rows = config.rl.prompts_per_iteration * config.rl.samples_per_prompt
  steps = rl.steps_per_iteration(config)
  median = lambda key: float(np.median([r[key] for r in records]))
  train_tokens = steps * config.train.batch_size * config.train.seq_len
  print(json.dumps({
      "config": args.config, "iterations_timed": len(records), "rollout_rows": rows, "optimizer_steps": steps,
      "generate_fraction": median("generate_fraction"), "generate_seconds": median("generate_seconds"),
      "train_seconds": median("train_seconds"), "rollout_tokens_per_sec": median("rollout_tokens_per_sec"),
      "train_tokens_per_sec": float(np.median([train_tokens / r["train_seconds"] for r in records]))}))


if __name__ == "__main__":
  main()
