"""Heuristic quality filters: Gopher's rules (Rae et al. 2021, appendix A) and C4's document-level rules.

Words come from `text.words`, which counts each character of a script written without spaces (Chinese,
Japanese, Thai, ...) as one word; for documents mostly in such scripts the mean-word-length rule is skipped, so
those languages are not thrown away. The stop-word rule applies only to the languages it has a list for.
"""
from __future__ import annotations

import operator
import re
from collections import Counter

from data.curate import text as textlib

_ALPHA_RE = re.compile(r"[^\W\d_]")
_NO_ALPHA_TOKEN_RE = re.compile(r"(?<!\S)(?:[^\s\w]|[\d_])+(?!\S)")
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "*", "-", "–", "—", "·", "‣", "⁃")
_TERMINAL = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…", "」", "»")
_POLICY = ("javascript", "cookie policy", "uses cookies", "use of cookies", "use cookies", "terms of use",
           "privacy policy", "all rights reserved")
_POLICY_RE = re.compile("|".join(map(re.escape, _POLICY)))
STOP_WORDS = {"en": frozenset(("the", "be", "to", "of", "and", "that", "have", "with"))}


def _duplicate_stats(items: list[str]) -> tuple[float, float]:
  """(fraction of items that repeat an earlier one, fraction of characters in those repeats)."""
  seen: set[str] = set()
  dup_items = dup_chars = total_chars = 0
  for item in items:
    total_chars += len(item)
    if item in seen:
      dup_items += 1
      dup_chars += len(item)
    else:
      seen.add(item)
  return dup_items / max(1, len(items)), dup_chars / max(1, total_chars)


def _top_ngram_fractions(words: list[str], sizes: list[int], total_chars: int) -> dict[int, float]:
  """{n: characters in the most frequent word n-gram (all its occurrences, if it repeats) over all word
  characters}.

  An n-gram can repeat only where its leading (n-1)-gram repeats, so each size above 2 is counted only at the
  positions where the size below repeated (few, in natural text)."""
  out = {n: 0.0 for n in sizes}
  if len(words) < 2 or not sizes:
    return out
  grams = list(zip(words, words[1:]))
  positions = range(len(grams))
  n = 2
  while True:
    counts = Counter(grams)
    gram, count = max(counts.items(), key=operator.itemgetter(1))
    if count < 2:
      return out
    if n in out:
      out[n] = count * sum(map(len, gram)) / max(1, total_chars)
    n += 1
    if n > max(sizes):
      return out
    positions = [i for i, g in zip(positions, grams) if counts[g] > 1 and i + n <= len(words)]
    grams = [tuple(words[i:i + n]) for i in positions]
    if not grams:
      return out


def _duplicate_ngram_fraction(words: list[str], n: int, total_chars: int) -> float:
  """Characters of words covered by word n-grams that occur more than once, over all word characters."""
  if len(words) < n:
    return 0.0
  grams = list(zip(*(words[i:] for i in range(n))))
  counts = Counter(grams)
  covered = [False] * len(words)
  for i, gram in enumerate(grams):
    if counts[gram] > 1:
      for j in range(i, i + n):
        covered[j] = True
  return sum(len(w) for w, c in zip(words, covered) if c) / max(1, total_chars)


def check(text: str, language: str, cfg) -> str | None:
  """None if `text` passes every enabled rule, else the name of the first rule it fails. `cfg` is the
  `quality` section of the curation config."""
  lines = [line.strip() for line in text.split("\n") if line.strip()]
  words = textlib.words(text)
  n = len(words)
  if n < cfg.min_words:
    return "min_words"
  if cfg.max_words and n > cfg.max_words:
    return "max_words"
  total_chars = sum(map(len, words))
  spaced = text.isascii() or not textlib.has_spaceless(text)  # then `words` is text.split()
  if spaced or textlib.spaceless_fraction(words) < 0.5:
    mean = total_chars / n
    if mean < cfg.min_mean_word_length or mean > cfg.max_mean_word_length:
      return "mean_word_length"
  symbols = text.count("#") + text.count("...") + text.count("…")
  if symbols / n > cfg.max_symbol_word_ratio:
    return "symbol_word_ratio"
  if lines:
    if sum(line.startswith(_BULLETS) for line in lines) / len(lines) > cfg.max_bullet_lines_fraction:
      return "bullet_lines"
    if sum(line.endswith(("...", "…")) for line in lines) / len(lines) > cfg.max_ellipsis_lines_fraction:
      return "ellipsis_lines"
  if spaced:  # one regex pass over the text counts its whitespace-separated tokens without a letter
    with_alpha = n - len(_NO_ALPHA_TOKEN_RE.findall(text))
  else:
    with_alpha = len(list(filter(None, map(_ALPHA_RE.search, words))))
  if with_alpha / n < cfg.min_alpha_words_fraction:
    return "alpha_words"
  lowered = list(map(str.lower, words))
  stop = STOP_WORDS.get(language)
  if stop is not None and cfg.min_stop_words and sum(map(stop.__contains__, lowered)) < cfg.min_stop_words:
    return "stop_words"
  line_frac, line_char_frac = _duplicate_stats(lines)
  if line_frac > cfg.max_duplicate_line_fraction or line_char_frac > cfg.max_duplicate_line_char_fraction:
    return "duplicate_lines"
  paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
  para_frac, para_char_frac = _duplicate_stats(paras)
  if para_frac > cfg.max_duplicate_paragraph_fraction or para_char_frac > cfg.max_duplicate_paragraph_char_fraction:
    return "duplicate_paragraphs"
  top = _top_ngram_fractions(lowered, [int(size) for size, _ in cfg.max_top_ngram_fraction], total_chars)
  for size, limit in cfg.max_top_ngram_fraction:
    if top[int(size)] > limit:
      return f"top_{int(size)}gram"
  dup_sizes = [(int(size), limit) for size, limit in cfg.max_duplicate_ngram_fraction]
  # A repeated n-gram contains a repeated shorter one: if no smallest-size n-gram repeats, none repeats.
  if dup_sizes and len(lowered) >= min(s for s, _ in dup_sizes):
    smallest = min(s for s, _ in dup_sizes)
    grams = list(zip(*(lowered[i:] for i in range(smallest))))
    if len(set(grams)) < len(grams):
      for size, limit in dup_sizes:
        if _duplicate_ngram_fraction(lowered, size, total_chars) > limit:
          return f"duplicate_{size}gram"
  # C4 (Raffel et al. 2020), at the document level.
  lower_text = text.lower()
  if cfg.c4_lorem_ipsum and "lorem ipsum" in lower_text:
    return "lorem_ipsum"
  if cfg.c4_curly_bracket and "{" in text:
    return "curly_bracket"
  if lines:
    if _POLICY_RE.search(lower_text) and (sum(1 for line in lines if _POLICY_RE.search(line.lower())) / len(lines)
                                          > cfg.c4_max_policy_line_fraction):
      return "policy_lines"
    if sum(line.endswith(_TERMINAL) for line in lines) / len(lines) < cfg.c4_min_terminal_line_fraction:
      return "terminal_punctuation"
  return None
