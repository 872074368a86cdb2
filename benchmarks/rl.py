"""Where a PPO iteration's wall time goes: generation vs training, and rollout tokens/s, on this machine.

  JAX_PLATFORMS=cpu python benchmarks/rl.py [--config=ppo_tiny] [--iterations 6] [--workdir DIR]
      [--async_staleness S [--rollout_devices K]]

Runs `python -m train.rl`'s loop (train/rl/loop.py) for --iterations iterations of the recipe (from its base recipe's
run, made in WORKDIR/../<base> when missing; the timings below exclude it) and prints one JSON object with the
medians over the iterations after the first (which compiles the sampler and the step):
  generate_fraction        share of an iteration's rollout + update time spent sampling (rest: scoring + epochs)
  generate_seconds         wall time of the rollout (sampling + rewards) per iteration
  train_seconds            wall time of scoring (old/reference log-probs, values) + the optimizer steps
  rollout_tokens_per_sec   completion tokens per second of sampler time (prefill + decode, compilation excluded)
  train_tokens_per_sec     prompt + completion tokens (train.seq_len per row) through the step per second
  iteration_seconds        wall time of a whole iteration
With --async_staleness S the same iterations also run with rl.async_rollouts (rl.max_staleness S, rl.rollout_devices
K; K > 0 needs that many more devices, e.g. XLA_FLAGS=--xla_force_host_platform_device_count=2) and the JSON gets
"async": the same medians (generate_seconds is then the learner's wait for the rollouts).
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
  parser.add_argument("--async_staleness", type=int, default=None, help="also time rl.async_rollouts")
  parser.add_argument("--rollout_devices", type=int, default=0)
  args = parser.parse_args()
  overrides = {"rl.iterations": args.iterations, "rl.eval_every": 0, "train.eval_generations": 0, "log.progress": False,
               "checkpoint.every": 0}
  os.makedirs("runs", exist_ok=True)
  workdir = args.workdir or tempfile.mkdtemp(prefix="bench_rl_", dir="runs")
  out = _timed(configs.load(args.config, **overrides), workdir, args.config)
  if args.async_staleness is not None:
    overrides.update({"rl.async_rollouts": True, "rl.max_staleness": args.async_staleness,
                      "rl.rollout_devices": args.rollout_devices, "rl.dynamic_sampling": False})
    out["async"] = _timed(configs.load(args.config, **overrides), workdir + "_async", args.config)
    out["async"].update(max_staleness=args.async_staleness, rollout_devices=args.rollout_devices)
  print(json.dumps(out))


def _timed(config, workdir: str, name: str) -> dict:
  """Runs the loop in `workdir` and returns the medians over the iterations after the first (module docstring)."""
  rl.run(config, workdir)
  records = [r for r in logger_lib.read_metrics(workdir) if "generate_seconds" in r][1:]
  rows = config.rl.prompts_per_iteration * config.rl.samples_per_prompt
  steps = rl.steps_per_iteration(config)
  median = lambda key: float(np.median([r[key] for r in records]))
  train_tokens = steps * config.train.batch_size * config.train.seq_len
  return {"config": name, "iterations_timed": len(records), "rollout_rows": rows, "optimizer_steps": steps,
          "generate_fraction": median("generate_fraction"), "generate_seconds": median("generate_seconds"),
          "train_seconds": median("train_seconds"), "rollout_tokens_per_sec": median("rollout_tokens_per_sec"),
          "iteration_seconds": median("iteration_seconds"),
          "train_tokens_per_sec": float(np.median([train_tokens / r["train_seconds"] for r in records]))}


if __name__ == "__main__":
  main()
