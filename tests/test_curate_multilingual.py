"""Curation on text written by people in eight languages, offline (the Debian Reference scenario of
benchmarks/curate_real.py, with text every machine has): near copies are removed as whole documents, and Chinese
and Japanese survive as their translations do.

English documents are three consecutive prose paragraphs of CPython's reference manual; the seven other languages
use the sentences of curate_corpus.py (written for these tests, the same twenty meanings in each language). Planted:
an exact and a near copy (one word changed) of one document per language, after their originals, and navigation
junk. Expected outcomes are checked against brute-force Jaccard similarities and the known language of each
document, not against the pipeline's own numbers.
"""
import json
import os
import random

import pytest

from configs import curate as curate_config
from data.curate import pipeline
from data.curate import text as textlib

import curate_corpus

LANGUAGES = ("en", "de", "fr", "es", "it", "pt", "ja", "zh")
SPACELESS = ("ja", "zh")


def _shingles(text, k=5):
  words = textlib.words(textlib.normalize_for_hash(text))
  return {tuple(words[i:i + k]) for i in range(len(words) - k + 1)}


def _jaccard(a, b):
  sa, sb = _shingles(a), _shingles(b)
  return len(sa & sb) / len(sa | sb)


def _change_one_word(text, lang):
  lines = text.split("\n")
  middle = lines[1]
  if lang in SPACELESS:
    lines[1] = middle[:6] + ("变更" if lang == "zh" else "変更") + middle[8:]
  else:
    word = next(w for w in middle.split()[3:] if len(w) >= 5 and w.isalpha())
    lines[1] = middle.replace(word, "Zwischenwort" if word[0].isupper() else "zwischenwort", 1)
  return "\n".join(lines)


def _corpus():
  """(documents in input order as (id, kind, language, text), reference lines)."""
  rng = random.Random(0)
  english = curate_corpus.english_paragraphs()
  docs, reference = [], []
  step = len(english) // 8
  for k in range(8):
    docs.append((f"en-{k}", "real", "en", "\n".join(english[k * step:k * step + 3])))
  reference += [p for i, p in enumerate(english) if i % step > 2]
  for lang in LANGUAGES[1:]:
    sentences = curate_corpus.SENTENCES[lang]
    sep = "" if lang in SPACELESS else " "
    for k in range(6):
      chosen = rng.sample(sentences, 9)
      docs.append((f"{lang}-{k}", "real", lang, "\n".join(sep.join(chosen[j:j + 3]) for j in (0, 3, 6))))
    reference += sentences
    if lang in ("de", "ja", "zh"):  # one paragraph (six sentences) and one line, in three scripts
      docs.append((f"{lang}-paragraph", "paragraph", lang, sep.join(sentences[:6])))
      docs.append((f"{lang}-line", "line", lang, sentences[7]))
  docs += [(f"junk-{k}", "junk", "", text) for k, text in enumerate(curate_corpus.JUNK)]
  rng.shuffle(docs)
  copies = []
  for lang in LANGUAGES:
    originals = [d for d in docs if d[2] == lang and d[1] == "real"]
    exact, near = originals[0], originals[1]
    copies.append((f"exact-of-{exact[0]}", "exact", lang, exact[3]))
    copies.append((f"near-of-{near[0]}", "near", lang, _change_one_word(near[3], lang)))
  rng.shuffle(copies)
  return docs + copies, reference


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = tmp_path_factory.mktemp("multilingual")
  docs, reference = _corpus()
  per = -(-len(docs) // 3)
  for s in range(3):
    with open(root / f"in-{s}.jsonl", "w", encoding="utf-8") as f:
      f.writelines(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, _, _, t in docs[s * per:(s + 1) * per])
  (root / "reference.txt").write_text("\n".join(reference) + "\n", encoding="utf-8")
  cfg = curate_config.get_config()  # the defaults: min_length 300, Gopher/C4 rules, CCNet's thresholds
  cfg.input, cfg.output, cfg.num_workers = str(root / "in-*.jsonl"), str(root / "out"), 1
  cfg.perplexity.reference = (str(root / "reference.txt"),)
  cfg.perplexity.vocab_size = 1000
  stats = pipeline.run(cfg)
  kept = {}
  for path, _, names in os.walk(root / "out"):
    if pipeline.WORK not in path:
      for name in names:
        if name.endswith(".jsonl"):
          with open(os.path.join(path, name), encoding="utf-8") as f:
            kept.update((r["id"], r) for r in map(json.loads, f))
  return {i: (kind, lang, text) for i, kind, lang, text in docs}, kept, stats


def test_the_corpus_is_what_it_claims(run):
  docs, _, _ = run
  real = [(i, text) for i, (kind, _, text) in docs.items() if kind == "real"]
  # Real documents are not near duplicates of one another; the planted near copies are (one word changed).
  assert max(_jaccard(a, b) for n, (_, a) in enumerate(real) for _, b in real[n + 1:]) < 0.5
  for i, (kind, _, text) in docs.items():
    if kind == "near":
      assert 0.8 <= _jaccard(text, docs[i.split("-of-", 1)[1]][2]) < 0.97


def test_every_language_keeps_its_documents_alike(run):
  docs, kept, _ = run
  rates = {}
  for lang in LANGUAGES:
    real = [i for i, (kind, doc_lang, _) in docs.items() if kind == "real" and doc_lang == lang]
    rates[lang] = sum(i in kept for i in real) / len(real)
  assert min(rates.values()) >= 0.7, rates
  assert max(rates.values()) - min(rates.values()) <= 0.2, rates


def test_copies_are_removed_as_whole_documents_and_originals_stay(run):
  docs, kept, stats = run
  exact = [i for i, (kind, _, _) in docs.items() if kind == "exact"]
  near = [i for i, (kind, _, _) in docs.items() if kind == "near"]
  assert sum(i not in kept for i in exact) / len(exact) >= 0.95
  assert sum(i not in kept for i in near) / len(near) >= 0.8
  # As documents: the MinHash stage, before paragraph dedup, takes them (no other document is a copy).
  assert stats["minhash"]["exact_duplicates"] == len(exact)
  assert stats["minhash"]["near_duplicates"] == len(near)
  minhash = next(s for s in stats["stages"] if s["stage"] == "minhash")
  assert minhash["docs_in"] - minhash["docs_out"] == len(exact) + len(near)
  originals = [i.split("-of-", 1)[1] for i in exact + near]
  assert sum(i in kept for i in originals) / len(originals) >= 0.7


def test_no_junk_in_the_head_bucket_and_language_id_is_right(run):
  docs, kept, _ = run
  assert not [i for i, (kind, _, _) in docs.items() if kind == "junk" and kept.get(i, {}).get("bucket") == "head"]
  real_kept = [i for i, (kind, _, _) in docs.items() if kind in ("real", "paragraph") and i in kept]
  right = sum(kept[i]["language"] == docs[i][1] for i in real_kept)
  assert right / len(real_kept) >= 0.95


def test_a_paragraph_of_chinese_or_japanese_survives_as_its_translation_does_and_a_line_does_not(run):
  docs, kept, _ = run
  for lang in ("de", "ja", "zh"):
    assert f"{lang}-paragraph" in kept, lang
    assert f"{lang}-line" not in kept, lang
  # The Chinese paragraph has fewer than 300 characters: counted in characters, the length filter would drop it.
  assert len(docs["zh-paragraph"][2]) < 300 <= textlib.utf8_length(docs["zh-paragraph"][2])
