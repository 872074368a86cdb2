"""A tokenized cache: a mixture's text sources tokenized once into ArrayRecord shards that every epoch and every
host reads without tokenizing again (mixture item `tokens:DIR`, data/sources.py: `TokenCache`).

`python -m data.pretokenize --sources SPEC --tokenizer tok.model --output DIR [--shard_docs N] [--num_workers K]
[--executor local|ray]`

Layout of DIR:
  manifest.json             the tokenizer (path, sha256, vocabulary size), every source (spec, weight, documents,
                            tokens, shards), the settings; `complete` once every shard is written
  tokenizer.model           a copy of the tokenizer (runs without data.tokenizer use it)
  NAME/source.json          one source: name, weight, tokenizer sha256, shards [{file, docs, tokens}]
  NAME/shard-KKKKK.array_record   one record per source document, in the source's order: its token ids as
                            little-endian int32 (no BOS / EOS; an empty record where the text source yields an
                            empty or unusable document), so document boundaries are the records and the source
                            id is the directory
  NAME/shard-KKKKK.done     the shard's marker (written after the shard is renamed into place)

Shard k of a source holds its documents [k * shard_docs, (k + 1) * shard_docs). A killed run resumes: finished
shards (with a marker) are kept, a partial one is written again from the start (shards are written to a temporary
file and renamed). Rerunning with other settings or another tokenizer is refused, naming what changed. Shards are
independent tasks, run by the curation executors (worker processes, or Ray).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import logging
import os
import sys
import time
from typing import Sequence

import numpy as np

from data import files
from data import sources as sources_lib

log = logging.getLogger(__name__)

MANIFEST, SOURCE_INDEX, TOKENIZER_COPY = sources_lib.TOKEN_MANIFEST, sources_lib.TOKEN_SOURCE, "tokenizer.model"
VERSION = 1
_ENCODE_BATCH = 256  # documents encoded together (sentencepiece's batched encode)


def tokenizer_fingerprint(path: str) -> str:
  """sha256 (hex) of a tokenizer: the .model file's bytes, or a Hugging Face directory's tokenizer files."""
  h = hashlib.sha256()
  if os.path.isdir(path):
    names = sorted(n for n in os.listdir(path) if n.startswith("tokenizer") or n == "special_tokens_map.json")
    for name in names:
      h.update(name.encode())
      with open(os.path.join(path, name), "rb") as f:
        h.update(f.read())
  else:
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()


def _shard_name(k: int) -> str:
  return f"shard-{k:05d}.array_record"


def _atomic_json(path: str, value: dict) -> None:
  files.atomic_write(path, json.dumps(value, indent=1))


def encode_shard(spec: dict, tokenizer_path: str, text_field: str, strict: bool, start: int, stop: int,
                 directory: str, k: int) -> dict:
  """Tokenizes documents [start, stop) of one source into DIR/NAME/shard-k; returns {docs, tokens}."""
  from array_record.python import array_record_module  # lazy: only writers and readers of caches need it
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  tokenizer = tokenizer_lib.load(tokenizer_path)
  src = sources_lib.open_source(sources_lib.SourceSpec(**spec), text_field, strict)
  path = os.path.join(directory, _shard_name(k))
  for stale in glob.glob(f"{path}.tmp-*"):
    os.remove(stale)  # left by a killed attempt at this shard
  tmp = f"{path}.tmp-{os.getpid()}"
  writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
  tokens = 0
  try:
    for lo in range(start, stop, _ENCODE_BATCH):
      texts = [src[i] for i in range(lo, min(stop, lo + _ENCODE_BATCH))]
      usable = [i for i, t in enumerate(texts) if t and t.strip()]
      encoded = dict(zip(usable, _encode(tokenizer, [texts[i] for i in usable])))
      for i in range(len(texts)):
        ids = np.asarray(encoded.get(i, ()), "<i4")
        tokens += ids.size
        writer.write(ids.tobytes())
  finally:
    writer.close()
  os.replace(tmp, path)
  out = {"docs": stop - start, "tokens": int(tokens)}
  _atomic_json(os.path.join(directory, f"shard-{k:05d}.done"), out)
  return out


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
  batch = getattr(tokenizer, "encode_batch", None)
  return batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]


def _settings(specs, tokenizer_path: str, text_field: str, shard_docs: int) -> dict:
  return {"version": VERSION, "sources": [{"name": s.name, "kind": s.kind, "arg": s.arg, "weight": s.weight}
                                          for s in specs],
          "tokenizer_sha256": tokenizer_fingerprint(tokenizer_path), "text_field": text_field,
          "shard_docs": shard_docs}


def _check_or_start(output: str, settings: dict) -> None:
  """Refuses a directory holding a cache made with other settings (naming them); records the settings otherwise."""
  path = os.path.join(output, "settings.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if changed:
      what = ", ".join(changed).replace("tokenizer_sha256", "the tokenizer (another sha256)")
      raise ValueError(f"{output} holds a cache made with other {what}; use a new --output, or delete it to start "
                       "over")
  else:
    os.makedirs(output, exist_ok=True)
    _atomic_json(path, settings)


def _check_sources(specs) -> None:
  for s in specs:
    if sources_lib.is_chat_source(s) or sources_lib.is_preference_source(s):
      raise ValueError(f"source {s.name!r} ({s.kind}:{s.arg}) holds conversations or preference pairs, which the "
                       "pipeline renders with the chat template at load time; pretokenize text sources only and mix "
                       "the chat sources in beside the cache")
    if s.kind == "tokens":
      raise ValueError(f"source {s.name!r} is already a tokenized cache ({s.arg})")


def build(sources: str, tokenizer_path: str, output: str, *, text_field: str = "text", strict: bool = False,
          shard_docs: int = 4096, executor=None) -> dict:
  """Tokenizes every source of the mixture spec `sources` into `output` (resuming a partial cache); returns the
  manifest. `executor`: anything with `map(fn, args)` (data.curate.executors); None = this process."""
  if shard_docs < 1:
    raise ValueError(f"shard_docs must be >= 1, got {shard_docs}")
  if not os.path.exists(tokenizer_path):
    raise FileNotFoundError(f"tokenizer {tokenizer_path!r} does not exist; train one with python -m data.tokenizer "
                            "--output tok.model, or pass a run's WORKDIR/tokenizer.model")
  specs = sources_lib.parse_spec(sources)
  _check_sources(specs)
  settings = _settings(specs, tokenizer_path, text_field, shard_docs)
  _check_or_start(output, settings)
  if not os.path.isdir(tokenizer_path):
    files.atomic_write(os.path.join(output, TOKENIZER_COPY), files.read_bytes(tokenizer_path))
  t0 = time.time()
  jobs, layout = [], []
  for s in specs:
    directory = os.path.join(output, s.name)
    os.makedirs(directory, exist_ok=True)
    n = len(sources_lib.open_source(s, text_field, strict))
    bounds = [(k, lo, min(n, lo + shard_docs)) for k, lo in enumerate(range(0, n, shard_docs))]
    layout.append((s, directory, n, bounds))
    jobs += [(dataclasses.asdict(s), tokenizer_path, text_field, strict, lo, hi, directory, k) for k, lo, hi in bounds
             if not os.path.exists(os.path.join(directory, f"shard-{k:05d}.done"))]
  if executor is not None:
    executor.map(encode_shard, jobs)
  else:
    for job in jobs:
      encode_shard(*job)
  manifest = _write_indexes(output, settings, layout, tokenizer_path)
  log.info("tokenized %d shard(s) in %.1fs -> %s", len(jobs), time.time() - t0, output)
  return manifest


def _write_indexes(output: str, settings: dict, layout, tokenizer_path: str) -> dict:
  """NAME/source.json per source and DIR/manifest.json, from the shards' markers."""
  entries = []
  for s, directory, n, bounds in layout:
    shards = []
    for k, _, _ in bounds:
      with open(os.path.join(directory, f"shard-{k:05d}.done")) as f:
        shards.append({"file": _shard_name(k)} | json.load(f))
    entry = {"name": s.name, "kind": s.kind, "arg": s.arg, "weight": s.weight, "docs": n,
             "tokens": sum(x["tokens"] for x in shards), "shards": shards,
             "tokenizer_sha256": settings["tokenizer_sha256"]}
    _atomic_json(os.path.join(directory, SOURCE_INDEX), entry)
    entries.append({k: v for k, v in entry.items() if k not in ("shards", "tokenizer_sha256")} |
                   {"shards": len(shards)})
  from data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  manifest = {"version": VERSION, "complete": True, "sources": entries,
              "tokenizer": {"path": os.path.abspath(tokenizer_path), "sha256": settings["tokenizer_sha256"],
                            "vocab_size": tokenizer_lib.load(tokenizer_path).vocab_size},
              "text_field": settings["text_field"], "shard_docs": settings["shard_docs"]}
  _atomic_json(os.path.join(output, MANIFEST), manifest)
  return manifest


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m data.pretokenize", description=__doc__.split("\n\n")[0])
  p.add_argument("--sources", default="builtin", help="the mixture spec, as config.data.sources (text sources)")
  p.add_argument("--tokenizer", required=True, help="a tokenizer .model file (or a Hugging Face directory)")
  p.add_argument("--output", required=True, help="the cache directory (read with data.sources='tokens:DIR')")
  p.add_argument("--text_field", default="text", help="the JSONL / Parquet field holding the text")
  p.add_argument("--strict", action="store_true", help="a bad record fails the run instead of being skipped")
  p.add_argument("--shard_docs", type=int, default=4096, help="documents per shard (the unit of work and resume)")
  p.add_argument("--executor", default="local", choices=("local", "ray"))
  p.add_argument("--num_workers", type=int, default=0, help="local worker processes; 0 = one per core")
  p.add_argument("--ray_address", default="", help="a Ray cluster ('auto' joins a running one)")
  args = p.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(message)s")
  from data.curate import executors  # pylint: disable=g-import-not-at-top
  executor = executors.make_executor(args)
  try:
    manifest = build(args.sources, args.tokenizer, args.output, text_field=args.text_field, strict=args.strict,
                     shard_docs=args.shard_docs, executor=executor)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    executor.close()
  for s in manifest["sources"]:
    print(f"{s['name']}: {s['docs']:,} documents, {s['tokens']:,} tokens, {s['shards']} shard(s)")
  print(f"-> {args.output} (read it with --config.data.sources='tokens:{args.output}')")
  return 0


if __name__ == "__main__":
  sys.exit(main())
