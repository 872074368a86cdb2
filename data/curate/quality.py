"""Heuristic quality filters: Gopher's rules (Rae et al. 2021, appendix A) and C4's document-level rules.

Words come from `text.words`, which splits a script written without spaces (Chinese, Japanese, Thai, ...) into
single characters. For a document mostly in such scripts, `spaceless_chars_per_word` characters count as one word
in the word-count rules and the n-gram rules span that many times more characters (a word of Chinese or Japanese
is about two characters: counted one per character, Japanese technical prose, where one katakana word is five
characters, repeats 5-"grams" far more often than its translations repeat 5-word n-grams); the mean-word-length
rule is skipped. So those languages are judged as their translations are. The stop-word rule applies only to the
languages it has a list for.
"""
from __future__ import annotations

import re
from collections import Counter
from itertools import compress, repeat
from operator import add
from typing import NamedTuple

from data.curate import text as textlib

_ALPHA_RE = re.compile(r"[^\W\d_]")
_NO_ALPHA_TOKEN_RE = re.compile(r"(?<!\S)(?:[^\s\w]|[\d_])+(?!\S)")
_BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "*", "-", "–", "—", "·", "‣", "⁃")
_TERMINAL = (".", "!", "?", '"', "'", "”", "’", "。", "！", "？", "…", "」", "»")
_POLICY = ("javascript", "cookie policy", "uses cookies", "use of cookies", "use cookies", "terms of use",
           "privacy policy", "all rights reserved")
_POLICY_RE = re.compile("|".join(map(re.escape, _POLICY)))
_PARAGRAPH_BREAK_RE = re.compile(r"\n\s*\n")
# ASCII text: deleting every character that is neither a letter nor whitespace empties exactly the tokens without
# a letter, so the tokens left count the words with one. \x1c-\x1f are whitespace to str.split (and the regex)
# but not to bytes.split, hence mapped to spaces.
_NON_LETTER_ASCII = bytes(c for c in range(128) if not chr(c).isalpha() and not chr(c).isspace())
_SEPARATORS_TO_SPACE = bytes.maketrans(b"\x1c\x1d\x1e\x1f", b"    ")
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


def _repeated_ngram_levels(words: list[str], max_n: int):
  """Yields (n, count, position) for n = 2 .. max_n while some word n-gram repeats: the count of the most frequent
  n-gram and the position of its first occurrence (of equally frequent ones, the one that occurs first). A size
  whose n-grams all occur once is not yielded, and neither is any larger size.

  An n-gram can repeat only where its leading (n-1)-gram repeats, so each size above 2 is counted only at the
  positions where the size below repeated (few, in natural text). An n-gram is the pair (its leading (n-1)-gram,
  its last word), built by zip and counted by Counter: all in C, no Python loop per position."""
  size = len(words)
  if size < 2:
    return
  grams = list(zip(words, words[1:]))
  positions = range(size - 1)
  n = 2
  while True:
    counts = Counter(grams)
    values = list(counts.values())
    top = max(values)
    if top < 2:
      return
    gram = list(counts)[values.index(top)]  # Counter keeps first-occurrence order: the first of the ties
    yield n, top, positions[grams.index(gram)]
    n += 1
    if n > max_n:
      return
    repeated = list(map((1).__lt__, map(counts.__getitem__, grams)))
    positions = list(compress(positions, repeated))
    grams = list(compress(grams, repeated))
    while positions and positions[-1] + n > size:  # ascending: only a tail can run past the last word
      positions.pop()
      grams.pop()
    if not positions:
      return
    grams = list(zip(grams, map(words.__getitem__, map(add, positions, repeat(n - 1)))))


