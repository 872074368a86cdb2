"""Long-context evaluation data, generated offline: the passkey (needle-in-a-haystack) retrieval task and long
held-out documents for perplexity by position.

  python -m evals.long_context passkey --tokenizer runs/tiny/tokenizer.model --out passkey.jsonl \
      [--lengths 128,256,512,1024,2048] [--depths 0,0.25,0.5,0.75,1] [--per_cell 5] [--seed 0]
  python -m evals.long_context positions --out long_docs.jsonl [--min_chars 12000] [--count 64]

Passkey (Mohtashami & Jaggi 2023; RULER's niah single-needle task scores it the same way): a five-digit key in
a sentence ("The pass key is 58172. Remember it. 58172 is the pass key.") placed at a relative depth of a filler
of repeated sentences, followed by the question; the context is sized with the model's tokenizer so that prompt
and answer take `length` tokens. Each record is a `gen` record ({"context", "answer", "until", "max_tokens"})
plus its "length" and "depth"; `train.evaluate --tasks passkey:FILE` scores exact match of the greedy answer,
overall and per length and per (length, depth).

Positions: documents of the built-in corpus's held-out split (data.sources' eval split with data.eval_fraction's
default, the documents training never saw) at least `min_chars` long, as `{"text"}` records;
`--tasks position_ppl:FILE` reports the mean negative log-likelihood and perplexity of the tokens at positions
[0, 128), [128, 256), [256, 512), ... of each document's first max_len tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Callable, Sequence

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"


def passkey_record(encode: Callable[[str], list[int]], length: int, depth: float, key: str) -> dict:
  """One passkey prompt whose BOS, context and generated tokens (max_tokens) take at most `length` tokens under
  `encode` (so a model scoring `length` tokens never trims the prompt), as many as the filler allows, with the needle after `depth` (0 = first, 1 = last) of the filler sentences."""
  needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
  sentences = [s + ". " for s in FILLER.split(". ") if s.strip()]

  def build(count: int) -> str:
    filler = [sentences[i % len(sentences)] for i in range(count)]
    at = round(depth * count)
    return "".join(filler[:at]) + needle + "".join(filler[at:]) + QUESTION

  generated = len(encode(" " + key)) + 2  # max_tokens: the key and room for its full stop
  per_sentence = len(encode(FILLER)) / len(sentences)
  count = max(0, int((length - 1 - generated - len(encode(needle + QUESTION))) / per_sentence) + 1)
  while count > 0 and 1 + len(encode(build(count))) + generated > length:
    count -= 1
  return {"context": build(count), "answer": key, "until": ["."], "max_tokens": generated, "length": int(length),
          "depth": float(depth)}


def passkey_records(encode: Callable[[str], list[int]], lengths: Sequence[int], depths: Sequence[float],
                    per_cell: int, seed: int = 0) -> list[dict]:
  """per_cell records for each (length, depth), keys drawn from `seed`."""
  rng = random.Random(seed)
  return [passkey_record(encode, n, d, str(rng.randrange(10000, 100000)))
          for n in lengths for d in depths for _ in range(per_cell)]


def heldout_documents(min_chars: int, count: int) -> list[str]:
  """Up to `count` documents of at least `min_chars` characters from the built-in corpus's eval split."""
  from configs import base  # pylint: disable=g-import-not-at-top
  from data import sources  # pylint: disable=g-import-not-at-top
  fraction = base.get_config().data.eval_fraction
  out = []
  for spec in sources.parse_spec("builtin"):
    src = sources.open_source(spec)
    for i in sources.source_split(src, fraction, "eval"):
      text = src[int(i)]
      if len(text) >= min_chars:
        out.append(text)
  return out[:count]


def _load_encoder(path: str) -> Callable[[str], list[int]]:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  processor = spm.SentencePieceProcessor(model_file=path)
  return lambda text: processor.encode(text)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m evals.long_context", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="kind", required=True)
  p = sub.add_parser("passkey")
  p.add_argument("--tokenizer", required=True, help="a SentencePiece .model (a run's tokenizer.model)")
  p.add_argument("--out", required=True)
  p.add_argument("--lengths", default="128,256,512,1024,2048")
  p.add_argument("--depths", default="0,0.25,0.5,0.75,1")
  p.add_argument("--per_cell", type=int, default=5)
  p.add_argument("--seed", type=int, default=0)
  q = sub.add_parser("positions")
  q.add_argument("--out", required=True)
  q.add_argument("--min_chars", type=int, default=12000)
  q.add_argument("--count", type=int, default=64)
  args = parser.parse_args(argv)
  try:
    if args.kind == "passkey":
      encode = _load_encoder(args.tokenizer)
      records = passkey_records(encode, [int(x) for x in args.lengths.split(",")],
                                [float(x) for x in args.depths.split(",")], args.per_cell, args.seed)
    else:
      records = [{"text": t} for t in heldout_documents(args.min_chars, args.count)]
  except (OSError, ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not records:
    print("error: no records (for positions, lower --min_chars)", file=sys.stderr)
    return 2
  with open(args.out, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  print(f"wrote {len(records)} records to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
