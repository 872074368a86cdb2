"""Per-document scores and their aggregates with standard errors, defined as lm-evaluation-harness defines them.

Log-likelihoods `ll` are natural-log sums over a continuation's tokens (nats). Standard errors: the closed form
sqrt(var / n) (sample variance, ddof=1, lm-eval's `mean_stderr`) for means; a seeded bootstrap (resampling
documents) for ratio metrics such as perplexities, where lm-eval reports none or bootstraps too.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import numpy as np

BOOTSTRAP_ITERS = 1000


def multiple_choice(lls: Sequence[float], choices: Sequence[str], gold: int | Sequence[int]) -> dict[str, float]:
  """acc, acc_norm, acc_bytes of one multiple-choice document (lm-eval ConfigurableTask.process_results).

  acc = [argmax_i ll_i is gold]; acc_norm = [argmax_i ll_i / len(choice_i in characters) is gold];
  acc_bytes = [argmax_i ll_i / len(choice_i in UTF-8 bytes) is gold]. The lengths are the choices' own, without
  the target delimiter. `gold` may list several correct indices. Ties go to the first index (numpy argmax).
  """
  lls = np.asarray(lls, np.float64)
  chars = np.array([float(len(c)) for c in choices])
  nbytes = np.array([float(len(c.encode("utf-8"))) for c in choices])
  golds = set(gold) if isinstance(gold, (list, tuple, set)) else {gold}
  return {"acc": float(int(np.argmax(lls)) in golds), "acc_norm": float(int(np.argmax(lls / chars)) in golds),
          "acc_bytes": float(int(np.argmax(lls / nbytes)) in golds)}


def count_words(text: str) -> int:
  """Words as lm-eval counts them for word perplexity: len(re.split(r"\\s+", text))."""
  return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
  return len(text.encode("utf-8"))


def mean(xs: Sequence[float]) -> float:
  return float(np.mean(np.asarray(xs, np.float64)))


def mean_stderr(xs: Sequence[float]) -> float:
  """Standard error of the mean: sqrt(sum (x - mean)^2 / (n - 1) / n) (lm-eval's mean_stderr); nan if n < 2."""
  xs = np.asarray(xs, np.float64)
  if xs.size < 2:
    return float("nan")
  return float(np.std(xs, ddof=1) / math.sqrt(xs.size))


def weighted_perplexity(lls: Sequence[float], weights: Sequence[float]) -> float:
  """exp(-sum ll / sum weights): word perplexity (weights = words) or byte perplexity (weights = bytes)."""
  return math.exp(-float(np.sum(lls)) / float(np.sum(weights)))


def bits_per_byte(lls: Sequence[float], nbytes: Sequence[float]) -> float:
  """-sum ll / sum bytes / ln 2: bits to encode each byte of the text under the model."""
  return -float(np.sum(lls)) / float(np.sum(nbytes)) / math.log(2)


def perplexity(lls: Sequence[float]) -> float:
  """exp(-mean ll) over documents (lm-eval's `perplexity` aggregation, e.g. LAMBADA's target-word perplexity)."""
  return math.exp(-mean(lls))


def exact_match(prediction: str, answer: str) -> float:
  """1.0 when the prediction equals the answer after stripping surrounding whitespace, else 0.0."""
  return float(prediction.strip() == answer.strip())


def bootstrap_stderr(fn: Callable[..., float], columns: Sequence[Sequence[float]], iters: int = BOOTSTRAP_ITERS,
                     seed: int = 0) -> float:
  """Standard deviation of `fn(*columns)` over `iters` resamples of the documents (rows) with replacement."""
  cols = [np.asarray(c, np.float64) for c in columns]
  n = len(cols[0])
  if n < 2:
    return float("nan")
  rng = np.random.default_rng(seed)
  values = []
  for _ in range(iters):
    idx = rng.integers(0, n, n)
    values.append(fn(*[c[idx] for c in cols]))
  return float(np.std(values, ddof=1))


def rolling_metrics(lls: Sequence[float], texts: Sequence[str], stderr: bool = True) -> dict[str, float]:
  """word_perplexity, byte_perplexity, bits_per_byte (+ bootstrap stderrs) of a perplexity task."""
  words = [count_words(t) for t in texts]
  nbytes = [count_bytes(t) for t in texts]
  out = {"word_perplexity": weighted_perplexity(lls, words), "byte_perplexity": weighted_perplexity(lls, nbytes),
         "bits_per_byte": bits_per_byte(lls, nbytes)}
  if stderr:
    out["word_perplexity_stderr"] = bootstrap_stderr(weighted_perplexity, [lls, words])
    out["byte_perplexity_stderr"] = bootstrap_stderr(weighted_perplexity, [lls, nbytes])
    out["bits_per_byte_stderr"] = bootstrap_stderr(bits_per_byte, [lls, nbytes])
  return out


def mean_with_stderr(name: str, xs: Sequence[float]) -> dict[str, float]:
  """{name: mean, name_stderr: closed-form stderr}."""
  return {name: mean(xs), f"{name}_stderr": mean_stderr(xs)}
