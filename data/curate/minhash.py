"""Near-duplicate documents with MinHash LSH.

Per document (per shard, in parallel): word shingles of the hash-normalised text -> `bands * rows` minhash values
(uint32) and one uint64 hash per band. Globally (in the driver, deterministic): documents sharing a band hash are
candidates; a candidate pair whose signatures agree on at least `threshold` of the positions (the Jaccard
estimate) is linked, and of each linked group only the earliest document in input order survives.
"""
from __future__ import annotations

import itertools
import os
import zlib

import numpy as np

from data.curate import text as textlib

_MIX = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_SHINGLES = 4096  # shingles per [permutations, shingles] block (4 MiB at 128 permutations)


def _hash_words(text: str) -> list[bytes]:
  """`textlib.words(textlib.normalize_for_hash(text))`, UTF-8 encoded (what the word hashes are taken of)."""
  if text.isascii():
    # Bytes translate with the ASCII part of the same table: several times faster than str.translate with a
    # dict. ASCII whitespace left after it is only " " (\x1c-\x1f are dropped), so bytes.split() == str.split().
    return text.lower().encode("ascii").translate(textlib.HASH_TABLE_ASCII, textlib.HASH_DELETE_ASCII).split()
  return list(map(str.encode, textlib.words(textlib.normalize_for_hash(text))))


