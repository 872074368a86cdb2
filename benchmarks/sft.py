"""SFT vs pretraining throughput, and LoRA vs full fine-tuning memory and speed, on 1 CPU device.

  JAX_PLATFORMS=cpu python benchmarks/sft.py [--steps 6] [--lora_rank 8]

Prints one JSON object:
  step:     tokens/s of the jitted step for objective=lm and objective=sft on the same packed batches of
            instruction conversations (data/instruct.py, assistant-token mask), and the SFT overhead in percent
            (target <= 5%). Steps of the two alternate so machine load affects both alike; the fastest step
            counts (on a shared machine load only adds time).
  pipeline: tokens/s of the data pipeline (render + mask + pack + batch) for the chat source vs plain text.
  lora:     per-device compiled bytes (total and arguments, train.core.step.Trainer.memory_analysis) and tokens/s of
            full fine-tuning vs LoRA (rank --lora_rank on q,k,v,o and on every projection), plus the parameters
            the optimizer holds state for.
The model is the d256 / 4-layer / vocab-2048 decoder of STACK-NOTES (batch 8 x 256).
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
         "train.batch_size": 8, "train.seq_len": 256, "train.warmup_steps": 1}


def _config(**over):
  return configs.load("tiny", **{**MODEL, **over})


def _trainer(config):
  return step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))


def _time_steps(trainers, batches, steps):
  """Fastest step time (s) of each trainer, steps interleaved; the first (compiling) step excluded."""
  states = [t.init() for t in trainers]
  best = [float("inf")] * len(trainers)
  for i in range(steps + 1):
    for j, t in enumerate(trainers):
      batch = t.batch_to_device(batches[i % len(batches)])
      start = time.perf_counter()
      states[j], metrics = t.step_fn(states[j], batch)
      jax.block_until_ready(metrics)
      if i:
        best[j] = min(best[j], time.perf_counter() - start)
  return best


def _pipeline_rate(config, tok, batches=30):
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  next(it)
  start = time.perf_counter()
  tokens = sum(int((next(it)["segment_ids"] > 0).sum()) for _ in range(batches))
  rate = tokens / (time.perf_counter() - start)
  it.close()
  return rate


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--lora_rank", type=int, default=8)
  args = parser.parse_args(argv)
  tmp = tempfile.mkdtemp()
  tok_path = tokenizer_lib.prepare(_config(**{"data.tokenizer_max_sentences": 5000}), tmp)
  tok = tokenizer_lib.Tokenizer.load(tok_path)
  chat_config = _config(**{"data.tokenizer": tok_path, "data.sources": "instruct=builtin:instruct",
                           "data.chat_template": "meshlm", "data.prefetch": 0})
  text_config = _config(**{"data.tokenizer": tok_path, "data.prefetch": 0})
  it = pipeline.make_iterator(chat_config, tok, process_index=0, process_count=1)
  batches = [next(it) for _ in range(4)]
  it.close()
  tokens_per_step = MODEL["train.batch_size"] * MODEL["train.seq_len"]
  lm, sft = _time_steps([_trainer(_config()), _trainer(_config(**{"train.objective": "sft"}))], batches,
                        args.steps)
  out = {"device": jax.devices()[0].device_kind, "model": MODEL, "steps": args.steps,
         "step": {"lm_tokens_per_sec": tokens_per_step / lm, "sft_tokens_per_sec": tokens_per_step / sft,
                  "sft_overhead_percent": 100.0 * (sft / lm - 1.0),
                  "loss_tokens_fraction": float(np.mean([b["loss_mask"].mean() for b in batches]))},
         "pipeline": {"chat_tokens_per_sec": _pipeline_rate(chat_config, tok),
                      "text_tokens_per_sec": _pipeline_rate(text_config, tok)}}
  variants = {"full": {}, f"lora_r{args.lora_rank}_qkvo": {"train.lora_rank": args.lora_rank},
              f"lora_r{args.lora_rank}_all": {"train.lora_rank": args.lora_rank,
                                              "train.lora_targets": ("q", "k", "v", "o", "gate", "up", "down")}}
  trainers = {name: _trainer(_config(**{"train.objective": "sft", **over})) for name, over in variants.items()}
  times = _time_steps(list(trainers.values()), batches, args.steps)
  out["lora"] = {}
  for (name, trainer), seconds in zip(trainers.items(), times):
    mem = trainer.memory_analysis()
    out["lora"][name] = {"tokens_per_sec": tokens_per_step / seconds, "total_bytes": mem["total_bytes"],
                         "argument_bytes": mem["argument_bytes"], "temp_bytes": mem["temp_bytes"],
                         "trained_parameters": int(sum(x.size for x in jax.tree.leaves(
                             trainer.abstract_state()["params"])))}
  print(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