def _top_ngram_fractions(words: list[str], sizes: list[int], total_chars: int, levels=None) -> dict[int, float]:
  """{n: characters in the most frequent word n-gram (all its occurrences, if it repeats) over all word
  characters}; of equally frequent n-grams the first to occur counts. `levels`: `_repeated_ngram_levels(words,
  ...)` already computed, as a list reaching at least max(sizes) where it can."""
  out = {n: 0.0 for n in sizes}
  if len(words) < 2 or not sizes:
    return out
  if levels is None:
    levels = _repeated_ngram_levels(words, max(sizes))
  for n, count, position in levels:
    if n > max(sizes):
      break
    if n in out:
      out[n] = count * sum(map(len, words[position:position + n])) / max(1, total_chars)
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


class _Doc(NamedTuple):
  """A document split once for every rule: its lines and words, and the units its word counts are in."""
  text: str
  lower_text: str
  lines: list[str]
  ascii_text: bool
  spaced: bool  # `words` is text.split()
  words: list[str]
  lowered: list[str]  # the words lowercased
  n: float  # the word count in the units of a spaced language
  mostly_spaceless: bool
  per_word: float  # characters that count as one word (1 unless mostly spaceless)
  total_chars: int  # characters in words


def _split(text: str, cfg) -> _Doc:
  """`text`'s lines and words, with the word count in the units of a spaced language (1 for those)."""
  lines = [line for line in map(str.strip, text.split("\n")) if line]
  ascii_text = text.isascii()
  spaced = ascii_text or not textlib.has_spaceless(text)
  lower_text = text.lower()
  if ascii_text:
    # Lowercasing ASCII changes no length and no whitespace: the words of the lowered text are the lowered words,
    # and have the same count and lengths, which is all the rules use `words` for here.
    words = lowered = lower_text.split()
  else:
    words = text.split() if spaced else textlib.words(text)
    lowered = list(map(str.lower, words))
  n = len(words)
  spaceless = 0.0 if spaced else textlib.spaceless_fraction(words)
  mostly_spaceless = spaceless >= 0.5
  per_word = cfg.spaceless_chars_per_word if mostly_spaceless else 1
  if mostly_spaceless:
    n = n * (1 - spaceless) + n * spaceless / per_word
  return _Doc(text, lower_text, lines, ascii_text, spaced, words, lowered, n, mostly_spaceless, per_word,
              len("".join(words)))


def _length_rules(doc: _Doc, cfg) -> str | None:
  """Gopher's word count, mean word length and symbol-to-word rules."""
  n = doc.n
  if n < cfg.min_words:
    return "min_words"
  if cfg.max_words and n > cfg.max_words:
    return "max_words"
  if not doc.mostly_spaceless:
    mean = doc.total_chars / n
    if mean < cfg.min_mean_word_length or mean > cfg.max_mean_word_length:
      return "mean_word_length"
  symbols = doc.text.count("#") + doc.text.count("...") + doc.text.count("…")
  if symbols / n > cfg.max_symbol_word_ratio:
    return "symbol_word_ratio"
  return None


def _content_rules(doc: _Doc, language: str, cfg) -> str | None:
  """Gopher's bullet and ellipsis line, alphabetic word and stop-word rules."""
  lines, text = doc.lines, doc.text
  if lines:
    if sum(map(str.startswith, lines, repeat(_BULLETS))) / len(lines) > cfg.max_bullet_lines_fraction:
      return "bullet_lines"
    if sum(map(str.endswith, lines, repeat(("...", "…")))) / len(lines) > cfg.max_ellipsis_lines_fraction:
      return "ellipsis_lines"
  if doc.ascii_text:  # the tokens left once everything but letters and whitespace is deleted (see _NON_LETTER_ASCII)
    with_alpha = len(text.encode("ascii").translate(_SEPARATORS_TO_SPACE, _NON_LETTER_ASCII).split())
  elif doc.spaced:  # one regex pass over the text counts its whitespace-separated tokens without a letter
    with_alpha = doc.n - len(_NO_ALPHA_TOKEN_RE.findall(text))
  else:
    with_alpha = len(list(filter(None, map(_ALPHA_RE.search, doc.words))))
  if with_alpha / len(doc.words) < cfg.min_alpha_words_fraction:
    return "alpha_words"
  stop = STOP_WORDS.get(language)
  if stop is not None and cfg.min_stop_words and sum(map(stop.__contains__, doc.lowered)) < cfg.min_stop_words:
    return "stop_words"
  return None


