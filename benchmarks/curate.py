"""Curation throughput: documents/s per core for each stage and the whole pipeline, and peak memory.

    JAX_PLATFORMS=cpu python benchmarks/curate.py [--docs 100000] [--shards 10] [--workers 1] [--dir /tmp/x]

Generates a corpus of `--docs` documents (text from a word-bigram chain over Python's own pydoc topics, so no
download; 3% exact and 2% near duplicates planted), times every stage function on one core over a sample, then
runs the whole pipeline with `--workers` processes. Prints one JSON object. Rates per core divide by CPU seconds
(this process and its workers), which a shared, busy machine does not distort as it does wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import sys
import tempfile
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import curate as curate_config  # noqa: E402
from data.curate import langid, minhash, perplexity, pii, pipeline, quality  # noqa: E402
from data.curate import text as textlib  # noqa: E402


def _chain():
  import pydoc_data.topics
  words = re.findall(r"[A-Za-z][a-z']+|[.,]", " ".join(pydoc_data.topics.topics.values()))
  successors: dict[str, list[str]] = {}
  for a, b in zip(words, words[1:]):
    successors.setdefault(a, []).append(b)
  return words, successors


def _sentence(rng, words, successors, n):
  w = rng.choice(words)
  out = [w.capitalize()]
  for _ in range(n):
    w = rng.choice(successors.get(w) or words)
    out.append(w)
  return " ".join(out).replace(" .", ".").replace(" ,", ",").rstrip(",") + "."


def generate(directory: str, num_docs: int, num_shards: int, seed: int = 0) -> str:
  rng = random.Random(seed)
  words, successors = _chain()
  docs = []
  for i in range(num_docs):
    r = rng.random()
    if r < 0.03 and docs:
      text = rng.choice(docs)[1]
    elif r < 0.05 and docs:
      text = "\n".join(line + " indeed" for line in rng.choice(docs)[1].split("\n"))
    else:
      text = "\n".join(_sentence(rng, words, successors, rng.randint(15, 35)) for _ in range(rng.randint(3, 7)))
    docs.append((f"doc-{i}", text))
  per = (num_docs + num_shards - 1) // num_shards
  for s in range(num_shards):
    with open(os.path.join(directory, f"in-{s:03d}.jsonl"), "w") as f:
      for doc_id, text in docs[s * per:(s + 1) * per]:
        f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
  with open(os.path.join(directory, "reference.txt"), "w") as f:
    import pydoc_data.topics
    f.write("\n".join(pydoc_data.topics.topics.values()))
  return directory


def _cpu() -> float:
  """CPU seconds of this process and its finished children: on a shared machine, the fair "per core" clock."""
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _rate(fn, items) -> float:
  t0 = _cpu()
  for item in items:
    fn(item)
  return len(items) / (_cpu() - t0)


def _timed(fn) -> float:
  t0 = _cpu()
  fn()
  return _cpu() - t0


def stage_rates(cfg, texts: list[str], models: dict) -> dict:
  """Documents/s of each per-document stage function on one core."""
  identifier = langid.LanguageIdentifier()
  hasher = minhash.MinHasher(cfg.minhash.shingle_size, cfg.minhash.bands, cfg.minhash.rows)
  scorer = perplexity.Scorer(models)
  scorer.perplexities(texts[:8], "en")  # loads the model outside the timing
  # The sections as score_shard passes them (plain attributes): ConfigDict look-ups would be timed otherwise.
  quality_cfg = types.SimpleNamespace(**cfg.quality.to_dict())
  pii_cfg = types.SimpleNamespace(**cfg.pii.to_dict())
  t0 = _cpu()
  for i in range(0, len(texts), 256):
    scorer.perplexities(texts[i:i + 256], "en")
  ppl_rate = len(texts) / (_cpu() - t0)
  return {
      "normalize_and_hash": _rate(textlib.paragraph_hashes, texts),
      "minhash": len(texts) / _timed(lambda: [hasher.signatures(texts[i:i + 256]) for i in range(0, len(texts), 256)]),
      "langid": _rate(identifier.identify, texts),
      "quality": _rate(lambda t: quality.check(t, "en", quality_cfg), texts),
      "perplexity": ppl_rate,
      "pii": _rate(lambda t: pii.mask(t, pii_cfg), texts),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--docs", type=int, default=100_000)
  parser.add_argument("--shards", type=int, default=10)
  parser.add_argument("--workers", type=int, default=1, help="local worker processes for the whole pipeline")
  parser.add_argument("--sample", type=int, default=5000, help="documents for the per-stage timings")
  parser.add_argument("--dir", default="", help="work directory (default: a temporary one)")
  args = parser.parse_args(argv)
  root = args.dir or tempfile.mkdtemp(prefix="curate-bench-")
  os.makedirs(os.path.join(root, "in"), exist_ok=True)
  t0 = time.perf_counter()
  generate(os.path.join(root, "in"), args.docs, args.shards)
  gen_s = time.perf_counter() - t0

  cfg = curate_config.get_config()
  cfg.input = os.path.join(root, "in", "in-*.jsonl")
  cfg.output = os.path.join(root, "out")
  cfg.num_workers = args.workers
  cfg.dedup.min_length = 200
  cfg.langid.threshold = 0.5
  cfg.pii.enabled = True
  cfg.perplexity.reference = (os.path.join(root, "in", "reference.txt"),)
  t0, c0 = time.perf_counter(), _cpu()
  summary = pipeline.run(cfg)
  wall, cpu = time.perf_counter() - t0, _cpu() - c0
  with open(os.path.join(cfg.output, pipeline.WORK, "lm", "models.json")) as f:
    models = json.load(f)

  with open(os.path.join(root, "in", "in-000.jsonl")) as f:
    texts = [json.loads(line)["text"] for _, line in zip(range(args.sample), f)]
  rates = stage_rates(cfg, texts, models)
  # Global steps, timed alone on the finished run's intermediate files.
  n = args.shards
  work = os.path.join(cfg.output, pipeline.WORK)
  resolve_s = _timed(lambda: pipeline._resolve_paragraphs(cfg, work, n, None))
  lsh_s = _timed(lambda: pipeline._resolve_near_duplicates(cfg, work, n))

  self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
  stages = {s["stage"]: s for s in summary["stages"]}
  print(json.dumps({
      "documents": args.docs,
      "shards": n,
      "workers": args.workers,
      "generate_s": round(gen_s, 1),
      "pipeline_wall_s": round(wall, 1),
      "pipeline_cpu_s": round(cpu, 1),
      "pipeline_docs_per_s_per_core": round(args.docs / cpu, 1),
      "pipeline_docs_per_s_per_worker_wall": round(args.docs / wall / args.workers, 1),
      "load_average_1min": round(os.getloadavg()[0], 1),
      "stage_docs_per_s_per_core": {k: round(v, 1) for k, v in rates.items()},
      "global_paragraph_resolution_docs_per_s": round(args.docs / resolve_s, 1),
      "global_minhash_resolution_docs_per_s": round(stages["minhash"]["docs_in"] / lsh_s, 1),
      "paragraph_hash_set_bytes": summary["paragraph_dedup"]["set_bytes"],
      "paragraph_hash_set_bytes_per_million_docs": round(summary["paragraph_dedup"]["set_bytes"] / args.docs * 1e6),
      "paragraphs_per_doc": round(summary["paragraph_dedup"]["paragraphs"] / args.docs, 2),
      "peak_rss_mib": {"driver": round(self_rss), "largest_worker": round(child_rss)},
      "docs_out": sum(b["docs"] for lang in summary["output"].values() for b in lang.values()),
      "duplicate_documents": summary.get("minhash"),
  }))
  return 0


if __name__ == "__main__":
  sys.exit(main())
