"""Data pipeline throughput vs the tiny model's consumption, on the built-in corpus.

    JAX_PLATFORMS=cpu python benchmarks/data_pipeline.py [--batches 150] [--model_steps 4] [--tokenizer PATH]

Times tokenize + pack + batch in this process with no prefetch thread and no workers (so one core does all the
work; the rate per CPU-second is the per-core figure), for both packers, then the tiny model's training step
(`train.core.step.Trainer` on the tiny config). Prints one JSON object; target: supply >= 10x what the model consumes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import tiny  # noqa: E402
from data import pipeline  # noqa: E402
from data import tokenizer as tokenizer_lib  # noqa: E402


def pipeline_rate(config, tok, batches: int) -> dict:
  """Tokens per second (wall and per CPU-second) over `batches` batches after a warm-up batch."""
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  next(it)
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(batches):
    next(it)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  stats = it.stats()
  it.close()
  slots = batches * config.train.batch_size * config.train.seq_len
  return {"tokens_per_sec": slots / wall, "tokens_per_cpu_sec": slots / cpu,
          "packing_efficiency": stats["data/packing_efficiency"],
          "mixture_docs": {k.split("/")[-1]: round(v, 4) for k, v in stats.items() if "mixture_docs" in k},
          "mixture_tokens": {k.split("/")[-1]: round(v, 4) for k, v in stats.items() if "mixture_tokens" in k}}


def model_rate(config, steps: int) -> float:
  """The tiny model's training tokens/s on this machine (median step after compilation)."""
  from parallel import mesh as mesh_lib
  from train.core import step as step_lib
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))
  lines = step_lib.run_synthetic(trainer, steps + 1)[1:]  # the first step compiles
  return sorted(line["tokens_per_sec"] for line in lines)[len(lines) // 2]


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument("--batches", type=int, default=150)
  parser.add_argument("--model_steps", type=int, default=4)
  parser.add_argument("--tokenizer", default="", help="an existing 2048-piece .model (default: train one)")
  args = parser.parse_args()
  config = tiny.get_config()
  config.data.prefetch = 0  # measure the work itself, on this thread
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    config.data.tokenizer = args.tokenizer
    path = tokenizer_lib.prepare(config, tmp)
    tokenizer_seconds = time.perf_counter() - t0
    tok = tokenizer_lib.Tokenizer.load(path)
    config.data.tokenizer = path
    result = {"tokenizer_train_seconds": round(tokenizer_seconds, 2), "batch_size": config.train.batch_size,
              "seq_len": config.train.seq_len, "cores": os.cpu_count()}
    for packing in ("first_fit", "concat"):
      config.data.packing = packing
      result[f"pipeline_{packing}"] = pipeline_rate(config, tok, args.batches)
  config.data.packing = "first_fit"
  result["model_tokens_per_sec"] = model_rate(config, args.model_steps)
  supply = result["pipeline_first_fit"]["tokens_per_cpu_sec"]
  result["supply_over_consumption"] = supply / result["model_tokens_per_sec"]
  result["target_met"] = result["supply_over_consumption"] >= 10
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
