"""An n-gram language model over integer tokens, vectorised with numpy: interpolated Kneser-Ney or stupid
backoff training, ARPA reading, and scoring.

The model is stored in backoff form (like an ARPA file): per order n, sorted 64-bit n-gram hashes with their
log10 probabilities; per context length k < N, sorted context hashes with their log10 backoff weights. The log10
probability of token w after history h is that of the longest stored n-gram (h' w) plus the backoff weights of
the longer contexts, which for Kneser-Ney equals the interpolated estimate exactly.

Sentences are scored as `<s> tokens </s>`; `<s>` is never predicted. An n-gram is identified by a polynomial
hash mod 2**64 of its token ids (collisions are negligible at corpus sizes).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

_P = np.uint64(0xD6E8FEB86659FD93)


def _powers(order: int) -> list[np.uint64]:
  out = [np.uint64(1)]
  for _ in range(order):
    out.append(np.uint64((int(out[-1]) * int(_P)) % 2**64))
  return out


def flatten(sentences: Sequence[Sequence[int]], bos: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int64 [T], positions int64 [T]): each sentence as `bos ids eos`, positions restarting at 0 on bos."""
  lengths = np.fromiter(map(len, sentences), dtype=np.int64, count=len(sentences)) + 2
  total = int(lengths.sum())
  tokens = np.fromiter(itertools.chain.from_iterable(itertools.chain((bos,), s, (eos,)) for s in sentences),
                       dtype=np.int64, count=total)
  starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
  return tokens, np.arange(total, dtype=np.int64) - starts


def ngram_hashes(tokens: np.ndarray, order: int) -> list[np.ndarray]:
  """[H_1, ..., H_order], each uint64 [T]: H_n[i] hashes tokens[i-n+1 .. i] (meaningful where position >= n-1)."""
  ids = tokens.astype(np.uint64) + np.uint64(1)
  powers = _powers(order)
  out = [ids.copy()]
  for n in range(2, order + 1):
    shifted = np.zeros_like(ids)
    shifted[n - 1:] = ids[:ids.size - (n - 1)]
    out.append(out[-1] + shifted * powers[n - 1])
  return out


def _lookup(keys: np.ndarray, values: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  if keys.size == 0:
    return np.zeros(query.shape, bool), np.zeros(query.shape, np.float64)
  if query.size > 256:  # sorted queries walk the table in order: about twice as fast on large tables
    order = np.argsort(query)
    idx = np.empty(query.size, np.int64)
    idx[order] = np.searchsorted(keys, query[order])
  else:
    idx = np.searchsorted(keys, query)
  idx[idx == keys.size] = 0
  found = keys[idx] == query
  return found, np.where(found, values[idx], 0.0)


def _dense_table(keys: np.ndarray, values: np.ndarray):
  """(found bool [K+2], values [K+2]) indexed by the key itself, when the keys are few distinct small integers
  (the unigram level: a unigram's hash is its token id + 1), else None. Slot K+1 is never found: larger queries
  are clipped onto it."""
  if keys.size == 0 or keys.dtype != np.uint64 or int(keys[-1]) >= 4 * keys.size + 4096:
    return None
  if keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()):  # duplicates: leave them to the search
    return None
  found = np.zeros(int(keys[-1]) + 2, bool)
  dense = np.zeros(found.size, values.dtype)
  found[keys] = True
  dense[keys] = values
  return found, dense


_HASH_MIX = np.uint64(0x9E3779B97F4A7C15)
_HASH_MAX_KEYS = 1 << 20  # larger tables keep the binary search: the hash form adds 12 bytes a slot (<= 24 MiB)


