"""Fill-in-the-middle (FIM): the document transformation of Bavarian et al. 2022, "Efficient Training of Language
Models to Fill in the Middle" (arXiv:2207.14255), applied per document before tokenization and packing.

With probability `data.fim_rate` a document's characters are cut at two uniform random points into
prefix | middle | suffix (character-level split, the paper's default; with `data.fim_level=token` the document is
tokenized whole and cut at two uniform token boundaries instead) and the document becomes, in sentinel
tokens from the tokenizer's reserved pieces (data/tokenizer.py RESERVED):

    PSM:  <|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|> middle
    SPM:  <|fim_prefix|> <|fim_suffix|> suffix <|fim_middle|> prefix middle      (probability data.fim_spm_rate)

each part encoded on its own (as at inference, where prefix and suffix arrive separately; token level: the slices
of the whole document's tokens). The pipeline then adds
BOS in front and EOS after the middle as for every document, so the model learns to end the middle with EOS (the
paper's <EOT>). SPM is the paper's variant in which prefix and middle are contiguous (sec. 3, appendix D).

Determinism: a document's plan is drawn from numpy's PCG64 seeded with (fim seed, the document's index in the
mixture); the pipeline's documents are indexed, so a resumed run transforms every document exactly as before.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

PREFIX, MIDDLE, SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
# Folded into the FIM generator's seed so its draws are independent of other uses of the shuffle seed.
_FIM_SALT = 0x46494D


LEVELS = ("char", "token")


def check_level(level: str) -> None:
  """ValueError naming config.data.fim_level unless it is one of LEVELS."""
  if level not in LEVELS:
    raise ValueError(f"config.data.fim_level={level!r} must be one of {', '.join(LEVELS)}")


class Plan(NamedTuple):
  """A document's FIM split: characters [0, cut1) prefix, [cut1, cut2) middle, [cut2, n) suffix; `spm` order."""
  cut1: int
  cut2: int
  spm: bool


class TokenPlan(NamedTuple):
  """A token-level FIM split, drawn before the document is tokenized: u1 <= u2 in [0, 1) become the token cuts
  floor(u (n + 1)) of its n tokens (`cuts`), each uniform over the n + 1 token boundaries; `spm` order."""
  u1: float
  u2: float
  spm: bool

  def cuts(self, n_tokens: int) -> tuple[int, int]:
    return int(self.u1 * (n_tokens + 1)), int(self.u2 * (n_tokens + 1))


def plan(seed: int, index: int, n_chars: int, rate: float, spm_rate: float,
         level: str = "char") -> Plan | TokenPlan | None:
  """The FIM plan of document `index` (None: left as it is), drawn from PCG64(seed, index); `level` char cuts
  the text's n_chars characters, token its tokens (TokenPlan; n_chars unused)."""
  check_level(level)
  if rate <= 0:
    return None
  rng = np.random.default_rng([_FIM_SALT, seed, index])
  if rng.random() >= rate:
    return None
  if level == "token":
    u1, u2 = sorted(float(u) for u in rng.random(2))
    return TokenPlan(u1, u2, bool(rng.random() < spm_rate))
  cut1, cut2 = sorted(int(c) for c in rng.integers(0, n_chars + 1, size=2))
  return Plan(cut1, cut2, bool(rng.random() < spm_rate))


def sentinels(tokenizer) -> tuple[int, int, int]:
  """(prefix, middle, suffix) sentinel ids; ValueError naming the fix if the tokenizer lacks them."""
  try:
    return tuple(tokenizer.special_id(p) for p in (PREFIX, MIDDLE, SUFFIX))
  except (KeyError, AttributeError):
    raise ValueError(f"config.data.fim_rate > 0 needs the tokenizer's reserved pieces {PREFIX}, {MIDDLE}, "
                     f"{SUFFIX}; use a meshlm tokenizer (config.data.tokenizer='' trains one) or set "
                     "config.data.fim_rate=0") from None


def encode(tokenizer, text: str, p: Plan | TokenPlan) -> list[int]:
  """Token ids of `text` transformed by `p` (no BOS/EOS: the pipeline adds them as for every document)."""
  pre, mid, suf = sentinels(tokenizer)
  if isinstance(p, TokenPlan):
    ids = tokenizer.encode(text)
    cut1, cut2 = p.cuts(len(ids))
    prefix, middle, suffix = ids[:cut1], ids[cut1:cut2], ids[cut2:]
  else:
    prefix, middle, suffix = (tokenizer.encode(t) if t else []
                              for t in (text[:p.cut1], text[p.cut1:p.cut2], text[p.cut2:]))
  if p.spm:
    return [pre, suf] + suffix + [mid] + prefix + middle
  return [pre] + prefix + [suf] + suffix + [mid] + middle


def infill_prompt(tokenizer, prefix: str, suffix: str, spm: bool = False) -> list[int]:
  """The prompt whose continuation (up to EOS) is the middle between `prefix` and `suffix` (no BOS)."""
  pre, mid, suf = sentinels(tokenizer)
  prefix_ids, suffix_ids = (tokenizer.encode(t) if t else [] for t in (prefix, suffix))
  if spm:
    return [pre, suf] + suffix_ids + [mid] + prefix_ids
  return [pre] + prefix_ids + [suf] + suffix_ids + [mid]


def parts(ids: Sequence[int], sentinel_ids: tuple[int, int, int]) -> tuple[list[int], list[int], list[int], bool]:
  """(prefix, middle, suffix, spm) token ids of a FIM-transformed document (inverse of `encode`; ValueError if
  `ids` is not one). SPM keeps prefix and middle contiguous after <|fim_middle|>: its prefix comes back empty and
  its middle holds both."""
  pre, mid, suf = sentinel_ids
  ids = list(ids)
  if ids[:2] == [pre, suf]:
    m = ids.index(mid)
    return [], ids[m + 1:], ids[2:m], True
  if ids[:1] == [pre] and suf in ids and mid in ids:
    s, m = ids.index(suf), ids.index(mid)
    return ids[1:s], ids[m + 1:], ids[s + 1:m], False
  raise ValueError("not a FIM-transformed document: it does not start with the FIM sentinels")


def restore(tokenizer, ids: Sequence[int]) -> str:
  """The original text of a FIM-transformed document: the ids prefix + middle + suffix (SPM: (prefix middle) +
  suffix, the two being contiguous) decoded together (a token-level cut may fall inside a character's bytes)."""
  prefix, middle, suffix, _ = parts(ids, sentinels(tokenizer))
  return tokenizer.decode(prefix + middle + suffix)


class FimTransform:
  """grain `map_with_index` transform: (index, (source_id, text)) -> (source_id, text, Plan | TokenPlan | None);
  chat sources (`skip_sources`) and empty documents are never transformed."""

  def __init__(self, seed: int, rate: float, spm_rate: float, skip_sources: Sequence[int] = (),
               level: str = "char"):
    check_level(level)
    self.seed, self.rate, self.spm_rate, self.skip, self.level = seed, rate, spm_rate, frozenset(skip_sources), level

  def __call__(self, index: int, element):
    source_id, text = element
    if source_id in self.skip or not text:
      return source_id, text, None
    return source_id, text, plan(self.seed, index, len(text), self.rate, self.spm_rate, self.level)
