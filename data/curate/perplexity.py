"""Stage 6: document perplexity under n-gram models over sentencepiece pieces, and CCNet's quality buckets.

Models are trained by `train_models` on reference corpora (a Wikipedia dump in the user's language is what CCNet
used), or read from a user's ARPA file. A document's perplexity is CCNet's: 10 ** (-sum of log10 probabilities of
all its lines' pieces and `</s>` / number of those tokens), each line normalised by `text.lines_for_lm`.
"""
from __future__ import annotations

import functools
import logging
import os
import re

import numpy as np

from data import files
from data.curate import ngram_lm
from data.curate import text as textlib

log = logging.getLogger(__name__)

SHARED = "*"  # the model used for languages without their own


def reference_groups(entries) -> dict[str, list[str]]:
  """`('GLOB', 'de=GLOB2')` -> {'*': ['GLOB'], 'de': ['GLOB2']}."""
  if isinstance(entries, str):
    entries = (entries,) if entries else ()
  groups: dict[str, list[str]] = {}
  for entry in entries:
    lang, sep, pattern = entry.partition("=")
    if not sep or "/" in lang or "*" in lang:
      lang, pattern = SHARED, entry
    groups.setdefault(lang.strip(), []).append(pattern.strip())
  return groups


def _reference_lines(patterns: list[str], fmt: str, max_lines: int) -> list[str]:
  lines: list[str] = []
  for path in files.expand(patterns, "perplexity.reference"):
    for record in files.read_documents(path, fmt, text_mode="line", format_key="perplexity.reference_format",
                                       field_key="perplexity.reference (JSONL/Parquet: the `text` field)"):
      lines += textlib.lines_for_lm(record["text"])
      if len(lines) >= max_lines:
        return lines[:max_lines]
  return lines


def _train_sentencepiece(lines: list[str], path: str, vocab_size: int) -> None:
  from data import tokenizer  # meshlm's own sentencepiece training (byte fallback: no piece is unknown)
  # One thread: the model (and so every perplexity) must not depend on the machine.
  try:
    tokenizer.train(lines, path, vocab_size, model_type="unigram", max_sentences=len(lines), num_threads=1)
  except RuntimeError as e:
    found = re.search(r"Vocabulary size too high .*?<= (\d+)", str(e))
    if not found:
      raise ValueError(f"training the perplexity model's sentencepiece pieces failed ({e}); perplexity.vocab_size "
                       f"is {vocab_size}: raise it (it must hold the bytes and every character of the reference "
                       "corpus)") from None
    # A small reference corpus cannot fill the vocabulary; use the largest it supports.
    log.warning("perplexity.vocab_size %d is too large for the reference corpus; using %s", vocab_size,
                found.group(1))
    tokenizer.train(lines, path, int(found.group(1)), model_type="unigram", max_sentences=len(lines), num_threads=1)


