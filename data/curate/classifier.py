"""A fastText quality classifier, as DCLM and FineWeb-Edu filter with: trained here, saved in fastText's own `.bin`
format, scored by fasttext-predict (the library langid already uses) in the curation stage `quality_model`.

    python -m data.curate.classifier --positive 'reference/*.jsonl' --negative 'crawl/*.jsonl' --output quality.bin

Why a trainer here: PyPI's `fasttext` (the trainer) ships as a C++ source build and installs the same `fasttext`
module as fasttext-predict, so the two cannot live in one environment. The model is fastText's supervised one
(Joulin et al. 2017, "Bag of Tricks for Efficient Text Classification"): a document's hidden vector is the mean
of the input rows of its words (vocabulary ids) and word bigrams (hashed into `bucket` rows, fastText's hash),
the label distribution softmax(output @ hidden); trained by SGD on the log-loss with fastText's update (output rows
by alpha * hidden, every input row by the hidden gradient / the number of features, lr decaying linearly to 0).
The `.bin` written loads in fasttext-predict and in the original fastText, and tests check that its probabilities
equal this module's forward pass.

Texts are prepared as DCLM does: lower-cased, whitespace collapsed to single spaces (one line), split on ASCII
whitespace as fastText reads, with the end-of-line token `</s>` last.
"""
from __future__ import annotations

import argparse
import os
import re
import struct
import sys
from typing import Iterable, Sequence

import numpy as np

MAGIC, VERSION = 793712314, 12
EOS, LABEL_PREFIX = "</s>", "__label__"
POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
_SPACES = re.compile(r"[ \n\r\t\v\f\x00]+")


def prepare(text: str) -> str:
  """The one-line form both training and scoring see: lower case, runs of whitespace as one space."""
  return " ".join(text.lower().split())


def fasttext_hash(token: str) -> int:
  """fastText's FNV-1a over the UTF-8 bytes, each byte sign-extended as a signed char (uint32)."""
  h = 2166136261
  for b in token.encode("utf-8"):
    h = ((h ^ ((b - 256 if b > 127 else b) & 0xFFFFFFFF)) * 16777619) & 0xFFFFFFFF
  return h


class Model:
  """words: the vocabulary (EOS first); input_ [len(words) + bucket, dim]; output [2, dim] (rows: hq, lq)."""

  def __init__(self, words: list[str], dim: int, bucket: int, word_ngrams: int = 2, seed: int = 0):
    self.words, self.dim, self.bucket, self.word_ngrams = words, dim, bucket, word_ngrams
    self.index = {w: i for i, w in enumerate(words)}
    rng = np.random.default_rng(seed)
    self.input_ = rng.uniform(-1 / dim, 1 / dim, (len(words) + bucket, dim)).astype(np.float32)
    self.output = np.zeros((2, dim), np.float32)
    self.counts = np.zeros(len(words), np.int64)

  def features(self, text: str) -> np.ndarray:
    """Input rows of a prepared text: vocabulary words, then the hashed n-grams (of all words, OOV included)."""
    tokens = [t for t in _SPACES.split(text) if t] + [EOS]
    ids = [self.index[t] for t in tokens if t in self.index]
    # fastText keeps the hashes as int32 and widens them to uint64 with their sign before mixing.
    hashes = [(h - (1 << 32) if h >= 1 << 31 else h) & 0xFFFFFFFFFFFFFFFF for h in map(fasttext_hash, tokens)]
    nwords = len(self.words)
    for i in range(len(hashes)):
      h = hashes[i]
      for j in range(i + 1, min(len(hashes), i + self.word_ngrams)):
        h = (h * 116049371 + hashes[j]) & 0xFFFFFFFFFFFFFFFF
        ids.append(nwords + h % self.bucket)
    return np.asarray(ids, np.int64)

  def probabilities(self, text: str) -> np.ndarray:
    """[2] softmax probabilities (hq, lq) of a prepared text."""
    ids = self.features(text)
    logits = self.output @ self.input_[ids].mean(axis=0)
    e = np.exp(logits - logits.max())
    return e / e.sum()

  def save(self, path: str, epochs: int, lr: float, ntokens: int) -> None:
    """fastText's .bin: signature, args, dictionary (words then labels), input and output matrices (float32)."""
    with open(path, "wb") as f:
      f.write(struct.pack("<ii", MAGIC, VERSION))
      # dim ws epoch minCount neg wordNgrams loss(softmax=3) model(sup=3) bucket minn maxn lrUpdateRate t
      f.write(struct.pack("<12id", self.dim, 5, epochs, 1, 5, self.word_ngrams, 3, 3, self.bucket, 0, 0, 100, 1e-4))
      f.write(struct.pack("<iiiqq", len(self.words) + 2, len(self.words), 2, ntokens, -1))
      for word, count in zip(self.words, self.counts):
        f.write(word.encode("utf-8") + b"\x00" + struct.pack("<qb", int(count), 0))
      for label in (POSITIVE, NEGATIVE):
        f.write(label.encode() + b"\x00" + struct.pack("<qb", 1, 1))
      for matrix in (self.input_, self.output):
        f.write(struct.pack("<?qq", False, *matrix.shape))
        f.write(np.ascontiguousarray(matrix, "<f4").tobytes())


