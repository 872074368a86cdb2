"""Curation stages 1-3: normalisation, exact paragraph deduplication across shards, MinHash near duplicates."""
import json
import os
import random

import numpy as np
import pytest

from configs import curate as curate_config
from data.curate import dedup
from data.curate import minhash
from data.curate import pipeline
from data.curate import text as textlib

WORDS = ("the river town market winter garden old bridge quiet morning rain bakery bread window street teacher "
         "children school lesson story night lamp harbour boat fisher net salt wind hill farm cow field summer "
         "evening song village church bell clock square tower museum painting artist colour light shadow road "
         "travel train station ticket journey mountain snow forest path deer fox owl letter friend neighbour door "
         "kitchen soup apple pear honey tea cup chair table book page word library reader writer poem ink paper "
         "stone wall castle king queen soldier horse cart wheel mill flour water well bucket rope ladder roof "
         "chimney smoke fire candle dinner guest music dance festival crowd flag parade drum voice laughter").split()


def _line(rng, n=60):
  return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def _doc(rng, lines=3):
  return "\n".join(_line(rng) for _ in range(lines))


def _shingle_jaccard(a, b, k=5):
  def shingles(t):
    w = textlib.words(textlib.normalize_for_hash(t))
    return {tuple(w[i:i + k]) for i in range(len(w) - k + 1)}
  sa, sb = shingles(a), shingles(b)
  return len(sa & sb) / len(sa | sb)


def test_normalize_for_hash_follows_ccnet():
  assert textlib.normalize_for_hash("  Café au LAIT, 2 euros 50!  ") == "cafe au lait 0 euros 00"
  assert textlib.normalize_for_hash("«Über» — Straße №7…") == "uber straße №0"
  assert textlib.normalize_for_hash("...!!!") == ""
  # Lines that differ only in case, accents, digits and punctuation hash the same; others do not.
  h = textlib.paragraph_hashes("Hello, World 1!\nhello world 7\nHéllo wörld 3\nhello world again\n---")
  assert h[0] == h[1] == h[2] != h[3] and h[4] == 0


def test_words_split_spaceless_scripts():
  assert textlib.words("猫が好きです and dogs") == ["猫", "が", "好", "き", "で", "す", "and", "dogs"]
  assert textlib.words("plain ascii  words") == ["plain", "ascii", "words"]


@pytest.mark.parametrize("kind", ["exact", "bloom"])
def test_keep_mask_matches_first_occurrence_reference(kind):
  rng = np.random.default_rng(0)
  shards = [rng.integers(0, 300, size=200).astype(np.uint64) for _ in range(4)]  # 0 = "no hash": always kept
  seen = dedup.make_hash_set(kind, expected=10_000, error_rate=1e-9)
  reference_seen = set()
  for hashes in shards:
    keep = dedup.keep_mask(hashes, seen)
    expected = []
    for h in hashes.tolist():
      expected.append(h == 0 or h not in reference_seen)
      if h:
        reference_seen.add(h)
    assert keep.tolist() == expected


def test_sorted_hash_set_membership_and_memory():
  rng = np.random.default_rng(1)
  s = dedup.SortedHashSet()
  added = set()
  for _ in range(20):
    batch = rng.integers(0, 2**63, size=1000, dtype=np.uint64)
    s.add(batch)
    added.update(batch.tolist())
  probe = np.concatenate([np.array(sorted(added)[:500], np.uint64), rng.integers(0, 2**63, size=500, dtype=np.uint64)])
  assert s.contains(probe).tolist() == [int(x) in added for x in probe.tolist()]
  assert s.nbytes == 8 * len(added)


def test_bloom_filter_has_no_false_negatives_and_few_false_positives():
  rng = np.random.default_rng(2)
  bloom = dedup.BloomFilter(expected=20_000, error_rate=1e-3)
  members = rng.integers(1, 2**64 - 1, size=20_000, dtype=np.uint64)
  bloom.add(members)
  assert bloom.contains(members).all()
  others = rng.integers(1, 2**64 - 1, size=50_000, dtype=np.uint64)
  assert bloom.contains(others).mean() < 3e-3
  assert bloom.nbytes == pytest.approx(20_000 * 1.8, rel=0.05)  # -ln(1e-3)/ln(2)^2 = 14.4 bits per item


def test_minhash_estimates_jaccard():
  rng = random.Random(3)
  hasher = minhash.MinHasher(shingle_size=5, bands=32, rows=8, seed=0)
  base = _doc(rng, lines=5)
  variant = base.replace(".", " extra words here.", 2)
  other = _doc(rng, lines=5)
  est = lambda a, b: (hasher.signature(a) == hasher.signature(b)).mean()  # noqa: E731
  assert abs(est(base, variant) - _shingle_jaccard(base, variant)) < 0.1
  assert est(base, other) < 0.1