def train_models(cfg, directory: str) -> dict[str, str]:
  """Trains (or converts) one model per reference group into `directory`/<lang>/ and returns {lang: dir}.

  `cfg` is the `perplexity` config section. Each model directory holds `sp.model` and `lm.npz`."""
  if cfg.smoothing not in ("kneser_ney", "stupid_backoff"):
    raise ValueError(f"perplexity.smoothing {cfg.smoothing!r} unknown; use kneser_ney or stupid_backoff")
  out: dict[str, str] = {}
  if cfg.arpa:
    if not cfg.sp_model:
      raise ValueError("perplexity.arpa needs perplexity.sp_model: the sentencepiece model its words come from")
    target = os.path.join(directory, SHARED)
    os.makedirs(target, exist_ok=True)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=cfg.sp_model)
    unk = sp.unk_id()

    def token_id(piece: str):
      i = sp.piece_to_id(piece)
      return None if i == unk and piece != sp.id_to_piece(unk) else i

    lm = ngram_lm.read_arpa(cfg.arpa, token_id, sp.get_piece_size())
    with open(cfg.sp_model, "rb") as src, open(os.path.join(target, "sp.model"), "wb") as dst:
      dst.write(src.read())
    lm.save(os.path.join(target, "lm.npz"))
    out[SHARED] = target
  groups = reference_groups(cfg.reference)
  if not groups and not out:
    raise ValueError("perplexity is enabled but perplexity.reference is empty: set it to a text/JSONL glob (e.g. "
                     "a Wikipedia dump), give perplexity.arpa, or disable with --config.perplexity.enabled=false")
  for lang, patterns in sorted(groups.items()):
    target = os.path.join(directory, lang)
    os.makedirs(target, exist_ok=True)
    lines = _reference_lines(patterns, cfg.reference_format, cfg.max_reference_lines)
    if not lines:
      raise ValueError(f"perplexity reference {patterns} holds no text")
    sp_path = os.path.join(target, "sp.model")
    _train_sentencepiece(lines, sp_path, cfg.vocab_size)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=sp_path)
    ids = sp.encode(lines)
    train = ngram_lm.train_kneser_ney if cfg.smoothing == "kneser_ney" else ngram_lm.train_stupid_backoff
    train(ids, sp.get_piece_size(), cfg.order).save(os.path.join(target, "lm.npz"))
    out[lang] = target
  return out


@functools.lru_cache(maxsize=64)
def _load(directory: str):
  import sentencepiece as spm
  return spm.SentencePieceProcessor(model_file=os.path.join(directory, "sp.model")), \
      ngram_lm.NgramLM.load(os.path.join(directory, "lm.npz"))


class Scorer:
  """Perplexity of documents with the model of their language (or the shared one)."""

  def __init__(self, models: dict[str, str]):
    self.models = models

  def perplexities(self, texts: list[str], language: str) -> np.ndarray:
    """float64 [len(texts)]; NaN where the language has no model or the text has no line."""
    directory = self.models.get(language, self.models.get(SHARED))
    if directory is None or not texts:
      return np.full(len(texts), np.nan)
    sp, lm = _load(directory)
    lines, owner = [], []
    for i, text in enumerate(texts):
      normalised = textlib.lines_for_lm(text)
      lines += normalised
      owner += [i] * len(normalised)
    if not lines:
      return np.full(len(texts), np.nan)
    ids = sp.encode(lines, num_threads=1)  # one core per worker: the executor provides the parallelism
    tokens, positions = ngram_lm.flatten(ids, lm.bos, lm.eos)
    logp = lm.token_logprobs(tokens, positions)
    lengths = np.array([len(x) + 2 for x in ids])
    doc_of_token = np.repeat(np.asarray(owner), lengths)
    total = np.bincount(doc_of_token, weights=logp, minlength=len(texts))
    count = np.bincount(doc_of_token, weights=(positions > 0).astype(np.float64), minlength=len(texts))
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.where(count > 0, 10.0 ** (-total / np.maximum(count, 1)), np.nan)


def cutoffs(perplexities: np.ndarray, head_percentile: float, tail_percentile: float) -> tuple[float, float]:
  """(head cutoff, tail cutoff): the given percentiles of one language's perplexities (NaN ignored)."""
  if not 0 <= head_percentile <= tail_percentile <= 100:
    raise ValueError(f"need 0 <= perplexity.head_percentile <= perplexity.tail_percentile <= 100; got "
                     f"{head_percentile}, {tail_percentile}")
  values = perplexities[~np.isnan(perplexities)]
  if values.size == 0:
    return float("nan"), float("nan")
  head, tail = np.percentile(values, [head_percentile, tail_percentile])
  return float(head), float(tail)


def bucket(perplexity: float, cut: tuple[float, float]) -> str:
  """CCNet's bucket: head below the head cutoff, tail at or above the tail cutoff, middle between."""
  if perplexity != perplexity or cut[0] != cut[0]:  # NaN: no model for this language
    return "all"
  if perplexity < cut[0]:
    return "head"
  return "middle" if perplexity < cut[1] else "tail"
