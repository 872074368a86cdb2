"""URL filtering (the first curation stage): a domain blocklist and rules on the URL's words, as datatrove's
URLFilter and C4 do for web pages.

A document is dropped when its `url` field
  - has a host that is, or is a subdomain of, a blocklisted domain (a file of domains or URLs, one per line, `#`
    comments; the UT1 blocklists used by RefinedWeb and FineWeb have this form), or equals a blocklisted URL;
  - holds a banned word as one of its words (the URL split at every character that is not a letter or digit, lower
    cased: `banned_words` or a file of them, one per line), or more than `max_soft_words` soft-banned words;
  - has a scheme other than http / https.
Documents without a `url` (text files, JSONL without the field) pass.
"""
from __future__ import annotations

import functools
import re
import urllib.parse

_SPLIT = re.compile(r"[^a-z0-9]+")


def _read_list(path: str) -> list[str]:
  from data import files  # pylint: disable=g-import-not-at-top
  text = files.decode_utf8(files.read_bytes(path), path)
  return [line.split("#", 1)[0].strip().lower() for line in text.splitlines() if line.split("#", 1)[0].strip()]


class UrlFilter:
  """`reason(url)`: why a URL is dropped ("blocklist", "banned_word", "soft_words", "scheme"), or "" to keep."""

  def __init__(self, blocklist: str = "", banned_words=(), banned_words_file: str = "", soft_words=(),
               max_soft_words: int = 2):
    self.domains: set[str] = set()
    self.urls: set[str] = set()
    for entry in _read_list(blocklist) if blocklist else []:
      if "/" in entry.split("://", 1)[-1]:
        self.urls.add(entry.split("://", 1)[-1].rstrip("/"))
      else:
        self.domains.add(entry.split("://", 1)[-1].strip("."))
    self.banned = frozenset(w.lower() for w in banned_words) | frozenset(
        _read_list(banned_words_file) if banned_words_file else ())
    self.soft, self.max_soft = frozenset(w.lower() for w in soft_words), max_soft_words

  def reason(self, url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https"):
      return "scheme"
    host = (parts.hostname or "").lower().rstrip(".")
    labels = host.split(".")
    if any(".".join(labels[i:]) in self.domains for i in range(len(labels))):
      return "blocklist"
    if self.urls and (host + parts.path).rstrip("/") in self.urls:
      return "blocklist"
    words = set(_SPLIT.split(url.lower()))
    if words & self.banned:
      return "banned_word"
    if len(words & self.soft) > self.max_soft:
      return "soft_words"
    return ""


def from_config(cfg) -> UrlFilter | None:
  """The filter of curation's `url_filter` section, or None when the section is off; built once per process and
  settings (every pass reads every shard through it, and a blocklist can hold millions of domains)."""
  u = cfg.url_filter
  if not u.enabled:
    return None
  return _cached(u.blocklist, tuple(u.banned_words), u.banned_words_file, tuple(u.soft_words), u.max_soft_words)


@functools.lru_cache(maxsize=4)
def _cached(*args) -> UrlFilter:
  return UrlFilter(*args)
