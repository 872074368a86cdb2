"""Shared by the FIM and denoising tests: a JSONL corpus of random word documents (code-like symbols, accents,
CJK, tabs and newlines) and a small BPE tokenizer trained on it."""
import json

import numpy as np

from data import tokenizer as tokenizer_lib

WORDS = ("def return class import lambda yield self value index river stone cloud élan naïve 数据 "
         "(x) [i] {k: v} == != += -> \t \n    ").split(" ")


def make(root, n_docs: int = 400, max_words: int = 40, vocab_size: int = 384):
  """(root, documents, tokenizer): `n_docs` documents "docNNNNN w1 w2 ..." of 3..max_words-1 words in
  root/docs.jsonl, and a `vocab_size`-piece tokenizer trained on them (root/tok.model)."""
  rng = np.random.default_rng(0)
  docs = [f"doc{i:05d} " + " ".join(rng.choice(WORDS, int(rng.integers(3, max_words)))) for i in range(n_docs)]
  with open(root / "docs.jsonl", "w") as out:
    for t in docs:
      out.write(json.dumps({"text": t}) + "\n")
  return root, docs, tokenizer_lib.load(tokenizer_lib.train(docs, str(root / "tok.model"), vocab_size))
