"""Exact paragraph deduplication across all shards (CCNet's semantics: the first occurrence of a paragraph wins).

Pass 1 stores each shard's paragraph hashes (uint64). `resolve_paragraphs` then walks the shards in input order
with one bounded set of the hashes seen so far and writes, per shard, which paragraphs to keep. Paragraphs of
documents already removed as near duplicates take no part: they neither survive nor hide a later paragraph.
Because the resolution is sequential in shard order, the result does not depend on the executor or the number of
workers.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Sequence

import numpy as np


class SortedHashSet:
  """Exact set of uint64 hashes in a few sorted arrays (8 bytes per distinct hash, plus transient merge copies).

  Arrays are merged when a newer one grows to at least half of the older one, so a lookup searches O(log n)
  arrays and every hash is copied O(log n) times."""

  def __init__(self):
    self._levels: list[np.ndarray] = []

  def contains(self, hashes: np.ndarray) -> np.ndarray:
    """bool [n]: whether each hash was added before."""
    found = np.zeros(hashes.shape, dtype=bool)
    for level in self._levels:
      idx = np.searchsorted(level, hashes)
      idx[idx == len(level)] = 0
      found |= level[idx] == hashes
    return found

  def add(self, hashes: np.ndarray) -> None:
    """Adds hashes (any order, duplicates allowed)."""
    new = np.unique(hashes)
    if new.size == 0:
      return
    self._levels.append(new)
    while len(self._levels) > 1 and 2 * self._levels[-1].size >= self._levels[-2].size:
      top = self._levels.pop()
      self._levels[-1] = np.union1d(self._levels[-1], top)

  @property
  def nbytes(self) -> int:
    return sum(level.nbytes for level in self._levels)


class BloomFilter:
  """Bloom filter over uint64 hashes, sized for `expected` items at false-positive rate `error_rate`.

  A false positive removes a unique paragraph, so keep `error_rate` small (1e-6 costs ~3.6 bytes per item)."""

  def __init__(self, expected: int, error_rate: float):
    if expected <= 0 or not 0 < error_rate < 1:
      raise ValueError(f"Bloom filter needs expected > 0 and 0 < error_rate < 1; got {expected}, {error_rate} "
                       "(config keys dedup.bloom_expected and dedup.bloom_error_rate)")
    self.num_bits = max(64, int(math.ceil(-expected * math.log(error_rate) / math.log(2) ** 2)))
    self.num_hashes = max(1, round(self.num_bits / expected * math.log(2)))
    self._bits = np.zeros((self.num_bits + 7) // 8, dtype=np.uint8)

  def _positions(self, hashes: np.ndarray) -> np.ndarray:
    # splitmix64's finaliser spreads inputs that are not uniformly random, then double hashing
    # (Kirsch-Mitzenmacher): position_i = h1 + i * h2 from the two halves of the mixed hash.
    hashes = hashes ^ (hashes >> np.uint64(30))
    hashes = hashes * np.uint64(0xBF58476D1CE4E5B9)
    hashes = hashes ^ (hashes >> np.uint64(27))
    hashes = hashes * np.uint64(0x94D049BB133111EB)
    hashes = hashes ^ (hashes >> np.uint64(31))
    h1 = hashes & np.uint64(0xFFFFFFFF)
    h2 = (hashes >> np.uint64(32)) | np.uint64(1)
    i = np.arange(self.num_hashes, dtype=np.uint64)[:, None]
    return (h1[None, :] + i * h2[None, :]) % np.uint64(self.num_bits)

  def contains(self, hashes: np.ndarray) -> np.ndarray:
    pos = self._positions(hashes)
    bits = (self._bits[pos >> np.uint64(3)] >> (pos & np.uint64(7)).astype(np.uint8)) & 1
    return bits.all(axis=0)

  def add(self, hashes: np.ndarray) -> None:
    pos = self._positions(hashes).ravel()
    np.bitwise_or.at(self._bits, pos >> np.uint64(3), (1 << (pos & np.uint64(7))).astype(np.uint8))

  @property
  def nbytes(self) -> int:
    return self._bits.nbytes


def make_hash_set(kind: str, expected: int = 0, error_rate: float = 1e-6):
  """`exact` -> SortedHashSet, `bloom` -> BloomFilter(expected, error_rate)."""
  if kind == "exact":
    return SortedHashSet()
  if kind == "bloom":
    return BloomFilter(expected, error_rate)
  raise ValueError(f"dedup.hash_set {kind!r} unknown; use exact or bloom")


def document_hash(paragraph_hashes: np.ndarray) -> int:
  """A 64-bit hash of a whole normalised document from its uint64 paragraph hashes (blank paragraphs, hash 0,
  ignored); 0 for a document with no text. Equal for documents that differ only in what normalisation drops."""
  words = paragraph_hashes[paragraph_hashes != 0]
  if not words.size:
    return 0
  return int.from_bytes(hashlib.blake2b(words.astype("<u8").tobytes(), digest_size=8).digest(), "little") or 1


def keep_mask(hashes: np.ndarray, seen, survives: np.ndarray | None = None) -> np.ndarray:
  """bool [n] for one shard's paragraph hashes in document order: True for a paragraph whose hash is 0 (nothing
  to compare) or that occurs here for the first time (not in `seen`, not earlier in this shard). Adds the
  shard's hashes to `seen`. `survives` (bool [n]): False for paragraphs of removed documents, which are neither
  kept nor added."""
  keep = hashes == 0
  if survives is not None:
    keep &= survives
  nonzero = np.flatnonzero((hashes != 0) if survives is None else (hashes != 0) & survives)
  if nonzero.size:
    values = hashes[nonzero]
    uniq, first = np.unique(values, return_index=True)
    new = ~seen.contains(uniq)
    keep[nonzero[first[new]]] = True
    seen.add(uniq)
  return keep


def resolve_paragraphs(load_hashes: Callable[[int], tuple[np.ndarray, np.ndarray]], num_shards: int, seen,
                       save_keep: Callable[[int, np.ndarray], None]) -> dict:
  """Sequential global resolution in shard order. `load_hashes(shard)` -> (uint64 [n] paragraph hashes, bool [n]
  whether the paragraph's document survives near-duplicate removal). Returns {'paragraphs' (of surviving
  documents), 'duplicates', 'set_bytes'}."""
  total = dups = 0
  for shard in range(num_shards):
    hashes, survives = load_hashes(shard)
    keep = keep_mask(hashes, seen, survives)
    save_keep(shard, keep)
    total += int(survives.sum())
    dups += int((survives & ~keep).sum())
  return {"paragraphs": total, "duplicates": dups, "set_bytes": int(seen.nbytes)}


def apply_keep(text: str, keep: Sequence[bool]) -> str:
  """The document with the paragraphs (lines) whose keep flag is False removed."""
  lines = text.split("\n")
  if len(lines) != len(keep):
    raise ValueError(f"paragraph count changed between passes ({len(lines)} vs {len(keep)}); the input files "
                     "must not change during a run")
  if all(keep):  # the usual case: joining every line again gives back the text itself
    return text
  return "\n".join(line for line, k in zip(lines, keep) if k)
