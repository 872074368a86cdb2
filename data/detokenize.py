"""Incremental detokenization: the text of a growing sequence of generated ids, piece by piece.

    detok = Detokenizer(tokenizer)
    delta = detok.push(ids)   # the text the new ids add ('' while they end inside a UTF-8 character)
    rest = detok.flush()      # at the end: whatever was held back

The deltas concatenate to `tokenizer.decode(all ids)`, the text `train.generate --json` reports: every delta is
read off one decode of the whole sequence, and a trailing U+FFFD (byte-fallback pieces of a character not yet
complete) is held back until the bytes after it arrive, so a streamed character is never split or replaced.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class Detokenizer:
  """The text of one generated sequence as its ids arrive (module docstring). `tokenizer.decode(ids) -> str`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.text = ""  # what push/flush returned so far, concatenated

  def _delta(self, final: bool) -> str:
    full = self.tokenizer.decode(self.ids)
    if not final:
      full = full.rstrip(REPLACEMENT)  # an incomplete character: wait for its remaining bytes
    if not full.startswith(self.text) or len(full) <= len(self.text):
      return ""
    delta = full[len(self.text):]
    self.text = full
    return delta

  def push(self, ids: Sequence[int]) -> str:
    """The text the new ids add to the sequence's decoding ('' while they end inside a character)."""
    self.ids.extend(int(i) for i in ids)
    return self._delta(final=False) if ids else ""

  def flush(self) -> str:
    """The rest of the text at the end of the sequence (held-back replacement characters included)."""
    return self._delta(final=True)
