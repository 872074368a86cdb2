"""The curation pipeline: three passes over the shards with two deterministic global steps between them.

  (every pass reads each shard through the URL filter, stage 0, so dropped pages take part in nothing)
  pass 1  (per shard)  paragraph hashes; MinHash signatures of each whole normalised document
                                                 -> _work/hashes/NNNNN.npz, _work/signatures/NNNNN.{npz,npy}
  global              near-duplicate documents (the earliest of each group survives), then paragraph dedup of
                      the survivors (first occurrence wins), both in shard order
                                                 -> _work/neardup/NNNNN.npy, _work/keep/NNNNN.npy
  pass 2  (per shard)  dedup, min length, decontamination, language, quality, perplexity, PII masking
                                                 -> _work/scored/NNNNN.jsonl (+ .npz)
  global              per-language perplexity cutoffs                  -> _work/global.json
  pass 3  (per shard)  apply the decisions in stage order, bucket     -> DIR/<lang>/<bucket>/part-NNNNN.jsonl

Near duplicates are decided on whole documents before any paragraph is removed (the order of RefinedWeb and
datatrove): a near copy shares most paragraphs with its original, and once paragraph dedup has taken those, the
remnant no longer resembles the original document.

Every per-shard result is written to a temporary file and renamed, then a marker `_work/<pass>/NNNNN.done`
(holding the shard's stage counts) is written; a re-run skips shards with a marker, so a crash loses no finished
work and leaves no partial or duplicated output. The global steps depend only on shard order, so the output is
identical for any executor and worker count.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
import types

import ml_collections
import numpy as np

from data import files as datafiles
from data.curate import contamination
from data.curate import dedup
from data.curate import executors
from data.curate import minhash
from data.curate import perplexity as ppl
from data.curate import pii
from data.curate import quality
from data.curate import stats as statslib
from data.curate import urls
from data.curate import text as textlib

log = logging.getLogger(__name__)

WORK = "_work"
_BATCH = 256  # documents scored together (perplexity is vectorised over a batch)
# Keys that change how the run executes, not what it outputs: a re-run may change them.
_EXECUTION_KEYS = ("executor", "num_workers", "ray_address", "input", "output")
# What json.dumps(doc, ensure_ascii=False) builds on every call, built once.
_JSON_LINE = json.JSONEncoder(ensure_ascii=False)


def _atomic_save(path: str, array: np.ndarray) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}.npy"
  np.save(tmp, array)
  os.replace(tmp, path)


def _atomic_savez(path: str, **arrays: np.ndarray) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    np.savez(f, **arrays)
  os.replace(tmp, path)


def _marker(work: str, step: str, shard: int) -> str:
  return os.path.join(work, step, f"{shard:05d}.done")


def _done(work: str, step: str, shard: int) -> bool:
  return os.path.exists(_marker(work, step, shard))


def _mark(work: str, step: str, shard: int, payload: dict) -> dict:
  datafiles.atomic_write(_marker(work, step, shard), json.dumps(payload))
  return payload


def _read_marker(work: str, step: str, shard: int) -> dict:
  with open(_marker(work, step, shard)) as f:
    return json.load(f)


def _config(cfg_dict: dict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(cfg_dict)


def _docs(cfg, path: str, report: bool = True, problems: datafiles.Problems | None = None, on_drop=None):
  """The shard's documents after the URL filter (stage 0; the same in every pass); `on_drop(doc, reason)` sees
  the ones it drops."""
  docs = datafiles.read_documents(path, cfg.input_format, text_mode=cfg.text_mode, id_field=cfg.id_field,
                                  text_field=cfg.text_field, strict=cfg.strict, problems=problems, report=report)
  url_filter = urls.from_config(cfg)
  if url_filter is None:
    yield from docs
    return
  for doc in docs:
    reason = url_filter.reason(doc["url"]) if isinstance(doc.get("url"), str) and doc["url"] else ""
    if not reason:
      yield doc
    elif on_drop is not None:
      on_drop(doc, reason)


# ---------------------------------------------------------------------------------------------- pass 1
def hash_shard(cfg_dict: dict, path: str, shard: int, work: str) -> dict:
  """Pass 1: per document, the uint64 hashes of its paragraphs (in order), their number, a hash of the whole
  normalised document and, with MinHash on, the signature of the whole normalised document and its band hashes."""
  cfg = _config(cfg_dict)
  hasher = _hasher(cfg)
  parts, signatures, bands = [], [], []
  batch: list[str] = []

  def flush():
    if batch and hasher is not None:
      signatures.append(hasher.signatures(batch))
      bands.append(hasher.band_hashes(signatures[-1]))
    batch.clear()

  for doc in _docs(cfg, path, report=False):  # pass 2 reads the shard again and reports its problems
    parts.append(textlib.paragraph_hashes(doc["text"]))
    batch.append(doc["text"])
    if len(batch) >= _BATCH:
      flush()
  flush()
  hashes = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
  counts = np.array([p.size for p in parts], np.int64)
  _atomic_savez(os.path.join(work, "hashes", f"{shard:05d}.npz"), hashes=hashes, counts=counts,
                documents=np.array([dedup.document_hash(p) for p in parts], np.uint64))
  if hasher is not None:
    num_perm = hasher.bands * hasher.rows
    _atomic_save(os.path.join(work, "signatures", f"{shard:05d}.npy"),
                 np.concatenate(signatures or [np.zeros((0, num_perm), np.uint32)]))
    _atomic_savez(os.path.join(work, "signatures", f"{shard:05d}.npz"),
                  bands=np.concatenate(bands or [np.zeros((0, hasher.bands), np.uint64)]))
  return _mark(work, "hash", shard, {"documents": len(parts), "paragraphs": int(hashes.size)})


def _hasher(cfg) -> minhash.MinHasher | None:
  if not cfg.minhash.enabled:
    return None
  return minhash.MinHasher(cfg.minhash.shingle_size, cfg.minhash.bands, cfg.minhash.rows, cfg.minhash.seed)


# ---------------------------------------------------------------------------------------------- pass 2
def score_shard(cfg_dict: dict, path: str, shard: int, work: str, models: dict) -> dict:
  """Pass 2: per document, the near-duplicate verdict of the global step (stage 1), paragraph dedup and min length
  (stages 2-3), decontamination (stage 4), then for the survivors the language, quality verdict, perplexity and PII masking, written to
  _work/scored/NNNNN.jsonl."""
  cfg = _config(cfg_dict)
  from data.curate import langid  # fastText loads only where it is used
  identifier = langid.LanguageIdentifier(cfg.langid.model) if cfg.langid.enabled else None
  scorer = ppl.Scorer(models) if cfg.perplexity.enabled else None
  keep = np.load(os.path.join(work, "keep", f"{shard:05d}.npy")) if cfg.dedup.enabled else None
  keep_flags = keep.tolist() if keep is not None else None  # list slices per document: cheaper than numpy ones
  near = (np.load(os.path.join(work, "neardup", f"{shard:05d}.npy")).tolist() if cfg.minhash.enabled else None)
  counter = statslib.StageCounter()
  # Per scored document, in order: the decisions pass 3 applies (the JSON lines carry only the output record).
  meta = {"language": [], "language_ok": [], "quality": [], "perplexity": [], "chars": [], "chars_out": [],
          "quality_score": []}
  rater = _quality_scorer(cfg.quality_model.model) if cfg.quality_model.model else None
  # Plain attribute objects: ConfigDict look-ups in the per-document loops cost more than the rules themselves.
  quality_cfg = types.SimpleNamespace(**cfg.quality.to_dict()) if cfg.quality.enabled else None
  pii_cfg = types.SimpleNamespace(**cfg.pii.to_dict()) if cfg.pii.enabled else None
  min_length = cfg.dedup.min_length if cfg.dedup.enabled else 0
  index = (contamination.cached_index(cfg.decontaminate.tasks, cfg.decontaminate.min_n, cfg.decontaminate.max_n)
           if cfg.decontaminate.tasks else None)
  contaminated: dict[str, list[int]] = {}  # per task: [documents, n-gram occurrences]
  threshold, languages = cfg.langid.threshold, frozenset(cfg.langid.languages)
  out_path = os.path.join(work, "scored", f"{shard:05d}.jsonl")
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  tmp = f"{out_path}.tmp-{os.getpid()}"
  offset = 0
  problems = datafiles.Problems()
  url_reasons: dict[str, int] = {}
  url_on = cfg.url_filter.enabled

  def url_dropped(doc, reason):
    counter.add("read", "und", len(doc["text"]), len(doc["text"]))
    counter.add("url_filter", "und", len(doc["text"]), None)
    url_reasons[reason] = url_reasons.get(reason, 0) + 1

  with open(tmp, "w", encoding="utf-8") as out:
    batch: list[dict] = []
    for i, doc in enumerate(_docs(cfg, path, problems=problems, on_drop=url_dropped)):
      text = doc["text"]
      n = text.count("\n") + 1
      if near is not None and near[i]:
        offset += n
        # Identified only for the per-language counts (near duplicates are a few percent of a crawl).
        lang = identifier.identify(text)[0] if identifier is not None else "und"
        counter.add("read", lang, len(text), len(text))
        if url_on:
          counter.add("url_filter", lang, len(text), len(text))
        counter.add("minhash", lang, len(text), None)
        continue
      if keep is not None:
        deduped = dedup.apply_keep(text, keep_flags[offset:offset + n])
      else:
        deduped = text
      offset += n
      stripped = deduped.strip("\n")
      blank = not stripped.strip()
      if identifier is not None:
        lang, score = identifier.identify(text if blank else stripped)
      else:
        lang, score = "und", 0.0
      counter.add("read", lang, len(text), len(text))
      if url_on:
        counter.add("url_filter", lang, len(text), len(text))
      if near is not None:
        counter.add("minhash", lang, len(text), len(text))
      counter.add("paragraph_dedup", lang, len(text), None if blank else len(stripped))
      if blank:
        continue
      long_enough = textlib.utf8_length(stripped) >= min_length
      counter.add("min_length", lang, len(stripped), len(stripped) if long_enough else None)
      if not long_enough:
        continue
      if index is not None and _contaminated(index, cfg.decontaminate.action, doc, stripped, lang, counter,
                                             contaminated):
        continue
      doc["text"] = stripped
      doc["language"], doc["language_score"] = lang, round(score, 4)
      lang_ok = identifier is None or (score >= threshold and (not languages or lang in languages))
      # Later stages see only what passed the earlier ones (applied in pass 3), so skip work on the rest.
      reason = quality.check(stripped, lang, quality_cfg) if quality_cfg is not None and lang_ok else None
      meta["language"].append(lang)
      meta["language_ok"].append(lang_ok)
      meta["quality"].append(reason or "")
      meta["chars"].append(len(stripped))
      batch.append({"doc": doc, "quality": reason, "language_ok": lang_ok})
      if len(batch) >= _BATCH:
        _flush(batch, scorer, pii_cfg, out, meta, rater)
        batch = []
    _flush(batch, scorer, pii_cfg, out, meta, rater)
  expected = keep.size if keep is not None else None
  if expected is not None and offset != expected:
    raise ValueError(f"{path}: {offset} paragraphs read but pass 1 hashed {expected}; the input changed during "
                     "the run: delete the output directory and start again")
  os.replace(tmp, out_path)
  _save_meta(work, shard, meta)
  return _mark(work, "score", shard, {"stages": counter.to_dict(), "input_problems": problems.to_dict(),
                                      "contamination": contaminated, "url_reasons": url_reasons})


def _contaminated(index, action: str, doc: dict, text: str, lang: str, counter, tally: dict) -> bool:
  """The decontamination stage on one document: counts its hits per task; True when it is dropped."""
  hits = index.match(text)
  for name, hit in hits.items():
    row = tally.setdefault(name, [0, 0])
    row[0] += 1
    row[1] += hit.ngrams
  drop = bool(hits) and action == "drop"
  counter.add("decontaminate", lang, len(text), None if drop else len(text))
  if hits and not drop:
    doc["contamination"] = sorted(hits)
  return drop


def _save_meta(work: str, shard: int, meta: dict) -> None:
  """_work/scored/NNNNN.npz: the per-document decisions pass 3 applies."""
  _atomic_savez(os.path.join(work, "scored", f"{shard:05d}.npz"),
                language=np.array(meta["language"], dtype=str),
                language_ok=np.array(meta["language_ok"], bool),
                quality=np.array(meta["quality"], dtype=str),
                perplexity=np.array(meta["perplexity"], np.float64),
                quality_score=np.array(meta["quality_score"], np.float64),
                chars=np.array(meta["chars"], np.int64),
                chars_out=np.array(meta["chars_out"], np.int64))


def _quality_scorer(path: str):
  # Imported here: `python -m data.curate.classifier` runs that module as __main__, which an import at the top of
  # this module (loaded by the data.curate package) would already have imported under its own name.
  from data.curate import classifier  # pylint: disable=g-import-not-at-top
  return classifier.Scorer(path)


def _flush(batch: list[dict], scorer, pii_cfg, out, meta: dict, rater=None) -> None:
  """Perplexity for a batch (grouped by language), the quality model's score, PII masking, then one JSON line per
  document: the output record without its bucket."""
  if not batch:
    return
  values, rated = np.full(len(batch), np.nan), np.full(len(batch), np.nan)
  survivors = [i for i, item in enumerate(batch) if item["language_ok"] and item["quality"] is None]
  if scorer is not None:
    by_lang: dict[str, list[int]] = {}
    for i in survivors:
      by_lang.setdefault(batch[i]["doc"]["language"], []).append(i)
    for lang, idx in by_lang.items():
      values[idx] = scorer.perplexities([batch[i]["doc"]["text"] for i in idx], lang)
  if rater is not None and survivors:
    rated[survivors] = rater.scores([batch[i]["doc"]["text"] for i in survivors])
  for item, value, score in zip(batch, values, rated):
    doc = item["doc"]
    doc["perplexity"] = None if np.isnan(value) else round(float(value), 2)
    meta["perplexity"].append(np.nan if doc["perplexity"] is None else doc["perplexity"])
    if rater is not None:
      doc["quality_score"] = None if np.isnan(score) else round(float(score), 4)
    meta["quality_score"].append(score)
    if pii_cfg is not None:
      doc["text"], _ = pii.mask(doc["text"], pii_cfg)
    meta["chars_out"].append(len(doc["text"]))
    out.write(_JSON_LINE.encode(doc) + "\n")


# ---------------------------------------------------------------------------------------------- pass 3
def write_shard(cfg_dict: dict, shard: int, work: str, output: str, cutoffs: dict) -> dict:
  """Pass 3: the stage decisions in order (language, quality), the perplexity bucket, and the
  output files DIR/<lang>/<bucket>/part-NNNNN.jsonl (all renamed into place only when complete)."""
  cfg = _config(cfg_dict)
  name = f"part-{shard:05d}.jsonl"
  for pattern in (name, name + ".tmp-*"):
    for stale in glob.glob(os.path.join(output, "*", "*", pattern)):
      os.remove(stale)  # left by an attempt that crashed between renames
  # Lists: indexing a numpy array per line returns numpy scalars, several times slower.
  with np.load(os.path.join(work, "scored", f"{shard:05d}.npz")) as z:
    meta = {k: z[k].tolist() for k in ("language", "language_ok", "quality", "perplexity", "chars", "chars_out",
                                       "quality_score")}
  counter = statslib.StageCounter()
  files: dict[tuple[str, str], object] = {}
  written: dict[str, dict[str, list[int]]] = {}
  reasons: dict[str, int] = {}
  nan = float("nan")
  # Plain locals: ConfigDict look-ups per line cost more than the rest of the loop.
  langid_on, quality_on = cfg.langid.enabled, cfg.quality.enabled
  perplexity_on, pii_on = cfg.perplexity.enabled, cfg.pii.enabled
  rated_on, threshold = bool(cfg.quality_model.model), cfg.quality_model.threshold
  try:
    with open(os.path.join(work, "scored", f"{shard:05d}.jsonl"), encoding="utf-8") as f:
      for i, line in enumerate(f):
        lang, n, reason = meta["language"][i], meta["chars"][i], meta["quality"][i]
        if langid_on:
          counter.add("langid", lang, n, n if meta["language_ok"][i] else None)
          if not meta["language_ok"][i]:
            continue
        if quality_on:
          counter.add("quality", lang, n, None if reason else n)
          if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
            continue
        if rated_on:
          good = meta["quality_score"][i] >= threshold
          counter.add("quality_model", lang, n, n if good else None)
          if not good:
            continue
        bucket = ppl.bucket(meta["perplexity"][i], cutoffs.get(lang, (nan, nan)))
        if perplexity_on:
          counter.add("perplexity", lang, n, n)
        if pii_on:
          counter.add("pii", lang, n, meta["chars_out"][i])
        key = (lang, bucket)
        if key not in files:
          directory = os.path.join(output, lang, bucket)
          os.makedirs(directory, exist_ok=True)
          files[key] = open(os.path.join(directory, f"{name}.tmp-{os.getpid()}"), "w", encoding="utf-8")
        # The line is the JSON object json.dumps wrote in pass 2: add the bucket before its closing brace.
        files[key].write(f'{line.rstrip()[:-1]}, "bucket": "{bucket}"}}\n')
        cell = written.setdefault(lang, {}).setdefault(bucket, [0, 0])
        cell[0] += 1
        cell[1] += meta["chars_out"][i]
  finally:
    for handle in files.values():
      handle.close()
  for lang, bucket in files:
    directory = os.path.join(output, lang, bucket)
    os.replace(os.path.join(directory, f"{name}.tmp-{os.getpid()}"), os.path.join(directory, name))
  return _mark(work, "write", shard, {"stages": counter.to_dict(), "output": written, "quality_reasons": reasons})


# ---------------------------------------------------------------------------------------------- global steps
def _resolve_near_duplicates(cfg, work: str, num_shards: int) -> tuple[dict, list[np.ndarray]]:
  """Global MinHash step on whole documents: writes _work/neardup/NNNNN.npy (bool per document) and returns
  (counts, the per-shard drop flags). Exact copies of an earlier document (the same normalised paragraphs) are
  counted apart from the other near duplicates. Memory: the whole-document hashes (8 bytes per document) and one
  band of one shard at a time, the band's hashes gathered over the shards (16 bytes per document, or spilled to
  partition files above minhash.max_rows_in_memory documents)."""
  documents = []
  for s in range(num_shards):
    with np.load(os.path.join(work, "hashes", f"{s:05d}.npz")) as z:
      documents.append(z["documents"])
  sizes = [d.size for d in documents]
  document_hashes = np.concatenate(documents) if documents else np.zeros(0, np.uint64)
  # A document without a word (hash 0: every paragraph normalises to nothing) has no shingle to compare.
  valid = document_hashes != 0
  offsets = np.cumsum([0] + sizes)
  # Signatures stay on disk (memory-mapped): only candidate pairs' rows are read.
  signatures = [np.load(os.path.join(work, "signatures", f"{s:05d}.npy"), mmap_mode="r")
                for s in range(num_shards)]

  def band(b: int):
    for s in range(num_shards):
      with np.load(os.path.join(work, "signatures", f"{s:05d}.npz")) as z:
        column = z["bands"][:, b]
      keep = np.flatnonzero(valid[offsets[s]:offsets[s + 1]])
      yield column[keep], keep + offsets[s]

  def rows(index: np.ndarray) -> np.ndarray:
    shard = np.searchsorted(offsets, index, side="right") - 1
    out = np.empty((index.size, cfg.minhash.bands * cfg.minhash.rows), np.uint32)
    for s in np.unique(shard):
      mask = shard == s
      out[mask] = signatures[s][index[mask] - offsets[s]]
    return out

  drop = minhash.resolve(band, rows, cfg.minhash.threshold, valid, bands=cfg.minhash.bands,
                         num_docs=int(document_hashes.size), spill_dir=os.path.join(work, "band_spill"),
                         max_rows=cfg.minhash.max_rows_in_memory)
  _, first, inverse = np.unique(document_hashes, return_index=True, return_inverse=True)
  exact = drop & (first[inverse.ravel()] != np.arange(drop.size))
  per_shard = np.split(drop, offsets[1:-1])
  for s, flags in enumerate(per_shard):
    _atomic_save(os.path.join(work, "neardup", f"{s:05d}.npy"), flags)
  return {"documents": int(drop.size), "duplicates": int(drop.sum()), "exact_duplicates": int(exact.sum()),
          "near_duplicates": int(drop.sum() - exact.sum())}, per_shard


def _resolve_paragraphs(cfg, work: str, num_shards: int, near: list[np.ndarray] | None) -> dict:
  """Global paragraph step over the documents that are not near duplicates: writes _work/keep/NNNNN.npy."""
  seen = dedup.make_hash_set(cfg.dedup.hash_set, cfg.dedup.bloom_expected, cfg.dedup.bloom_error_rate)

  def load(s: int) -> tuple[np.ndarray, np.ndarray]:
    with np.load(os.path.join(work, "hashes", f"{s:05d}.npz")) as z:
      hashes, counts = z["hashes"], z["counts"]
    survives = np.repeat(~near[s], counts) if near is not None else np.ones(hashes.size, bool)
    return hashes, survives

  return dedup.resolve_paragraphs(load, num_shards, seen,
                                  lambda s, keep: _atomic_save(os.path.join(work, "keep", f"{s:05d}.npy"), keep))


def _perplexity_cutoffs(cfg, work: str, num_shards: int) -> dict:
  """Per language: (head, tail) perplexity cutoffs over the documents that survive every filter."""
  by_lang: dict[str, list[np.ndarray]] = {}
  for s in range(num_shards):
    with np.load(os.path.join(work, "scored", f"{s:05d}.npz")) as z:
      survive = (z["quality"] == "") | (not cfg.quality.enabled)
      if cfg.langid.enabled:
        survive &= z["language_ok"]
      for lang in np.unique(z["language"][survive]):
        by_lang.setdefault(str(lang), []).append(z["perplexity"][survive & (z["language"] == lang)])
  out = {}
  for lang, values in sorted(by_lang.items()):
    cut = ppl.cutoffs(np.concatenate(values), cfg.perplexity.head_percentile, cfg.perplexity.tail_percentile)
    if cut[0] == cut[0]:  # languages without a model (NaN perplexities) get no cutoffs: bucket "all"
      out[lang] = cut
  return out


# ---------------------------------------------------------------------------------------------- driver
def _fingerprint(cfg, files: list[str]) -> dict:
  settings = {k: v for k, v in cfg.to_dict().items() if k not in _EXECUTION_KEYS}
  inputs = [[f, datafiles.size(f)] for f in files]
  return json.loads(json.dumps({"settings": settings, "inputs": inputs}))


def _check_manifest(work: str, manifest: dict) -> None:
  path = os.path.join(work, "manifest.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old != manifest:
      what = "input files" if old.get("inputs") != manifest["inputs"] else "settings " + ", ".join(
          sorted(k for k in set(old["settings"]) | set(manifest["settings"])
                 if old["settings"].get(k) != manifest["settings"].get(k)))
      raise ValueError(f"{os.path.dirname(work)} holds an unfinished or finished run with different {what}; "
                       "use a new --output directory, or delete this one to start over")
  else:
    datafiles.atomic_write(path, json.dumps(manifest, indent=1))


def validate(cfg) -> None:
  """Clear errors for settings that cannot work, before anything runs."""
  if not cfg.output:
    raise ValueError("no output directory: pass --output DIR")
  choices = {"input_format": ("auto",) + datafiles.FORMATS, "text_mode": datafiles.TEXT_MODES,
             "executor": ("local", "ray"), "dedup.hash_set": ("exact", "bloom"),
             "perplexity.smoothing": ("kneser_ney", "stupid_backoff")}
  for key, allowed in choices.items():
    value = cfg
    for part in key.split("."):
      value = value[part]
    if value not in allowed:
      raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")
  if cfg.minhash.enabled and not 0 < cfg.minhash.threshold <= 1:
    raise ValueError(f"minhash.threshold must be in (0, 1]; got {cfg.minhash.threshold}")
  if cfg.langid.enabled and not 0 <= cfg.langid.threshold <= 1:
    raise ValueError(f"langid.threshold must be in [0, 1]; got {cfg.langid.threshold}")
  if cfg.decontaminate.action not in ("drop", "report"):
    raise ValueError(f"decontaminate.action={cfg.decontaminate.action!r} is not one of drop, report")
  if cfg.url_filter.enabled:
    for key in ("blocklist", "banned_words_file"):
      if cfg.url_filter[key] and not os.path.exists(cfg.url_filter[key]):
        raise FileNotFoundError(f"url_filter.{key}={cfg.url_filter[key]!r} does not exist")
  if cfg.quality_model.model:
    if not 0 <= cfg.quality_model.threshold <= 1:
      raise ValueError(f"quality_model.threshold must be in [0, 1]; got {cfg.quality_model.threshold}")
    _quality_scorer(cfg.quality_model.model)  # a missing or wrong model fails here, before any pass
  if cfg.decontaminate.tasks:
    contamination.load_index(cfg.decontaminate.tasks, cfg.decontaminate.min_n, cfg.decontaminate.max_n)
  if cfg.perplexity.enabled:
    ppl.cutoffs(np.zeros(0), cfg.perplexity.head_percentile, cfg.perplexity.tail_percentile)


def _run_pass(executor, work: str, step: str, num_shards: int, fn, make_args) -> None:
  todo = [s for s in range(num_shards) if not _done(work, step, s)]
  if todo:
    t0 = time.time()
    executor.map(fn, [make_args(s) for s in todo])
    log.info("%s: %d shards in %.1fs", step, len(todo), time.time() - t0)


def run(cfg: ml_collections.ConfigDict, executor=None) -> dict:
  """Runs (or resumes) the whole pipeline; returns the stats also written to DIR/stats.json and DIR/stats.md.

  `executor`: anything with `map(fn, args)` and `close()` (`executors.LocalExecutor`, `RayExecutor`); by default
  one made from the config and closed at the end."""
  validate(cfg)
  notices = []
  if cfg.perplexity.enabled and not ppl.reference_groups(cfg.perplexity.reference) and not cfg.perplexity.arpa:
    # A model trained on the input itself would rank documents by how typical they are of the crawl, raising its
    # most repeated boilerplate to the head: the opposite of CCNet's "close to Wikipedia". So no model: skip.
    notices.append("perplexity stage skipped: no perplexity.reference (or perplexity.arpa) is given, so every "
                   "document goes to bucket 'all'; give a reference corpus such as a Wikipedia dump, e.g. "
                   "--config.perplexity.reference=\"('en=wiki/en/*.txt',)\" (see docs/curation.md)")
    log.warning(notices[-1])
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.perplexity.enabled = False
  if not cfg.input:
    raise ValueError("no input given: pass --input GLOB (e.g. --input 'crawl/*.jsonl')")
  files = datafiles.expand(cfg.input, "input")
  output = os.path.abspath(cfg.output)
  work = os.path.join(output, WORK)
  os.makedirs(work, exist_ok=True)
  _check_manifest(work, _fingerprint(cfg, files))
  own_executor = executor is None
  executor = executor or executors.make_executor(cfg)
  try:
    return _run(cfg, executor, files, output, work, notices)
  finally:
    if own_executor:
      executor.close()


def _run(cfg, executor, files: list[str], output: str, work: str, notices: list[str]) -> dict:
  cfg_dict = cfg.to_dict()
  n = len(files)
  extra: dict = {"notices": notices, "input_files": n}

  models: dict = {}
  if cfg.perplexity.enabled:
    models_path = os.path.join(work, "lm", "models.json")
    if not os.path.exists(models_path):
      models = ppl.train_models(cfg.perplexity, os.path.join(work, "lm"))
      datafiles.atomic_write(models_path, json.dumps(models))
    with open(models_path) as f:
      models = json.load(f)

  if cfg.dedup.enabled or cfg.minhash.enabled:
    _run_pass(executor, work, "hash", n, hash_shard, lambda s: (cfg_dict, files[s], s, work))
    resolved = os.path.join(work, "keep", "resolved.json")
    if not os.path.exists(resolved):
      info, near = {}, None
      if cfg.minhash.enabled:
        info["minhash"], near = _resolve_near_duplicates(cfg, work, n)
      if cfg.dedup.enabled:
        info["paragraph_dedup"] = _resolve_paragraphs(cfg, work, n, near)
      datafiles.atomic_write(resolved, json.dumps(info))
    with open(resolved) as f:
      extra.update(json.load(f))

  _run_pass(executor, work, "score", n, score_shard, lambda s: (cfg_dict, files[s], s, work, models))

  global_path = os.path.join(work, "global.json")
  if not os.path.exists(global_path):
    cutoffs = _perplexity_cutoffs(cfg, work, n) if cfg.perplexity.enabled else {}
    datafiles.atomic_write(global_path, json.dumps({"cutoffs": cutoffs}))
  with open(global_path) as f:
    info = json.load(f)
  extra.update(info)

  _run_pass(executor, work, "write", n, write_shard, lambda s: (cfg_dict, s, work, output, info["cutoffs"]))
  summary = _summarise(work, n, extra)
  datafiles.atomic_write(os.path.join(output, "stats.json"), json.dumps(summary, indent=1, ensure_ascii=False))
  datafiles.atomic_write(os.path.join(output, "stats.md"), statslib.table(summary))
  return summary


def _summarise(work: str, n: int, extra: dict) -> dict:
  """Adds up the shards' markers (in shard order) into the stats.json object."""
  counter = statslib.StageCounter()
  output_counts: dict = {}
  reasons: dict = {}
  problems: dict = {}
  contaminated: dict = {}
  url_reasons: dict = {}
  for s in range(n):
    scored, written = _read_marker(work, "score", s), _read_marker(work, "write", s)
    for reason, count in scored.get("url_reasons", {}).items():
      url_reasons[reason] = url_reasons.get(reason, 0) + count
    for name, (docs, ngrams) in scored.get("contamination", {}).items():
      row = contaminated.setdefault(name, {"documents": 0, "ngrams": 0})
      row["documents"] += docs
      row["ngrams"] += ngrams
    counter.merge(statslib.StageCounter(scored["stages"]))
    for kind, count in scored["input_problems"].items():
      problems[kind] = problems.get(kind, 0) + count
    counter.merge(statslib.StageCounter(written["stages"]))
    for reason, count in written["quality_reasons"].items():
      reasons[reason] = reasons.get(reason, 0) + count
    for lang, by_bucket in written["output"].items():
      for bucket, (docs, chars) in by_bucket.items():
        cell = output_counts.setdefault(lang, {}).setdefault(bucket, {"docs": 0, "chars": 0})
        cell["docs"] += docs
        cell["chars"] += chars
  extra["quality_reasons"] = dict(sorted(reasons.items()))
  extra["input_problems"] = dict(sorted(problems.items()))
  extra["contamination"] = dict(sorted(contaminated.items()))
  extra["url_filter_reasons"] = dict(sorted(url_reasons.items()))
  return statslib.summarise(counter, {k: output_counts[k] for k in sorted(output_counts)}, extra)
