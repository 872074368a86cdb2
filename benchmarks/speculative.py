"""Speculative decoding through the engine on a trained run: plain greedy decoding against drafts from the model's
own multi-token head (draft="mtp", DeepSeek-V3 sec. 2.2 / 5.4.3) and from n-gram prompt lookup.

  JAX_PLATFORMS=cpu python benchmarks/speculative.py [--workdir RUN] [--steps 300] [--prompts 32] [--prompt_len 48]
      [--new 64] [--max_seqs 8] [--repeats 3]

Without a run at --workdir (default: a temporary directory) it first trains one with the default recipe on the
built-in corpus and one multi-token head: `python -m train --config.model.mtp_depth=1 --config.train.steps=STEPS`.
Prompts: --prompts windows of --prompt_len tokens from the run's held-out documents (data.eval_fraction; up to 4
consecutive windows of each, its sources in order). Each system decodes every prompt greedily for --new tokens through one Engine(max_seqs, page 16,
chunk 64), compiled first (Engine.warmup), timed --repeats times (the fastest is reported); all must give the same tokens (speculative greedy is plain greedy).
Figures: output tokens/s, engine steps, drafts proposed and accepted (acceptance rate = accepted / drafted), and
tokens per decoding call of a sequence (1 + accepted drafts per step). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data import sources  # noqa: E402  pylint: disable=wrong-import-position
from model import engine as engine_lib  # noqa: E402  pylint: disable=wrong-import-position
from train.rundir import generate as generate_cli  # noqa: E402  pylint: disable=wrong-import-position

SYSTEMS = {"plain": {}, "mtp": {"speculative": 1, "draft": "mtp"}, "ngram_1": {"speculative": 1, "ngram": 2},
           "ngram_3": {"speculative": 3, "ngram": 2}}


def train_run(workdir: str, steps: int) -> None:
  """The default recipe with one multi-token head into workdir (python -m train; its own process)."""
  cmd = [sys.executable, "-m", "train", "--config.model.mtp_depth=1", f"--config.train.steps={steps}",
         "--workdir", workdir]
  subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def held_out_prompts(config, tokenizer, count: int, length: int, per_document: int = 4) -> list[list[int]]:
  """`count` prompts of `length` tokens: up to `per_document` consecutive windows of each held-out document (the
  run's data.eval_fraction split), its sources in turn."""
  prompts = []
  for spec in sources.parse_spec(config.data.sources, config.data.weights):
    src = sources.open_source(spec, config.data.text_field)
    for i in sources.source_split(src, config.data.eval_fraction, "eval"):
      ids = tokenizer.encode(src[int(i)])
      prompts += [ids[j:j + length] for j in range(0, len(ids) - length + 1, length)][:per_document]
      if len(prompts) >= count:
        return prompts[:count]
  raise SystemExit(f"only {len(prompts)} held-out windows of {length} tokens; lower --prompts")


def run(model, prompts, new: int, max_seqs: int, options: dict, repeats: int) -> tuple[list[list[int]], dict]:
  """(tokens, figures) of the best of `repeats` timed runs, each a fresh engine after one warm-up."""
  best = None
  for _ in range(repeats):
    engine = engine_lib.Engine(model, max_seqs=max_seqs, page_size=16, chunk=64, **options)
    engine.warmup()  # every program it can call (engines of one configuration share them)
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, new)
    seconds = time.perf_counter() - t0
    best = seconds if best is None else min(best, seconds)
  seconds, s = best, engine.stats
  decode_steps = s["drafted"] + (len(prompts) * new - s["accepted"] - s["drafted"])  # sequence-steps decoding
  figures = {"tokens_per_sec": len(prompts) * new / seconds, "seconds": seconds, "engine_steps": s["steps"],
             "drafted": s["drafted"], "accepted": s["accepted"],
             "acceptance": s["accepted"] / s["drafted"] if s["drafted"] else None,
             "tokens_per_sequence_step": len(prompts) * new / max(decode_steps, 1)}
  return tokens, figures


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", default=None)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--prompts", type=int, default=32)
  p.add_argument("--prompt_len", type=int, default=48)
  p.add_argument("--new", type=int, default=64)
  p.add_argument("--max_seqs", type=int, default=8)
  p.add_argument("--repeats", type=int, default=3, help="timed runs per system (the fastest is reported)")
  args = p.parse_args()
  workdir = args.workdir or tempfile.mkdtemp(prefix="speculative_")
  if not os.path.exists(os.path.join(workdir, "config.json")):
    train_run(workdir, args.steps)
  config, tokenizer, _, model, _, _ = generate_cli.load(workdir, None)
  prompts = held_out_prompts(config, tokenizer, args.prompts, args.prompt_len)
  result = {"workdir": workdir, "mtp_depth": config.model.mtp_depth, "prompts": len(prompts),
            "prompt_len": args.prompt_len, "new_tokens": args.new, "max_seqs": args.max_seqs}
  want = None
  for name, options in SYSTEMS.items():
    tokens, result[name] = run(model, prompts, args.new, args.max_seqs, options, args.repeats)
    want = tokens if want is None else want
    result[name]["same_tokens_as_plain"] = tokens == want
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