class MinHasher:
  """Signatures with `bands * rows` permutations drawn from `seed`, over `shingle_size`-word shingles.

  Permutation i of a 64-bit shingle hash x is the multiply-shift hash (a_i * x + b_i) >> 32 (mod 2**64, a_i odd),
  a 2-universal family that needs no modulo."""

  def __init__(self, shingle_size: int = 5, bands: int = 16, rows: int = 8, seed: int = 0):
    if shingle_size < 1 or bands < 1 or rows < 1:
      raise ValueError(f"minhash needs shingle_size, bands and rows >= 1; got {shingle_size}, {bands}, {rows}")
    self.shingle_size, self.bands, self.rows = shingle_size, bands, rows
    rng = np.random.default_rng(seed)
    n = bands * rows
    self._a = rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    self._b = rng.integers(0, 2**63, size=n, dtype=np.uint64)
    self._band_mix = rng.integers(1, 2**63, size=rows, dtype=np.uint64) | np.uint64(1)

  def _shingles(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 shingle hashes of all texts, concatenated; int64 [len(texts)] shingles per text). A text shorter
    than a shingle gets one shingle of all its words, a text without words none. Vectorised over the batch."""
    token_lists = list(map(_hash_words, texts))
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=len(token_lists))
    words = np.fromiter(map(zlib.crc32, itertools.chain.from_iterable(token_lists)),
                        dtype=np.uint64, count=int(lengths.sum()))
    word_start = np.cumsum(lengths) - lengths
    k = self.shingle_size
    # Shingle j hashes words j .. j+k-1 (a polynomial mod 2**64, then one more mix).
    full = max(0, words.size - k + 1)
    rolling = words[:full].copy()
    for m in range(1, k):
      rolling *= _MIX
      rolling += words[m:m + full]
    counts = np.where(lengths >= k, lengths - k + 1, np.minimum(lengths, 1))
    shingle_start = np.cumsum(counts) - counts
    starts = np.repeat(word_start, counts) + (np.arange(counts.sum()) - np.repeat(shingle_start, counts))
    shingles = np.empty(int(counts.sum()), np.uint64)
    long_docs = np.repeat(lengths >= k, counts)
    shingles[long_docs] = rolling[starts[long_docs]]
    for i in np.flatnonzero((lengths > 0) & (lengths < k)):  # shorter than one shingle: hash all its words
      h = words[word_start[i]:word_start[i] + 1].copy()
      for m in range(1, lengths[i]):
        h *= _MIX
        h += words[word_start[i] + m]
      shingles[shingle_start[i]] = h[0]
    shingles *= _MIX
    return shingles, counts

  def signatures(self, texts: list[str]) -> np.ndarray:
    """uint32 [len(texts), bands * rows]: minhash signatures (all 0xFFFFFFFF for a text without words)."""
    num_perm = self.bands * self.rows
    out = np.full((len(texts), num_perm), 0xFFFFFFFF, dtype=np.uint32)
    shingles, counts = self._shingles(texts)
    starts = np.cumsum(counts) - counts
    nonempty = np.flatnonzero(counts)
    if not nonempty.size:
      return out
    # Blocks of whole documents with about _CHUNK_SHINGLES shingles (a longer document alone), laid out
    # [permutations, shingles] so each permutation's per-document minimum reduces a contiguous run, in one
    # buffer reused across blocks (fresh multi-MiB arrays cost a page fault per 4 KiB).
    ends = np.cumsum(counts[nonempty])
    blocks, c = [], 0
    while c < nonempty.size:
      e = max(c + 1, int(np.searchsorted(ends, (ends[c - 1] if c else 0) + _CHUNK_SHINGLES, side="right")))
      blocks.append((c, e))
      c = e
    width = max(int(ends[e - 1] - (ends[c - 1] if c else 0)) for c, e in blocks)
    buffer = np.empty(num_perm * width, np.uint64)
    a, b = self._a[:, None], self._b[:, None]
    for c, e in blocks:
      docs = nonempty[c:e]
      first, last = starts[docs[0]], starts[docs[-1]] + counts[docs[-1]]
      values = buffer[:num_perm * (last - first)].reshape(num_perm, last - first)
      np.multiply(a, shingles[None, first:last], out=values)
      values += b
      # x >> 32 is monotone, so the minimum can be taken before the shift (on far fewer values).
      out[docs] = (np.minimum.reduceat(values, starts[docs] - first, axis=1) >> np.uint64(32)).astype(np.uint32).T
    return out

  def signature(self, text: str) -> np.ndarray:
    """uint32 [bands * rows]: the signature of one text."""
    return self.signatures([text])[0]

  def band_hashes(self, signatures: np.ndarray) -> np.ndarray:
    """uint64 [..., bands]: one hash per band of `rows` signature values."""
    rows = signatures.reshape(signatures.shape[:-1] + (self.bands, self.rows)).astype(np.uint64)
    return (rows * self._band_mix).sum(axis=-1) ^ np.arange(self.bands, dtype=np.uint64)


def _first_pairs(values: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
  """[(first row with the value, later row)] of equal values; `rows` ascending (input order)."""
  _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
  rep = first[inverse.ravel()]
  later = np.flatnonzero(rep != np.arange(values.size))
  return [np.stack([rows[rep[later]], rows[later]], axis=1)] if later.size else []


def _memory_pairs(chunks) -> list[np.ndarray]:
  chunks = list(chunks)
  if not chunks:
    return []
  return _first_pairs(np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks]))


def _spilled_pairs(chunks, directory: str, rows_total: int, max_rows: int) -> list[np.ndarray]:
  """_first_pairs of a band too large for memory: (hash, row) pairs written to 2^k partition files by the hash's
  top k bits (in input order, so each partition's first occurrence is the global one), then resolved one by one;
  2^k >= rows_total / max_rows, so a partition holds about max_rows rows (the hashes are uniform)."""
  os.makedirs(directory, exist_ok=True)
  bits = min(12, max(1, int(np.ceil(np.log2(rows_total / max_rows)))))
  parts = 1 << bits
  paths = [os.path.join(directory, f"part-{p:03d}.bin") for p in range(parts)]
  handles = [open(path, "wb") for path in paths]
  try:
    for values, rows in chunks:
      part = (values >> np.uint64(64 - bits)).astype(np.int64)
      order = np.argsort(part, kind="stable")
      bounds = np.searchsorted(part[order], np.arange(parts + 1))
      both = np.stack([values, rows.astype(np.uint64)], axis=1)[order]
      for p in range(parts):
        if bounds[p + 1] > bounds[p]:
          handles[p].write(both[bounds[p]:bounds[p + 1]].tobytes())
  finally:
    for h in handles:
      h.close()
  out = []
  for path in paths:
    data = np.fromfile(path, np.uint64).reshape(-1, 2)
    os.remove(path)
    out += _first_pairs(data[:, 0], data[:, 1].astype(np.int64))
  return out


def _find(parent: np.ndarray, i: int) -> int:
  while parent[i] != i:
    parent[i] = parent[parent[i]]
    i = parent[i]
  return i


def resolve(band_hashes, signatures, threshold: float, valid: np.ndarray | None = None, *, bands: int = 0,
            num_docs: int = 0, spill_dir: str = "", max_rows: int = 0) -> np.ndarray:
  """bool [num_docs]: True for documents to drop as near duplicates of an earlier document.

  `band_hashes` uint64 [num_docs, bands], rows in global input order; or a function from a band b to an iterable
  of (band-b hashes, their global row indices) chunks in input order holding only the documents that take part,
  with `bands` and `num_docs` given. `signatures` the matching uint32 [num_docs, bands*rows] array, or a function
  from global row indices to those rows (so that only candidates' signatures need to be in memory); `valid` bool
  [num_docs], False for documents that take no part (no words: their empty signatures would all match). Each
  document is compared with the first document of each of its buckets (one per band). With `spill_dir` and more
  than `max_rows` documents taking part, each band's (hash, row) pairs are partitioned by the hash's top bits into
  files there and each partition is resolved alone: about max_rows * 16 bytes of band data in memory per
  partition, the same pairs."""
  if callable(band_hashes):
    chunks_of, taking_part = band_hashes, (num_docs if valid is None else int(valid.sum()))
  else:
    num_docs, bands = band_hashes.shape
    index = np.arange(num_docs) if valid is None else np.flatnonzero(valid)
    chunks_of, taking_part = (lambda b: [(band_hashes[index, b], index)]), index.size
  spill = bool(spill_dir) and 0 < max_rows < taking_part
  pairs = []
  for b in range(bands):
    pairs += _spilled_pairs(chunks_of(b), spill_dir, taking_part, max_rows) if spill else _memory_pairs(chunks_of(b))
  if not pairs:
    return np.zeros(num_docs, dtype=bool)
  pairs = np.unique(np.concatenate(pairs), axis=0)
  rows = signatures if callable(signatures) else signatures.__getitem__
  similarity = (rows(pairs[:, 0]) == rows(pairs[:, 1])).mean(axis=1)
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
