"""Benchmark contamination: n-gram overlap between training documents and evaluation items.

Each evaluation item (its prompt plus its answer as the benchmark publishes them, without a prompt template:
data/curate/eval_items.py, for every task file the evaluator takes) is normalised to words: lower case,
apostrophes deleted, other punctuation and symbols separating runs of letters and digits. An item of L words
contributes its n-grams with n = max(8, min(13, L)): GPT-3 used 13-grams (Brown et al. 2020, appendix C),
datatrove defaults to 12; many benchmark items are shorter, so n falls to the item's length, never below 8 (items
under 8 words are counted as too short to check). A training document is contaminated by a task when any of that
task's n-grams occurs in it after the same normalisation, so verbatim, re-cased and re-punctuated copies are all
found.

Lookup: every item n-gram is indexed under its first 8 words; a document is scanned once with an 8-word window, and
only a window that hits the index is compared with the longer n-grams starting there.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

MIN_N, MAX_N = 8, 13
_WORD = re.compile(r"[^\W_]+")
# Apostrophes are deleted, not word breaks: "don't" and "dont" are one word.
_APOSTROPHES = str.maketrans("", "", "'\u2019\u2018`")


def words(text: str) -> list[str]:
  """The normalised words of `text`: lower-cased runs of letters and digits, apostrophes deleted, other
  punctuation and symbols separating words."""
  return _WORD.findall(text.lower().translate(_APOSTROPHES))


@dataclasses.dataclass
class Hit:
  """One document's matches with one task: the items hit and how many n-gram occurrences matched."""
  items: set
  ngrams: int = 0
  example: str = ""


class Index:
  """The n-grams of every task's items, looked up by a document's 8-word windows.

  tasks: (task name, item texts) pairs. `too_short[name]` counts the items under `min_n` words."""

  def __init__(self, tasks: Sequence[tuple[str, Sequence[str]]], min_n: int = MIN_N, max_n: int = MAX_N):
    if not 1 <= min_n <= max_n:
      raise ValueError(f"decontamination n-gram sizes need 1 <= min_n <= max_n; got min_n={min_n}, max_n={max_n}")
    self.min_n, self.max_n = min_n, max_n
    self.names = [name for name, _ in tasks]
    self.items = {name: len(texts) for name, texts in tasks}
    self.too_short = {name: 0 for name, _ in tasks}
    self._by_prefix: dict[tuple, list[tuple[tuple, str, int]]] = {}
    for name, texts in tasks:
      for i, text in enumerate(texts):
        w = words(text)
        if len(w) < min_n:
          self.too_short[name] += 1
          continue
        n = min(max_n, len(w))
        for j in range(len(w) - n + 1):
          gram = tuple(w[j:j + n])
          entries = self._by_prefix.setdefault(gram[:min_n], [])
          if (gram, name, i) not in entries:
            entries.append((gram, name, i))

  def match(self, text: str) -> dict[str, Hit]:
    """{task name: Hit} for the tasks whose n-grams occur in `text` (empty when clean)."""
    w = words(text)
    hits: dict[str, Hit] = {}
    k = self.min_n
    for j in range(len(w) - k + 1):
      entries = self._by_prefix.get(tuple(w[j:j + k]))
      if not entries:
        continue
      for gram, name, item in entries:
        if len(gram) == k or tuple(w[j:j + len(gram)]) == gram:
          hit = hits.setdefault(name, Hit(set()))
          hit.items.add(item)
          hit.ngrams += 1
          hit.example = hit.example or " ".join(gram)
    return hits


def load_index(specs: str, min_n: int = MIN_N, max_n: int = MAX_N) -> Index:
  """An Index of the evaluation tasks `specs` ('NAME:PATH[,NAME:PATH...]', the names and files
  `python -m train.evaluate --tasks` takes), their items read raw by data.curate.eval_items."""
  from data.curate import eval_items  # pylint: disable=g-import-not-at-top
  return Index(eval_items.load(specs), min_n, max_n)


_CACHE: dict[tuple, Index] = {}


def cached_index(specs: str, min_n: int, max_n: int) -> Index:
  """`load_index`, built once per process (curation workers score many shards)."""
  key = (specs, min_n, max_n)
  if key not in _CACHE:
    _CACHE[key] = load_index(specs, min_n, max_n)
  return _CACHE[key]


class Report:
  """Per task: documents hit, n-gram occurrences matched, distinct items hit, and a few examples."""

  def __init__(self, index: Index, examples: int = 3):
    self.index, self.max_examples = index, examples
    self.documents = 0
    self.contaminated = 0
    self.tasks = {name: {"documents": 0, "ngrams": 0, "items": set(), "examples": []} for name in index.names}

  def add(self, doc_id: str, hits: dict[str, Hit]) -> None:
    self.documents += 1
    self.contaminated += bool(hits)
    for name, hit in hits.items():
      row = self.tasks[name]
      row["documents"] += 1
      row["ngrams"] += hit.ngrams
      row["items"] |= hit.items
      if len(row["examples"]) < self.max_examples:
        row["examples"].append({"document": doc_id, "item": min(hit.items), "ngram": hit.example})

  def to_dict(self) -> dict:
    return {"documents": self.documents, "contaminated_documents": self.contaminated,
            "n": [self.index.min_n, self.index.max_n],
            "tasks": {name: {"items": self.index.items[name], "items_too_short": self.index.too_short[name],
                             "documents_hit": r["documents"], "ngrams_matched": r["ngrams"],
                             "items_hit": len(r["items"]), "examples": r["examples"]}
                      for name, r in self.tasks.items()}}


def scan(index: Index, documents: Iterable[dict]) -> Report:
  """A Report over documents ({"id", "text"} dicts)."""
  report = Report(index)
  for doc in documents:
    report.add(doc["id"], index.match(doc["text"]))
  return report
