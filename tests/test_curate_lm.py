"""The n-gram language model behind curation stage 6, checked against a direct dictionary implementation."""
import math
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from data.curate import ngram_lm

V = 9  # token ids 0..8; the model adds <s> = 9 and </s> = 10


def _corpus(seed=0, n=200):
  rng = random.Random(seed)
  # A skewed, structured corpus so that higher orders matter: token t is often followed by t + 1.
  out = []
  for _ in range(n):
    t, s = rng.randrange(V), []
    for _ in range(rng.randrange(1, 9)):
      s.append(t)
      t = (t + 1) % V if rng.random() < 0.7 else rng.randrange(V)
    out.append(s)
  return out


class ReferenceKN:
  """Interpolated Kneser-Ney written directly from the definition, with tuples and dictionaries."""

  def __init__(self, sentences, order):
    self.order, bos, eos = order, V, V + 1
    padded = [[bos] + s + [eos] for s in sentences]
    counts = [Counter() for _ in range(order + 1)]
    for s in padded:
      for i in range(1, len(s)):
        for n in range(1, min(order, i + 1) + 1):
          counts[n][tuple(s[i - n + 1:i + 1])] += 1
    self.adjusted = [None] * (order + 1)
    self.adjusted[order] = counts[order]
    for n in range(order - 1, 0, -1):
      left = Counter(g[1:] for g in counts[n + 1])
      self.adjusted[n] = Counter({g: (c if g[0] == bos else left[g]) for g, c in counts[n].items()})
    self.discount = [None]
    for n in range(1, order + 1):
      values = list(self.adjusted[n].values())
      n1, n2 = values.count(1), values.count(2)
      self.discount.append(min(max(n1 / (n1 + 2 * n2) if n1 and n2 else 0.5, 0.05), 0.95))
    self.context_total = [None] + [defaultdict(float) for _ in range(order)]
    self.context_types = [None] + [defaultdict(int) for _ in range(order)]
    for n in range(1, order + 1):
      for g, a in self.adjusted[n].items():
        self.context_total[n][g[:-1]] += a
        self.context_types[n][g[:-1]] += 1

  def prob(self, history, w):
    n = len(history) + 1
    d, h = self.discount[n], tuple(history)
    if n == 1:
      total, types = self.context_total[1][()], self.context_types[1][()]
      return max(self.adjusted[1].get((w,), 0) - d, 0) / total + d * types / total / (V + 1)
    lower = self.prob(history[1:], w)
    total = self.context_total[n].get(h, 0)
    if total == 0:
      return lower
    a = self.adjusted[n].get(h + (w,), 0)
    return max(a - d, 0) / total + d * self.context_types[n][h] / total * lower

  def sentence_logprobs(self, s):
    padded, out = [V] + s + [V + 1], []
    for i in range(1, len(padded)):
      out.append(math.log10(self.prob(padded[max(0, i - self.order + 1):i], padded[i])))
    return out


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_kneser_ney_matches_reference(order):
  train = _corpus(0)
  model = ngram_lm.train_kneser_ney(train, V, order)
  reference = ReferenceKN(train, order)
  tests = _corpus(1, 80) + [[8, 8, 8, 8, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8]]  # > 256 tokens: sorted look-ups
  tokens, positions = ngram_lm.flatten(tests, model.bos, model.eos)
  got = model.token_logprobs(tokens, positions)[positions > 0]
  want = [lp for s in tests for lp in reference.sentence_logprobs(s)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("history", [[], [3], [3, 4], [8, 0, 1], [5, 5, 5]])
def test_kneser_ney_distributions_sum_to_one(history):
  model = ngram_lm.train_kneser_ney(_corpus(2), V, 4)
  total = 0.0
  for w in list(range(V)) + [model.eos]:
    tokens, positions = ngram_lm.flatten([history + [w]], model.bos, model.eos)
    total += 10 ** model.token_logprobs(tokens, positions)[len(history) + 1]
  assert total == pytest.approx(1.0, abs=1e-6)


def test_stupid_backoff_matches_definition():
  train = _corpus(3)
  order, alpha = 3, 0.4
  model = ngram_lm.train_stupid_backoff(train, V, order, alpha)
  counts = Counter()
  for s in train:
    p = [V] + s + [V + 1]
    for i in range(len(p)):
      for n in range(1, order + 1):
        if i - n + 1 >= 0:
          counts[tuple(p[i - n + 1:i + 1])] += 1
  unigram_total = sum(c for g, c in counts.items() if len(g) == 1 and g != (V,))
  def context_count(h):
    return sum(c for g, c in counts.items() if len(g) == len(h) + 1 and g[:-1] == h)

  def score(h, w):
    if not h:
      c = counts.get((w,), 0)
      return c / unigram_total if c else 0.5 / unigram_total
    c = counts.get(h + (w,), 0)
    return c / context_count(h) if c else alpha * score(h[1:], w)

  for s in [[0, 1, 2, 3], [7, 7, 7], [2, 6, 1, 8, 0]]:
    tokens, positions = ngram_lm.flatten([s], model.bos, model.eos)
    got = model.token_logprobs(tokens, positions)[1:]
    p = [V] + s + [V + 1]
    want = [math.log10(score(tuple(p[max(0, i - order + 1):i]), p[i])) for i in range(1, len(p))]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_arpa_backoff_by_hand(tmp_path):
  arpa = tmp_path / "tiny.arpa"
  arpa.write_text("""\\data\\
ngram 1=5
ngram 2=3

\\1-grams:
-1.0\t<unk>
-99\t<s>\t-0.5
-0.7\t</s>
-0.6\tab\t-0.2
-0.9\tcd\t-0.3

\\2-grams:
-0.1\t<s> ab
-0.2\tab cd
-0.4\tcd </s>

\\end\\
""")
  pieces = {"ab": 0, "cd": 1}
  model = ngram_lm.read_arpa(str(arpa), pieces.get, vocab_size=2)
  cases = {
      (0, 1): [-0.1, -0.2, -0.4],  # every bigram present
      (1, 0): [-0.5 + -0.9, -0.3 + -0.6, -0.2 + -0.7],  # backoff(<s>) + p(cd), backoff(cd) + p(ab), ...
  }
  for sentence, want in cases.items():
    tokens, positions = ngram_lm.flatten([list(sentence)], model.bos, model.eos)
    np.testing.assert_allclose(model.token_logprobs(tokens, positions)[1:], want, rtol=1e-6)


def test_save_load_roundtrip(tmp_path):
  model = ngram_lm.train_kneser_ney(_corpus(4), V, 3)
  model.save(str(tmp_path / "lm.npz"))
  loaded = ngram_lm.NgramLM.load(str(tmp_path / "lm.npz"))
  tokens, positions = ngram_lm.flatten(_corpus(5, 10), model.bos, model.eos)
  np.testing.assert_array_equal(loaded.token_logprobs(tokens, positions), model.token_logprobs(tokens, positions))


def test_reference_groups_and_buckets():
  from data.curate import perplexity
  assert perplexity.reference_groups(("wiki/*.txt", "de=wiki_de/*.txt", "fr=a.jsonl")) == {
      "*": ["wiki/*.txt"], "de": ["wiki_de/*.txt"], "fr": ["a.jsonl"]}
  values = np.arange(1.0, 11.0)  # 1..10: 30th percentile 3.7, 60th 6.4 (linear interpolation)
  cut = perplexity.cutoffs(np.concatenate([values, [np.nan]]), 30, 60)
  assert cut == pytest.approx((3.7, 6.4))
  assert [perplexity.bucket(v, cut) for v in (1.0, 3.7, 6.0, 6.4, 10.0)] == ["head", "middle", "middle", "tail", "tail"]
  assert perplexity.bucket(float("nan"), cut) == "all"
  with pytest.raises(ValueError, match="head_percentile"):
    perplexity.cutoffs(values, 70, 60)
