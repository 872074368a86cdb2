"""Text helpers shared by the curation stages: CCNet's normalisation for hashing, paragraphs, words, hashes.

Everything here is deterministic across processes and machines (no Python `hash()`, whose seed varies).
"""
from __future__ import annotations

import hashlib
import re
import unicodedata

import numpy as np


def _build_hash_table() -> dict[int, int | None]:
  """Maps code points for `str.translate`: punctuation, control/format chars and combining marks dropped,
  decimal digits to '0'. Built once over the Basic Multilingual Plane plus the supplementary punctuation."""
  table: dict[int, int | None] = {}
  for cp in range(0x30000):
    cat = unicodedata.category(chr(cp))
    if cat[0] == "P" or cat in ("Cc", "Cf", "Mn", "Me"):
      table[cp] = None
    elif cat == "Nd" and cp != 0x30:
      table[cp] = 0x30
  for ws in "\t\n\r\x0b\x0c":  # whitespace stays whitespace (control chars otherwise)
    table[ord(ws)] = 0x20
  return table


_HASH_TABLE = _build_hash_table()
_HASH_TABLE_LINES = {**_HASH_TABLE, ord("\n"): ord("\n")}  # the same, keeping line breaks
# The ASCII part of _HASH_TABLE as `bytes.translate` arguments (mapping, deleted bytes): far faster on ASCII text.
# (Deleted bytes go before the mapping applies, so their own entries are left as they are.)
HASH_TABLE_ASCII = bytes(cp if _HASH_TABLE.get(cp, cp) is None else _HASH_TABLE.get(cp, cp) for cp in range(128)) \
    + bytes(range(128, 256))
HASH_DELETE_ASCII = bytes(cp for cp in range(128) if cp in _HASH_TABLE and _HASH_TABLE[cp] is None)
_HASH_TABLE_LINES_ASCII = HASH_TABLE_ASCII[:10] + b"\n" + HASH_TABLE_ASCII[11:]


def normalize_for_hash(text: str) -> str:
  """CCNet's normalisation before hashing: lowercase, accents stripped, digits -> 0, punctuation and
  non-printing characters removed, whitespace collapsed. `"Été 2024, à Paris!"` -> `"ete 0000 a paris"`."""
  text = text.lower()
  if not text.isascii():
    text = unicodedata.normalize("NFD", text)  # splits accents off their letters so the table drops them
  return " ".join(text.translate(_HASH_TABLE).split())


def lines_for_lm(text: str) -> list[str]:
  """The non-empty lines of `text` normalised for the perplexity model (as CCNet does for its KenLM models):
  lowercase, digits -> 0, whitespace collapsed; punctuation and accents kept."""
  text = text.lower()
  # \d on ASCII is 0-9 only; str.translate has a fast path for ASCII that the regex substitution lacks.
  text = text.translate(_ASCII_DIGITS_TO_ZERO) if text.isascii() else _DIGIT_RE.sub("0", text)
  return [line for line in map(" ".join, map(str.split, text.split("\n"))) if line]


_DIGIT_RE = re.compile(r"\d")
_ASCII_DIGITS_TO_ZERO = str.maketrans("123456789", "000000000")


def hash64(text: str) -> int:
  """A stable 64-bit hash of `text` (blake2b); never 0 so that 0 can mean 'no hash'."""
  return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") or 1


def paragraphs(text: str) -> list[str]:
  """CCNet's paragraphs are the lines of a document."""
  return text.split("\n")


def paragraph_hashes(text: str) -> np.ndarray:
  """uint64 [num_paragraphs]: hash of each normalised line; 0 for lines that normalise to nothing
  (blank or punctuation-only), which deduplication never removes."""
  # normalize_for_hash on every line, done for the whole text at once (the steps act per character).
  text = text.lower()
  if text.isascii():
    # The same steps on bytes (see HASH_TABLE_ASCII): whitespace left inside a line is only b" ", so bytes.split()
    # splits as str.split() does, and the bytes hashed are the UTF-8 encoding hash64 would take.
    out = []
    for line in text.encode("ascii").translate(_HASH_TABLE_LINES_ASCII, HASH_DELETE_ASCII).split(b"\n"):
      norm = b" ".join(line.split())
      out.append((int.from_bytes(hashlib.blake2b(norm, digest_size=8).digest(), "little") or 1) if norm else 0)
    return np.array(out, dtype=np.uint64)
  text = unicodedata.normalize("NFD", text)
  out = []
  for line in paragraphs(text.translate(_HASH_TABLE_LINES)):
    norm = " ".join(line.split())
    out.append(hash64(norm) if norm else 0)
  return np.array(out, dtype=np.uint64)


def utf8_length(text: str) -> int:
  """Length in UTF-8 bytes: what the length filter counts, fair across scripts where characters are not. A
  Chinese or Japanese character (3 bytes) says about as much as three Latin letters: the Debian Reference's
  translations hold 0.4-0.7x the characters of its English text, but 0.9-1.3x its bytes."""
  return len(text) if text.isascii() else len(text.encode("utf-8"))


# Scripts written without spaces between words: each character counts as one word.
_SPACELESS = ("\u0e00-\u0e7f\u0e80-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff"
              "\u3040-\u30ff\u3100-\u312f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9d")
_SPACELESS_RE = re.compile(f"[{_SPACELESS}]")
_SPACELESS_WORD_RE = re.compile(f"[{_SPACELESS}]|[^\\s{_SPACELESS}]+")


def has_spaceless(text: str) -> bool:
  """Whether `text` holds any character of a script written without spaces (see `words`)."""
  return _SPACELESS_RE.search(text) is not None


def words(text: str) -> list[str]:
  """Whitespace-separated words; runs of Chinese, Japanese, Thai, Lao, Khmer, Burmese or Tibetan script are split
  into single characters, so word-count rules work for languages written without spaces."""
  if text.isascii() or not has_spaceless(text):
    return text.split()
  return _SPACELESS_WORD_RE.findall(text)


def spaceless_fraction(tokens: list[str]) -> float:
  """Fraction of `words()` tokens that are single characters of a script written without spaces."""
  if not tokens:
    return 0.0
  return sum(1 for t in tokens if len(t) == 1 and _SPACELESS_RE.match(t)) / len(tokens)