def _repetition_rules(doc: _Doc, cfg) -> str | None:
  """Gopher's repetition rules: duplicate lines and paragraphs, the top n-gram, duplicate n-grams."""
  line_frac, line_char_frac = _duplicate_stats(doc.lines)
  if line_frac > cfg.max_duplicate_line_fraction or line_char_frac > cfg.max_duplicate_line_char_fraction:
    return "duplicate_lines"
  paras = [p for p in map(str.strip, _PARAGRAPH_BREAK_RE.split(doc.text)) if p]
  para_frac, para_char_frac = _duplicate_stats(paras)
  if para_frac > cfg.max_duplicate_paragraph_fraction or para_char_frac > cfg.max_duplicate_paragraph_char_fraction:
    return "duplicate_paragraphs"
  lowered, total_chars = doc.lowered, doc.total_chars
  top_sizes = [round(size * doc.per_word) for size, _ in cfg.max_top_ngram_fraction]
  dup_sizes = [(round(size * doc.per_word), limit) for size, limit in cfg.max_duplicate_ngram_fraction]
  smallest = min(s for s, _ in dup_sizes) if dup_sizes else 0
  # The repeated n-grams of every size up to the largest either rule needs, computed once for both.
  levels = list(_repeated_ngram_levels(lowered, max(top_sizes + [smallest])))
  top = _top_ngram_fractions(lowered, top_sizes, total_chars, levels)
  for (size, limit), span in zip(cfg.max_top_ngram_fraction, top_sizes):
    if top[span] > limit:
      return f"top_{int(size)}gram"
  # A repeated n-gram contains a repeated shorter one: if no smallest-size n-gram repeats, none repeats.
  if dup_sizes and len(lowered) >= smallest:
    if smallest >= 2:  # `levels` reaches `smallest` exactly when some n-gram of that size repeats
      repeats = bool(levels) and levels[-1][0] >= smallest
    else:
      grams = list(zip(*(lowered[i:] for i in range(smallest))))
      repeats = len(set(grams)) < len(grams)
    if repeats:
      for (size, _), (span, limit) in zip(cfg.max_duplicate_ngram_fraction, dup_sizes):
        if _duplicate_ngram_fraction(lowered, span, total_chars) > limit:
          return f"duplicate_{int(size)}gram"
  return None


def _c4_rules(doc: _Doc, cfg) -> str | None:
  """C4's rules (Raffel et al. 2020), at the document level."""
  lines, lower_text = doc.lines, doc.lower_text
  if cfg.c4_lorem_ipsum and "lorem ipsum" in lower_text:
    return "lorem_ipsum"
  if cfg.c4_curly_bracket and "{" in doc.text:
    return "curly_bracket"
  if lines:
    # Substring tests find any policy phrase far faster than the alternation regex; lines only if one occurs.
    if any(phrase in lower_text for phrase in _POLICY) and (
        sum(1 for line in lines if _POLICY_RE.search(line.lower())) / len(lines) > cfg.c4_max_policy_line_fraction):
      return "policy_lines"
    # A fraction is never below a threshold <= 0 (the default: rule off), so the lines need no scan then.
    if cfg.c4_min_terminal_line_fraction > 0 and (
        sum(map(str.endswith, lines, repeat(_TERMINAL))) / len(lines) < cfg.c4_min_terminal_line_fraction):
      return "terminal_punctuation"
  return None


def check(text: str, language: str, cfg) -> str | None:
  """None if `text` passes every enabled rule, else the name of the first rule it fails. `cfg` is the
  `quality` section of the curation config."""
  doc = _split(text, cfg)
  return (_length_rules(doc, cfg) or _content_rules(doc, language, cfg) or _repetition_rules(doc, cfg)
          or _c4_rules(doc, cfg))