def _hash_table(keys: np.ndarray):
  """(slot keys uint64 [S], slot rows int32 [S] (-1 = empty), log2 S): the distinct sorted `keys` in an
  open-addressing table (linear probing, load <= 1/2), so that a lookup costs a few gathers over the queries
  instead of a sort and a binary search. None when keys repeat (the search's leftmost-match rule then decides),
  or for tables past _HASH_MAX_KEYS."""
  if (keys.size == 0 or keys.size > _HASH_MAX_KEYS or keys.dtype != np.uint64
      or (keys.size > 1 and not bool((keys[1:] > keys[:-1]).all()))):
    return None
  bits = max(4, int(2 * keys.size - 1).bit_length())
  size = 1 << bits
  slot_keys = np.zeros(size, np.uint64)
  slot_rows = np.full(size, -1, np.int32)
  pending = np.arange(keys.size)
  pos = ((keys * _HASH_MIX) >> np.uint64(64 - bits)).astype(np.int64)
  while pending.size:
    free = slot_rows[pos] < 0
    # Of the keys that want the same free slot the first takes it; the others (and those finding the slot taken)
    # try again, the latter one slot further on.
    _, first = np.unique(pos[free], return_index=True)
    winners = np.flatnonzero(free)[first]
    slot_keys[pos[winners]] = keys[pending[winners]]
    slot_rows[pos[winners]] = pending[winners]
    losers = np.ones(pending.size, bool)
    losers[winners] = False
    pending = pending[losers]
    pos = np.where(free[losers], pos[losers], (pos[losers] + 1) & (size - 1))
  return slot_keys, slot_rows, bits


