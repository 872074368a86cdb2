"""Masking of e-mail addresses, IP addresses and phone numbers (stage 9)."""
from __future__ import annotations

import re

EMAIL_RE = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4_RE = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?![\d.]*\d)")
IPV6_RE = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}(?![\w:])"
                     r"|(?<![\w:])(?:[0-9A-Fa-f]{1,4}:){1,6}:(?:[0-9A-Fa-f]{1,4}:){0,5}[0-9A-Fa-f]{1,4}(?![\w:])")
# A leading + or a separated group structure: plain long numbers (years, ids, prices) are left alone.
PHONE_RE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){1,4}(?!\w)"
                      r"|(?<![\w+])\+\d{7,14}(?!\w)")
_DIGIT_RE = re.compile(r"\d")
_IPV4_HINT_RE = re.compile(r"\d\.\d")
_PHONE_HINT_RE = re.compile(r"(?:\d\D{0,3}){6}\d")  # seven digits close together: every phone match has them
_DATE_RE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{4}")


def mask(text: str, cfg) -> tuple[str, int]:
  """(text with the enabled kinds replaced by their masks, number of replacements). `cfg` is the `pii` section."""
  count = 0
  # Cheap tests first: most documents have no '@', few digits, and no run of seven digits.
  if cfg.email and "@" in text:
    text, n = EMAIL_RE.subn(cfg.email_mask, text)
    count += n
  if cfg.ip and text.count(":") >= 2:
    text, n = IPV6_RE.subn(cfg.ip_mask, text)
    count += n
  has_digit = _DIGIT_RE.search(text) is not None
  if cfg.ip and has_digit and _IPV4_HINT_RE.search(text):
    text, n = IPV4_RE.subn(cfg.ip_mask, text)
    count += n
  if cfg.phone and has_digit and _PHONE_HINT_RE.search(text):
    text, n = _mask_phones(text, cfg.phone_mask)
    count += n
  return text, count


def _mask_phones(text: str, replacement: str) -> tuple[str, int]:
  count = 0

  def sub(match: re.Match) -> str:
    nonlocal count
    found = match.group(0)
    if sum(ch.isdigit() for ch in found) < 7 or _DATE_RE.fullmatch(found):
      return found
    count += 1
    return replacement

  return PHONE_RE.sub(sub, text), count
