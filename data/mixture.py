"""The global document order: every source shuffled anew each epoch, mixed by weight, as one infinite
random-access sequence of (source_id, text).

Both the shuffles and the mixing use `permute`, a keyed Feistel bijection evaluated vectorised in numpy and cached
in chunks, so a lookup costs microseconds whatever the source size and the order is stable across numpy versions.
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_CHUNK = 1024  # permutation values computed (and cached) together
_CACHE_ENTRIES = 256  # cached chunks per object (~2 MB)
MIX_BLOCK = 1000  # mixture proportions are exact within every block of this many documents


def _mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
  with np.errstate(over="ignore"):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(idx: np.ndarray, n: int, key: int) -> np.ndarray:
  """The images of `idx` (ints in [0, n)) under a keyed pseudo-random bijection of [0, n).

  Four Feistel rounds on the smallest even number of bits covering n, with cycle-walking for values >= n.
  """
  x = np.asarray(idx, np.uint64).copy()
  if n <= 1:
    return x.astype(np.int64)
  bits = max(2, int(n - 1).bit_length())
  bits += bits % 2
  half = np.uint64(bits // 2)
  mask = np.uint64((1 << (bits // 2)) - 1)
  key64 = _mix64(np.array([key & 0xFFFFFFFFFFFFFFFF], np.uint64))[0]
  todo = np.ones(len(x), bool)
  while todo.any():
    left, right = x[todo] >> half, x[todo] & mask
    for rnd in range(4):
      with np.errstate(over="ignore"):
        f = _mix64(right ^ key64 ^ (np.uint64(rnd + 1) * np.uint64(0x9E3779B97F4A7C15))) & mask
      left, right = right, left ^ f
    x[todo] = (left << half) | right
    todo = x >= np.uint64(n)
  return x.astype(np.int64)


def _key(*parts: int) -> int:
  """A 64-bit key from integers, identical in every process and Python version (unlike `hash`)."""
  h = np.uint64(0x243F6A8885A308D3)
  for p in parts:
    h = _mix64(np.array([h ^ np.uint64(p & 0xFFFFFFFFFFFFFFFF)], np.uint64))[0]
  return int(h)


class _ChunkCache:
  """A small dict of computed chunks, cleared when full (lookups are near-sequential, so this rarely matters)."""

  def __init__(self):
    self.entries: dict = {}

  def __getstate__(self):  # copies pickled into worker processes start empty instead of carrying chunks
    return {}

  def __setstate__(self, state):
    self.entries = {}

  def get(self, key, compute):
    value = self.entries.get(key)
    if value is None:
      if len(self.entries) >= _CACHE_ENTRIES:
        self.entries.clear()
      value = self.entries[key] = compute()
    return value


class BlockMixture:
  """Global document index j -> (source, k-th document of that source's stream).

  Every block of `block` consecutive indices holds exactly round(weight * block) documents of each source
  (largest remainder), in a seeded random order; within a source, k increases with j.
  """

  def __init__(self, weights: Sequence[float], seed: int, block: int = MIX_BLOCK):
    w = np.asarray(weights, np.float64) / np.sum(weights)
    counts = np.floor(w * block).astype(np.int64)
    for i in np.argsort(-(w * block - counts), kind="stable")[:block - counts.sum()]:
      counts[i] += 1
    self.counts = counts
    self.slot_source = np.repeat(np.arange(len(counts)), counts)
    self.block, self.seed = block, seed
    self._cache = _ChunkCache()

  def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
    source = self.slot_source[permute(np.arange(self.block), self.block, _key(self.seed, b, 1))]
    rank = np.empty(self.block, np.int64)
    for s in range(len(self.counts)):
      where = source == s
      rank[where] = np.arange(where.sum())
    return source, rank

  def __getitem__(self, j: int) -> tuple[int, int]:
    b, q = divmod(int(j), self.block)
    source, rank = self._cache.get(b, lambda: self._block(b))
    s = int(source[q])
    return s, b * int(self.counts[s]) + int(rank[q])


class EpochShuffle:
  """k -> index into [0, n): epoch k // n is a fresh seeded permutation of [0, n)."""

  def __init__(self, n: int, seed: int):
    self.n, self.seed = n, seed
    self._cache = _ChunkCache()

  def __getitem__(self, k: int) -> int:
    epoch, i = divmod(int(k), self.n)
    c, r = divmod(i, _CHUNK)

    def compute():
      idx = np.arange(c * _CHUNK, min((c + 1) * _CHUNK, self.n))
      return permute(idx, self.n, _key(self.seed, epoch, 2))

    return int(self._cache.get((epoch, c), compute)[r])


class MixtureDocs:
  """Infinite random-access sequence of (source_id, text): a grain MapDataset source.

  `docs[s]` are the documents of source s (any object with len and [i] -> str), `indices[s]` the ones in this
  split; `weights` the sampling weights.
  """

  def __init__(self, docs: Sequence, indices: Sequence[np.ndarray], weights: Sequence[float], seed: int,
               source_ids: Sequence[int] | None = None):
    self.docs, self.indices = list(docs), [np.asarray(i, np.int64) for i in indices]
    self.source_ids = list(source_ids) if source_ids is not None else list(range(len(self.docs)))
    self.mixture = BlockMixture(weights, seed)
    self.shuffles = [EpochShuffle(len(i), _key(seed, s, 3)) for s, i in enumerate(self.indices)]

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, j: int) -> tuple[int, str]:
    s, k = self.mixture[j]
    return self.source_ids[s], self.docs[s][int(self.indices[s][self.shuffles[s][k]])]