def _write_corpus(tmp_path):
  """Four shards of unique random documents with planted duplicates; returns the ids that must survive."""
  rng = random.Random(0)
  shards = [[(f"s{s}-u{i}", _doc(rng)) for i in range(12)] for s in range(4)]
  expect = {doc_id for shard in shards for doc_id, _ in shard}
  a, b, c = shards[0][0][1], shards[1][3][1], shards[2][5][1]
  # Exact copies (different ids, one with changed case/digits/punctuation, which normalisation ignores).
  shards[0].insert(6, ("exact-same-shard", a))
  shards[3].insert(2, ("exact-later-shard", b))
  shards[2].insert(0, ("exact-normalised", b.upper().replace(".", "!")))
  # Near copies: a word appended to every line, so no line is an exact duplicate.
  near = "\n".join(line[:-1] + " too." for line in c.split("\n"))
  shards[3].append(("near-copy", near))
  near_first = "\n".join(line[:-1] + " again." for line in a.split("\n"))
  shards[1].append(("near-copy-of-first", near_first))
  # A document that shares one line with another keeps its other lines and survives.
  shared = shards[0][1][1].split("\n")[0] + "\n" + _line(rng) + "\n" + _line(rng)
  shards[2].append(("shares-one-line", shared))
  expect.add("shares-one-line")
  for s, docs in enumerate(shards):
    with open(tmp_path / f"in-{s}.jsonl", "w") as f:
      for doc_id, text in docs:
        f.write(json.dumps({"id": doc_id, "text": text, "source": f"shard{s}"}) + "\n")
  assert _shingle_jaccard(c, near) > 0.85 and _shingle_jaccard(a, near_first) > 0.85
  return expect, shards


def _config(tmp_path, **changes):
  cfg = curate_config.get_config()
  cfg.input = str(tmp_path / "in-*.jsonl")
  cfg.output = str(tmp_path / "out")
  cfg.num_workers = 1
  cfg.dedup.min_length = 100
  cfg.langid.enabled = cfg.quality.enabled = cfg.perplexity.enabled = False
  for key, value in changes.items():
    section, name = key.split(".")
    cfg[section][name] = value
  return cfg


def _outputs(out_dir):
  records = []
  for root, _, files in sorted(os.walk(out_dir)):
    if "_work" in root:
      continue
    for name in sorted(files):
      if name.endswith(".jsonl"):
        with open(os.path.join(root, name)) as f:
          records += [json.loads(line) for line in f]
  return records


def test_planted_duplicates_are_removed_and_nothing_else(tmp_path):
  expect, shards = _write_corpus(tmp_path)
  stats = pipeline.run(_config(tmp_path))
  records = _outputs(tmp_path / "out")
  assert sorted(r["id"] for r in records) == sorted(expect)
  by_id = {r["id"]: r for r in records}
  originals = {doc_id: text for shard in shards for doc_id, text in shard}
  # Unique documents come out unchanged, with their other fields; the sharer loses only its shared line.
  for doc_id in expect - {"shares-one-line"}:
    assert by_id[doc_id]["text"] == originals[doc_id]
    assert by_id[doc_id]["source"].startswith("shard")
  assert by_id["shares-one-line"]["text"] == "\n".join(originals["shares-one-line"].split("\n")[1:])
  stages = {s["stage"]: s for s in stats["stages"]}
  assert stages["read"]["docs_in"] == sum(len(s) for s in shards)
  # Whole documents first: the three exact and two near copies go at the MinHash stage, as documents.
  assert stages["minhash"]["docs_in"] - stages["minhash"]["docs_out"] == 5
  assert (stats["minhash"]["exact_duplicates"], stats["minhash"]["near_duplicates"]) == (3, 2)
  assert stages["paragraph_dedup"]["docs_in"] == stages["paragraph_dedup"]["docs_out"] == len(expect)
  assert stats["paragraph_dedup"]["duplicates"] == 1  # the sharer's shared line


def test_paragraph_dedup_is_first_occurrence_wins_and_min_length_applies(tmp_path):
  # Disable MinHash: the exact copies must go by paragraph deduplication alone.
  expect, _ = _write_corpus(tmp_path)
  pipeline.run(_config(tmp_path, **{"minhash.enabled": False, "dedup.hash_set": "bloom",
                                    "dedup.bloom_expected": 10_000}))
  ids = {r["id"] for r in _outputs(tmp_path / "out")}
  assert ids == expect | {"near-copy", "near-copy-of-first"}