def train(positive: Sequence[str], negative: Sequence[str], *, dim: int = 32, bucket: int = 200_000,
          epochs: int = 5, lr: float = 0.1, word_ngrams: int = 2, min_count: int = 1, seed: int = 0) -> Model:
  """A Model trained on prepared texts (label hq for `positive`, lq for `negative`), examples in a seeded order."""
  texts = [(prepare(t), 0) for t in positive] + [(prepare(t), 1) for t in negative]
  counts: dict[str, int] = {EOS: 0}
  for text, _ in texts:
    counts[EOS] += 1
    for t in _SPACES.split(text):
      if t:
        counts[t] = counts.get(t, 0) + 1
  words = [EOS] + sorted((w for w, c in counts.items() if c >= min_count and w != EOS), key=lambda w: -counts[w])
  model = Model(words, dim, bucket, word_ngrams, seed)
  model.counts[:] = [counts[w] for w in words]
  feats = [(model.features(t), y) for t, y in texts]
  order = np.random.default_rng(seed).permutation(np.tile(np.arange(len(feats)), epochs))
  onehot = np.eye(2, dtype=np.float32)
  for step, k in enumerate(order):
    ids, y = feats[k]
    alpha = lr * (1.0 - step / len(order))
    hidden = model.input_[ids].mean(axis=0)
    logits = model.output @ hidden
    p = np.exp(logits - logits.max())
    p /= p.sum()
    coef = alpha * (onehot[y] - p)  # fastText's alpha * (label - score) per output row
    grad = coef @ model.output
    model.output += np.outer(coef, hidden).astype(np.float32)
    np.add.at(model.input_, ids, (grad / len(ids)).astype(np.float32))
  return model


class Scorer:
  """P(hq) of texts under a fastText .bin model, by fasttext-predict (as langid loads lid.176)."""

  def __init__(self, path: str):
    import fasttext  # pylint: disable=g-import-not-at-top  # fasttext-predict
    if not os.path.isfile(path):
      raise FileNotFoundError(f"quality model {path!r} does not exist; train one with python -m "
                              "data.curate.classifier --positive GLOB --negative GLOB --output quality.bin")
    self.model = fasttext.load_model(path)
    labels = self.model.predict("", k=-1)[0]  # fasttext-predict has no get_labels
    if POSITIVE not in labels:
      raise ValueError(f"{path}: a quality model needs the label {POSITIVE} (it has {labels}); train one with "
                       "python -m data.curate.classifier")

  def scores(self, texts: Iterable[str]) -> np.ndarray:
    out = []
    for text in texts:
      labels, probs = self.model.predict(prepare(text), k=-1)
      out.append(dict(zip(labels, probs)).get(POSITIVE, 0.0))
    return np.asarray(out, np.float64)


def _read(pattern: str, field: str) -> list[str]:
  from data import files  # pylint: disable=g-import-not-at-top
  return [d["text"] for path in files.expand(pattern, "--positive/--negative")
          for d in files.read_documents(path, text_field=field)]


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m data.curate.classifier", description=__doc__.split("\n\n")[0])
  p.add_argument("--positive", required=True, help="documents of the quality to keep (globs; jsonl, text, wet, ...)")
  p.add_argument("--negative", required=True, help="documents to tell apart from them (e.g. random crawl)")
  p.add_argument("--output", required=True, help="the model file (fastText .bin) for quality_model.model")
  p.add_argument("--text_field", default="text")
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--bucket", type=int, default=200_000)
  p.add_argument("--epochs", type=int, default=5)
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--word_ngrams", type=int, default=2)
  p.add_argument("--heldout", type=float, default=0.1, help="fraction of each side held out for the accuracy")
  args = p.parse_args(argv)
  try:
    pos, neg = _read(args.positive, args.text_field), _read(args.negative, args.text_field)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if len(pos) < 2 or len(neg) < 2:
    print(f"error: need at least 2 documents on each side (positive {len(pos)}, negative {len(neg)})", file=sys.stderr)
    return 2
  rng = np.random.default_rng(0)
  split = [rng.permutation(len(side)) for side in (pos, neg)]
  cut = [max(1, int(len(s) * args.heldout)) for s in split]
  held = [[side[i] for i in s[:c]] for side, s, c in zip((pos, neg), split, cut)]
  fit = [[side[i] for i in s[c:]] for side, s, c in zip((pos, neg), split, cut)]
  model = train(*fit, dim=args.dim, bucket=args.bucket, epochs=args.epochs, lr=args.lr, word_ngrams=args.word_ngrams)
  model.save(args.output, args.epochs, args.lr, sum(len(_SPACES.split(prepare(t))) + 1 for t in fit[0] + fit[1]))
  scorer = Scorer(args.output)
  acc = [float(np.mean((scorer.scores(h) >= 0.5) == (k == 0))) for k, h in enumerate(held)]
  print(f"trained on {len(fit[0]):,} positive and {len(fit[1]):,} negative documents; held-out accuracy "
        f"{acc[0]:.3f} (positive, {len(held[0])}) / {acc[1]:.3f} (negative, {len(held[1])}) -> {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
