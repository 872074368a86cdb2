"""Near-duplicate documents with MinHash LSH.

Per document (per shard, in parallel): word shingles of the hash-normalised text -> `bands * rows` minhash values
(uint32) and one uint64 hash per band. Globally (in the driver, deterministic): documents sharing a band hash are
candidates; a candidate pair whose signatures agree on at least `threshold` of the positions (the Jaccard
estimate) is linked, and of each linked group only the earliest document in input order survives.
"""
from __future__ import annotations

import zlib

import numpy as np

from data.curate import text as textlib

_PRIME = np.uint64(4294967311)  # smallest prime above 2**32: (a*x + b) mod p is a universal hash of 32-bit x
_MIX = np.uint64(0x9E3779B97F4A7C15)


class MinHasher:
  """Signatures with `bands * rows` permutations drawn from `seed`, over `shingle_size`-word shingles."""

  def __init__(self, shingle_size: int = 5, bands: int = 16, rows: int = 8, seed: int = 0):
    if shingle_size < 1 or bands < 1 or rows < 1:
      raise ValueError(f"minhash needs shingle_size, bands and rows >= 1; got {shingle_size}, {bands}, {rows}")
    self.shingle_size, self.bands, self.rows = shingle_size, bands, rows
    rng = np.random.default_rng(seed)
    n = bands * rows
    self._a = rng.integers(1, 2**32, size=n, dtype=np.uint64)
    self._b = rng.integers(0, 2**32, size=n, dtype=np.uint64)
    self._band_mix = rng.integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1)

  def signature(self, text: str) -> np.ndarray:
    """uint32 [bands * rows]: the minhash signature of the document's shingles (all 0xFFFFFFFF if it has no words)."""
    tokens = textlib.words(textlib.normalize_for_hash(text))
    if not tokens:
      return np.full(self.bands * self.rows, 0xFFFFFFFF, dtype=np.uint32)
    word_hashes = np.fromiter((zlib.crc32(t.encode("utf-8")) for t in tokens), dtype=np.uint64, count=len(tokens))
    k = min(self.shingle_size, len(tokens))
    n = len(tokens) - k + 1
    shingles = np.zeros(n, dtype=np.uint64)
    for j in range(k):  # polynomial hash of the k word hashes, wrapping mod 2**64
      shingles = shingles * _MIX + word_hashes[j:j + n]
    shingles = np.unique(shingles >> np.uint64(32))  # 32-bit shingle ids
    values = (shingles[:, None] * self._a[None, :] + self._b[None, :]) % _PRIME
    return values.min(axis=0).astype(np.uint32)

  def band_hashes(self, signature: np.ndarray) -> np.ndarray:
    """uint64 [bands]: one hash per band of `rows` signature values."""
    rows = signature.reshape(self.bands, self.rows).astype(np.uint64)
    return (rows * self._band_mix[None, :]).sum(axis=1) ^ np.arange(self.bands, dtype=np.uint64)


def _find(parent: np.ndarray, i: int) -> int:
  while parent[i] != i:
    parent[i] = parent[parent[i]]
    i = parent[i]
  return i


def resolve(band_hashes: np.ndarray, signatures: np.ndarray, threshold: float) -> np.ndarray:
  """bool [num_docs]: True for documents to drop as near duplicates of an earlier document.

  `band_hashes` uint64 [num_docs, bands] and `signatures` uint32 [num_docs, bands*rows], rows in global input
  order. Each document is compared with the first document of each of its buckets (one per band)."""
  num_docs = band_hashes.shape[0]
  pairs = []
  for b in range(band_hashes.shape[1]):
    _, first, inverse = np.unique(band_hashes[:, b], return_index=True, return_inverse=True)
    rep = first[inverse.ravel()]
    later = np.flatnonzero(rep != np.arange(num_docs))
    if later.size:
      pairs.append(np.stack([rep[later], later], axis=1))
  if not pairs:
    return np.zeros(num_docs, dtype=bool)
  pairs = np.unique(np.concatenate(pairs), axis=0)
  similarity = (signatures[pairs[:, 0]] == signatures[pairs[:, 1]]).mean(axis=1)
  pairs = pairs[similarity >= threshold]
  parent = np.arange(num_docs)
  for a, b in pairs:  # union-find whose root is always the earliest document of the group
    ra, rb = _find(parent, int(a)), _find(parent, int(b))
    if ra != rb:
      parent[max(ra, rb)] = min(ra, rb)
  drop = np.zeros(num_docs, dtype=bool)
  for i in np.unique(pairs):
    drop[i] = _find(parent, int(i)) != i
  return drop