def test_paragraphs_of_a_removed_near_copy_hide_nothing(tmp_path):
  """A near copy removed as a document takes no part in paragraph dedup: a paragraph it added is still new when a
  later document holds it (with the old order, paragraph dedup first, the copy's remnant claimed it)."""
  rng = random.Random(5)
  original = _doc(rng, lines=6)
  extra = _line(rng)
  lines = original.split("\n")
  near = "\n".join(lines[:5] + [lines[5][:-1] + " too.", extra])  # Jaccard ~0.8 with the original
  later = _line(rng) + "\n" + extra + "\n" + _line(rng)
  assert 0.8 <= _shingle_jaccard(original, near) < 0.95
  with open(tmp_path / "in-0.jsonl", "w") as f:
    for doc_id, text in (("original", original), ("near", near), ("later", later)):
      f.write(json.dumps({"id": doc_id, "text": text}) + "\n")
  stats = pipeline.run(_config(tmp_path))
  by_id = {r["id"]: r["text"] for r in _outputs(tmp_path / "out")}
  assert set(by_id) == {"original", "later"} and by_id["later"] == later
  assert stats["minhash"]["near_duplicates"] == 1 and stats["paragraph_dedup"]["duplicates"] == 0


def test_documents_without_words_are_not_near_duplicates_of_each_other():
  hasher = minhash.MinHasher(5, 4, 2)
  texts = ["!!!\n...", "---", "a real sentence with enough words to shingle", "a real sentence with enough words to shingle"]
  signatures = hasher.signatures(texts)
  bands = hasher.band_hashes(signatures)
  valid = np.array([bool(textlib.words(textlib.normalize_for_hash(t))) for t in texts])
  assert minhash.resolve(bands, signatures, 0.8, valid=valid).tolist() == [False, False, False, True]
  assert minhash.resolve(bands, signatures, 0.8).tolist() == [False, True, False, True]  # what `valid` prevents


def test_spilled_bands_give_the_pairs_of_the_in_memory_resolution(tmp_path):
  """Bands partitioned to disk (far more documents than max_rows) resolve the same drops as the whole bands in
  memory, which equal a brute-force first-occurrence grouping; the partition files are removed."""
  rng = np.random.default_rng(0)
  n, bands = 3000, 4
  hashes = rng.integers(0, 2**63, (n, bands), dtype=np.uint64) * np.uint64(2)
  for i in range(0, n, 7):  # planted candidates: some band equal to an earlier document's
    j = int(rng.integers(0, i + 1))
    b = int(rng.integers(0, bands))
    hashes[i, b] = hashes[j, b]
  signatures = rng.integers(0, 3, (n, 8)).astype(np.uint32)  # similar enough for some pairs to pass 0.5
  valid = rng.random(n) > 0.05
  memory = minhash.resolve(hashes, signatures, 0.5, valid=valid)
  index = np.flatnonzero(valid)
  chunks = lambda b: [(hashes[index[k:k + 500], b], index[k:k + 500]) for k in range(0, index.size, 500)]  # noqa
  spilled = minhash.resolve(chunks, signatures, 0.5, valid, bands=bands, num_docs=n, spill_dir=str(tmp_path / "s"),
                            max_rows=100)
  np.testing.assert_array_equal(spilled, memory)
  assert memory.sum() > 50 and os.listdir(tmp_path / "s") == []
  # Brute force: union of (first holder of a band value, later holder) pairs that pass the threshold.
  parent = list(range(n))

  def find(i):
    while parent[i] != i:
      i = parent[i]
    return i
  for b in range(bands):
    first = {}
    for i in index:
      j = first.setdefault(int(hashes[i, b]), int(i))
      if j != i and (signatures[i] == signatures[j]).mean() >= 0.5:
        ri, rj = find(i), find(j)
        parent[max(ri, rj)] = min(ri, rj)
  np.testing.assert_array_equal(memory, [find(i) != i for i in range(n)])


def test_a_run_that_spills_its_bands_writes_the_same_output(tmp_path):
  _write_corpus(tmp_path)
  pipeline.run(_config(tmp_path))
  want = _outputs(tmp_path / "out")
  cfg = _config(tmp_path, **{"minhash.max_rows_in_memory": 5})
  cfg.output = str(tmp_path / "spilled")
  stats = pipeline.run(cfg)
  assert _outputs(tmp_path / "spilled") == want and stats["minhash"]["duplicates"] == 5
