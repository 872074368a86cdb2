"""The tokenized cache on the built-in corpus: build speed, bytes on disk, and read speed against tokenizing on the fly.

    JAX_PLATFORMS=cpu python benchmarks/pretokenize.py [--batches 150] [--tokenizer PATH] [--workers 1,2]

`python -m data.pretokenize`'s build in one worker process (tokens per CPU-second of that worker = the per-core rate)
and in `--workers` processes (wall-clock tokens/s); the cache's bytes per token; then the grain pipeline (no
prefetch thread, no workers: one core) reading `tokens:DIR` against the same mixture read as text and tokenized
on the fly (tokens/s of packed batch slots, wall and per CPU-second). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import tiny  # noqa: E402
from data import pretokenize  # noqa: E402
from data import sources as sources_lib  # noqa: E402
from data import tokenizer as tokenizer_lib  # noqa: E402
from data.curate import executors  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_pipeline import pipeline_rate  # noqa: E402

SOURCES = sources_lib.BUILTIN_DEFAULT


def _children_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


def build_rate(tok_path: str, out: str, workers: int) -> dict:
  """Wall and worker CPU seconds of one build into `out` (the per-core rate: tokens per worker CPU-second)."""
  executor = executors.LocalExecutor(workers) if workers > 1 else None
  cpu0, wall0, own0 = _children_cpu(), time.perf_counter(), time.process_time()
  try:
    manifest = pretokenize.build(SOURCES, tok_path, out, shard_docs=128, executor=executor)
  finally:
    if executor is not None:
      executor.close()
  wall = time.perf_counter() - wall0
  cpu = _children_cpu() - cpu0 + (time.process_time() - own0)
  tokens = sum(s["tokens"] for s in manifest["sources"])
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs if f.endswith(".array_record"))
  return {"workers": workers, "tokens": tokens, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
          "tokens_per_sec": round(tokens / wall), "tokens_per_cpu_sec": round(tokens / cpu),
          "bytes_per_token": round(size / tokens, 3)}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--batches", type=int, default=150)
  p.add_argument("--tokenizer", default="", help="an existing 2048-piece .model (default: train one)")
  p.add_argument("--workers", default="1,2", help="worker process counts of the build, comma-separated")
  args = p.parse_args()
  config = tiny.get_config()
  config.data.prefetch = 0
  out: dict = {"machine": {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0]}}
  with tempfile.TemporaryDirectory() as tmp:
    tok_path = args.tokenizer or tokenizer_lib.train(
        (t for t in _texts()), os.path.join(tmp, "tok.model"), config.model.vocab_size)
    tok = tokenizer_lib.Tokenizer.load(tok_path)
    builds = [build_rate(tok_path, os.path.join(tmp, f"cache{w}"), int(w)) for w in args.workers.split(",")]
    out["build"] = builds
    cache = os.path.join(tmp, f"cache{args.workers.split(',')[0]}")
    config.data.tokenizer = tok_path
    config.data.sources = SOURCES
    text = pipeline_rate(config, tok, args.batches)
    config.data.sources = f"tokens:{cache}"
    cached = pipeline_rate(config, tok, args.batches)
    out["read"] = {"text_tokens_per_cpu_sec": round(text["tokens_per_cpu_sec"]),
                   "cache_tokens_per_cpu_sec": round(cached["tokens_per_cpu_sec"]),
                   "text_tokens_per_sec": round(text["tokens_per_sec"]),
                   "cache_tokens_per_sec": round(cached["tokens_per_sec"]),
                   "speedup_per_cpu_sec": round(cached["tokens_per_cpu_sec"] / text["tokens_per_cpu_sec"], 2)}
  out["machine"]["load_end"] = os.getloadavg()[0]
  print(json.dumps(out, indent=1))
  return 0


def _texts():
  for spec in sources_lib.parse_spec(SOURCES):
    src = sources_lib.open_source(spec)
    for i in range(len(src)):
      yield src[i]


if __name__ == "__main__":
  sys.exit(main())
