"""DPO step time and memory vs an SFT step on the same sequences, and the reward-model step, on 1 CPU device.

  JAX_PLATFORMS=cpu python benchmarks/dpo.py [--steps 6] [--pairs 4]

Prints one JSON object:
  step_seconds: the fastest step (first, compiling step excluded; steps of the variants interleaved so machine
                load affects all alike) of `sft` on the 2P sequences of P pairs (chosen and rejected rows, loss on
                the completion tokens), `dpo` on the P pairs (policy forward + backward over the same 2P sequences
                plus a reference forward), and `reward` (trunk forward + backward, scalar head).
  dpo_over_sft: dpo / sft step time (target <= 2.2: the extra reference forward costs about a third of a step).
  memory:       per-device compiled bytes of each step (train.core.step.Trainer.memory_analysis: total, arguments,
                temporaries); DPO's arguments add the frozen reference's weights.
The model is the d256 / 4-layer / vocab-2048 decoder of STACK-NOTES; pairs come from builtin:preference, padded to
seq_len 256 so the sequences are those of the SFT benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from data import pipeline  # noqa: E402
from data import tokenizer as tokenizer_lib  # noqa: E402
from parallel import mesh as mesh_lib  # noqa: E402
from train.core import step as step_lib  # noqa: E402

MODEL = {"model.vocab_size": 2048, "model.d_model": 256, "model.num_layers": 4, "model.num_heads": 4,
         "model.num_kv_heads": 4, "model.head_dim": 64, "model.mlp_dim": 1024, "model.max_seq_len": 256,
         "train.seq_len": 256, "train.warmup_steps": 1, "train.z_loss": 0.0}


def _trainer(**over):
  config = configs.load("tiny", **{**MODEL, **over})
  return step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))


def _time_steps(trainers, batches, steps):
  """Fastest step time (s) of each trainer on its own batches, steps interleaved; the compiling step excluded."""
  states = [t.init() for t in trainers]
  best = [float("inf")] * len(trainers)
  for i in range(steps + 1):
    for j, t in enumerate(trainers):
      batch = t.batch_to_device(batches[j][i % len(batches[j])])
      start = time.perf_counter()
      states[j], metrics = t.step_fn(states[j], batch)
      jax.block_until_ready(metrics)
      if i:
        best[j] = min(best[j], time.perf_counter() - start)
  return best


def _as_sft(pair_batch):
  """The pair batch's 2P sequences as an SFT batch (rows chosen_0, rejected_0, ...; loss on the completions)."""
  keys = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
  return {k: np.stack([pair_batch[f"chosen_{k}"], pair_batch[f"rejected_{k}"]], 1).reshape(
      -1, pair_batch[f"chosen_{k}"].shape[1]) for k in keys}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--pairs", type=int, default=4)
  args = parser.parse_args(argv)
  tmp = tempfile.mkdtemp()
  tok_path = tokenizer_lib.prepare(configs.load("tiny", **{**MODEL, "data.tokenizer_max_sentences": 5000}), tmp)
  tok = tokenizer_lib.Tokenizer.load(tok_path)
  config = configs.load("tiny", **{**MODEL, "train.batch_size": args.pairs, "data.tokenizer": tok_path,
                                   "data.sources": "pairs=builtin:preference", "data.chat_template": "meshlm",
                                   "data.prefetch": 0})
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  pair_batches = [next(it) for _ in range(4)]
  it.close()
  sft_batches = [_as_sft(b) for b in pair_batches]
  trainers = {"sft": _trainer(**{"train.objective": "sft", "train.batch_size": 2 * args.pairs}),
              "dpo": _trainer(**{"train.objective": "dpo", "train.batch_size": args.pairs}),
              "reward": _trainer(**{"train.objective": "reward", "train.batch_size": args.pairs})}
  batches = [sft_batches, pair_batches, pair_batches]
  times = dict(zip(trainers, _time_steps(list(trainers.values()), batches, args.steps)))
  memory = {}
  for name, trainer in trainers.items():
    mem = trainer.memory_analysis()
    memory[name] = {k: mem[k] for k in ("total_bytes", "argument_bytes", "temp_bytes")}
  out = {"device": jax.devices()[0].device_kind, "model": MODEL, "pairs": args.pairs,
         "sequences": 2 * args.pairs, "steps": args.steps, "step_seconds": times,
         "dpo_over_sft": times["dpo"] / times["sft"], "reward_over_sft": times["reward"] / times["sft"],
         "memory": memory}
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