def _table_lookup(table, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`_lookup(keys, values, query)` with `table` = (keys, values, dense form, hash form): the same result, by
  direct indexing where the dense form exists, else by probing the hash form, else by binary search."""
  keys, values, dense, hashed = table
  if dense is not None:
    found_at, dense_values = dense
    at = np.minimum(query, np.uint64(found_at.size - 1))
    found = found_at[at]
    return found, np.where(found, dense_values[at], 0.0)
  if hashed is None:
    return _lookup(keys, values, query)
  slot_keys, slot_rows, bits = hashed
  wrap = (1 << bits) - 1
  pos = ((query * _HASH_MIX) >> np.uint64(64 - bits)).astype(np.int64)
  row = slot_rows[pos]
  found = (slot_keys[pos] == query) & (row >= 0)
  rows = np.where(found, row, 0)
  todo = np.flatnonzero(~found & (row >= 0))  # neither found nor at an empty slot: probe on
  while todo.size:
    pos_todo = (pos[todo] + 1) & wrap
    pos[todo] = pos_todo
    row = slot_rows[pos_todo]
    hit = (slot_keys[pos_todo] == query[todo]) & (row >= 0)
    found[todo[hit]] = True
    rows[todo[hit]] = row[hit]
    todo = todo[~hit & (row >= 0)]
  return found, np.where(found, values[rows], 0.0)


class NgramLM:
  """Backoff-form n-gram model; build it with `train_kneser_ney`, `train_stupid_backoff`, `read_arpa` or `load`."""

  def __init__(self, order: int, probs: list, backoffs: list, unk_logprob: float, missing_backoff: float,
               bos: int, eos: int):
    self.order, self.probs, self.backoffs = order, probs, backoffs  # lists of (sorted keys, log10 values)
    self.unk_logprob, self.missing_backoff, self.bos, self.eos = unk_logprob, missing_backoff, bos, eos
    self._tables = None  # (probs, backoffs) with their dense or hash forms, built on first use

  def _lookup_tables(self):
    if self._tables is None:
      def forms(keys, values):
        dense = _dense_table(keys, values)
        return keys, values, dense, (_hash_table(keys) if dense is None else None)
      self._tables = ([forms(k, v) for k, v in self.probs], [forms(k, v) for k, v in self.backoffs])
    return self._tables

  def token_logprobs(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 [T]: log10 P(token | history) for every token; 0 where positions == 0 (the `<s>` tokens).

    Like KenLM, the match is extended leftwards one token at a time and stops at the first n-gram (or context)
    not in the model, so only tokens still matching are looked up at the next order."""
    hashes = ngram_hashes(tokens, self.order)
    prob_tables, backoff_tables = self._lookup_tables()
    logp = np.full(tokens.shape, self.unk_logprob)
    best = np.zeros(tokens.shape, np.int64)
    active = np.flatnonzero(positions >= 1)
    for n in range(1, self.order + 1):
      active = active[positions[active] >= n - 1]
      found, values = _table_lookup(prob_tables[n - 1], hashes[n - 1][active])
      active = active[found]
      logp[active] = values[found]
      best[active] = n
    backoff = np.zeros(tokens.shape)
    active = np.flatnonzero(positions >= 1)
    for k in range(1, self.order):
      active = active[positions[active] >= k]
      found, values = _table_lookup(backoff_tables[k - 1], hashes[k - 1][active - 1])
      if self.missing_backoff:  # stupid backoff: a constant per order backed off, whether the context exists or not
        backoff += np.where((positions >= k) & (best <= k), self.missing_backoff, 0.0)
        continue
      active = active[found]
      backoff[active] += np.where(best[active] <= k, values[found], 0.0)
    return np.where(positions > 0, logp + backoff, 0.0)

  def save(self, path: str) -> None:
    arrays = {"meta": np.array([self.order, self.unk_logprob, self.missing_backoff, self.bos, self.eos])}
    for n, (k, v) in enumerate(self.probs, 1):
      arrays[f"prob_keys_{n}"], arrays[f"prob_values_{n}"] = k, v
    for n, (k, v) in enumerate(self.backoffs, 1):
      arrays[f"backoff_keys_{n}"], arrays[f"backoff_values_{n}"] = k, v
    with open(path, "wb") as f:  # a file object: np.savez would otherwise append .npz to the name
      np.savez(f, **arrays)

  @classmethod
  def load(cls, path: str) -> "NgramLM":
    with np.load(path) as z:
      order, unk, missing, bos, eos = z["meta"].tolist()
      order = int(order)
      probs = [(z[f"prob_keys_{n}"], z[f"prob_values_{n}"]) for n in range(1, order + 1)]
      backoffs = [(z[f"backoff_keys_{n}"], z[f"backoff_values_{n}"]) for n in range(1, order)]
    return cls(order, probs, backoffs, unk, missing, int(bos), int(eos))


def _sorted_table(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  order = np.argsort(keys)
  return keys[order], values[order].astype(np.float32)


def _count(tokens: np.ndarray, positions: np.ndarray, order: int):
  """Per order n: unique n-gram hashes, raw counts, and their suffix and context hashes."""
  hashes = ngram_hashes(tokens, order)
  out = []
  for n in range(1, order + 1):
    where = np.flatnonzero(positions >= max(n - 1, 1))
    keys, first, counts = np.unique(hashes[n - 1][where], return_index=True, return_counts=True)
    at = where[first]
    suffix = hashes[n - 2][at] if n > 1 else None
    context = hashes[n - 2][at - 1] if n > 1 else None
    out.append((keys, counts.astype(np.float64), suffix, context))
  return out


def _check_order(order: int) -> None:
  if not 1 <= order <= 10:
    raise ValueError(f"perplexity.order must be between 1 and 10; got {order}")


def _corpus_counts(sentences: Sequence[Sequence[int]], vocab_size: int, order: int):
  """(bos, eos, tokens, positions, per-order counts) of a training corpus (`flatten`, `_count`); `<s>` and `</s>`
  are vocab_size and vocab_size + 1."""
  _check_order(order)
  bos, eos = vocab_size, vocab_size + 1
  tokens, positions = flatten(sentences, bos, eos)
  if tokens.size == 0:
    raise ValueError("the perplexity reference corpus is empty; point perplexity.reference at text")
  return bos, eos, tokens, positions, _count(tokens, positions, order)


def train_kneser_ney(sentences: Sequence[Sequence[int]], vocab_size: int, order: int = 4) -> NgramLM:
  """Interpolated Kneser-Ney (one discount per order, D = n1 / (n1 + 2 n2)) over sentences of token ids in
  [0, vocab_size); lower orders use continuation counts, except n-grams that start with `<s>` (as KenLM does).
  The unigram level interpolates with the uniform distribution over vocab_size + 1 tokens (with `</s>`)."""
  bos, eos, _, _, levels = _corpus_counts(sentences, vocab_size, order)
  adjusted = []
  for n in range(1, order + 1):
    keys, counts, _, _ = levels[n - 1]
    if n == order:
      adjusted.append(counts)
      continue
    higher_suffix = levels[n][2]
    suf, cont = np.unique(higher_suffix, return_counts=True)
    found, values = _lookup(suf, cont.astype(np.float64), keys)
    adjusted.append(np.where(found, values, counts))
  probs, backoffs = [], []
  lower_keys = lower_p = None
  unk_logprob = 0.0
  for n in range(1, order + 1):
    keys, _, suffix, context = levels[n - 1]
    a = adjusted[n - 1]
    n1, n2 = float((a == 1).sum()), float((a == 2).sum())
    d = n1 / (n1 + 2 * n2) if n1 > 0 and n2 > 0 else 0.5
    d = min(max(d, 0.05), 0.95)
    if n == 1:
      total = a.sum()
      gamma = d * keys.size / total
      p = (a - d) / total + gamma / (vocab_size + 1)
      unk_logprob = math.log10(gamma / (vocab_size + 1))
    else:
      ctx, inverse = np.unique(context, return_inverse=True)
      inverse = inverse.ravel()
      total = np.bincount(inverse, weights=a)
      gamma = d * np.bincount(inverse) / total
      found, p_lower = _lookup(lower_keys, lower_p, suffix)
      if not found.all():  # cannot happen for counts from one corpus; guards a broken invariant
        raise AssertionError("Kneser-Ney: an n-gram suffix is missing from the lower order")
      p = (a - d) / total[inverse] + gamma[inverse] * p_lower
      backoffs.append(_sorted_table(ctx, np.log10(gamma)))
    probs.append(_sorted_table(keys, np.log10(p)))
    lower_keys, lower_p = keys, p
  return NgramLM(order, probs, backoffs, unk_logprob, 0.0, bos, eos)


def train_stupid_backoff(sentences: Sequence[Sequence[int]], vocab_size: int, order: int = 4,
                         alpha: float = 0.4) -> NgramLM:
  """Stupid backoff (Brants et al. 2007): relative frequencies, times `alpha` per order backed off.
  Scores are not normalised probabilities, but rank documents the same way at a fraction of the cost."""
  bos, eos, tokens, positions, levels = _corpus_counts(sentences, vocab_size, order)
  hashes = ngram_hashes(tokens, order)
  probs = []
  for n in range(1, order + 1):
    keys, counts, _, context = levels[n - 1]
    if n == 1:
      denominators = np.full(counts.shape, counts.sum())
    else:
      # Context counts: occurrences of the (n-1)-gram as a history, i.e. followed by any token.
      where = np.flatnonzero(positions >= n - 1)
      ctx_keys, ctx_counts = np.unique(hashes[n - 2][where - 1], return_counts=True)
      _, denominators = _lookup(ctx_keys, ctx_counts.astype(np.float64), context)
    probs.append(_sorted_table(keys, np.log10(counts / denominators)))
  total = levels[0][1].sum()
  empty = (np.zeros(0, np.uint64), np.zeros(0, np.float32))
  return NgramLM(order, probs, [empty] * (order - 1), math.log10(0.5 / total), math.log10(alpha), bos, eos)


def read_arpa(path: str, token_id: Callable[[str], int | None], vocab_size: int) -> NgramLM:
  """An ARPA file (e.g. from KenLM's lmplz) over the same sentencepiece pieces; `token_id(piece)` maps a word to
  its id (None for words it does not know, which are skipped). `<s>`, `</s>` and `<unk>` are handled here."""
  bos, eos = vocab_size, vocab_size + 1
  grams: dict[int, list] = {}
  order = 0
  unk_logprob = -100.0
  section = 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      if line.startswith("\\") and line.endswith("-grams:"):
        section = int(line[1:line.index("-")])
        order = max(order, section)
        grams[section] = []
        continue
      if line.startswith("\\") or section == 0:
        continue
      fields = line.split("\t")
      if len(fields) < 2:
        fields = line.split()
        fields = [fields[0], " ".join(fields[1:1 + section])] + fields[1 + section:]
      logprob, words = float(fields[0]), fields[1].split(" ")
      backoff = float(fields[2]) if len(fields) > 2 else 0.0
      if words == ["<unk>"]:
        unk_logprob = logprob
        continue
      ids = []
      for w in words:
        i = bos if w == "<s>" else eos if w == "</s>" else token_id(w)
        if i is None:
          break
        ids.append(i)
      else:
        grams[section].append((ids, logprob, backoff))
  if order == 0:
    raise ValueError(f"{path} has no \\n-grams: sections; is it an ARPA file?")
  powers = _powers(order)
  probs, backoffs = [], []
  for n in range(1, order + 1):
    entries = grams.get(n, [])
    ids = np.array([e[0] for e in entries], dtype=np.uint64).reshape(-1, n) + np.uint64(1)
    keys = np.zeros(ids.shape[0], np.uint64)
    for j in range(n):
      keys = keys + ids[:, j] * powers[n - 1 - j]
    probs.append(_sorted_table(keys, np.array([e[1] for e in entries], np.float64)))
    if n < order:
      backoffs.append(_sorted_table(keys, np.array([e[2] for e in entries], np.float64)))
  return NgramLM(order, probs, backoffs, unk_logprob, 0.0, bos, eos)
