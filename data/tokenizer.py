"""SentencePiece tokenizers: train (BPE or unigram), load, batched encode/decode, and `prepare` for a run.

Every meshlm tokenizer has pad=0, unk=1, bos=2, eos=3, then reserved control pieces for chat and
fill-in-the-middle (`RESERVED`), byte fallback (any UTF-8 text round-trips, emoji and control characters
included) and identity normalisation without whitespace folding (code keeps its indentation).

Command line: `python -m data.tokenizer --output=tok.model [--sources=builtin] [--vocab_size=2048]
[--model_type=bpe] [--text_field=text]`, or `--model=tok.model --encode="some text"` to inspect one.
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tempfile
import time
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from data import files
from data import plan as plan_lib
from data import sources as sources_lib
# The loaded model and the special ids live below data.hf_tokenizer_load (which wraps a Tokenizer); names kept here.
from data.spm_tokenizer import (BOS_ID, EOS_ID, MASK_ID, MASK_PIECE, PAD_ID, RESERVED,  # noqa: F401
                                UNK_ID, Tokenizer, split_specials)

log = logging.getLogger(__name__)

# SentencePiece reads "sentences": lines longer than this (bytes) are cut into pieces for training.
_MAX_SENTENCE_BYTES = 4096


def train(texts: Iterable[str], path: str, vocab_size: int, model_type: str = "bpe", *,
          character_coverage: float = 0.9995, byte_fallback: bool = True, max_sentences: int = 30_000,
          num_threads: int | None = None) -> str:
  """Trains a SentencePiece model on `texts` (documents; split into lines here) and writes it to `path`.

  Reads at most `max_sentences` non-blank lines, which bounds the training time (a 2048-piece BPE model on the
  default cap takes a few seconds). The file is written atomically (temp file + rename). Returns `path`.
  """
  if model_type not in ("bpe", "unigram"):
    raise ValueError(f"tokenizer model_type must be 'bpe' or 'unigram', got {model_type!r} "
                     "(config.data.tokenizer_type)")
  min_vocab = 4 + len(RESERVED) + (256 if byte_fallback else 0) + 8
  if vocab_size < min_vocab:
    raise ValueError(f"tokenizer vocab_size {vocab_size} is too small: special, reserved and byte pieces alone "
                     f"take {min_vocab - 8}; use at least {min_vocab}")
  sentences = list(_sentences(texts, max_sentences))
  if not sentences:
    raise ValueError("no text to train the tokenizer on: the configured sources yielded no non-empty lines")
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type=model_type,
      character_coverage=character_coverage, byte_fallback=byte_fallback,
      pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, control_symbols=list(RESERVED),
      normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
      allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=_MAX_SENTENCE_BYTES * 4,
      input_sentence_size=0, shuffle_input_sentence=False, hard_vocab_limit=True,
      num_threads=num_threads or min(8, os.cpu_count() or 1), minloglevel=2)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix=".model.tmp")
  with os.fdopen(fd, "wb") as f:
    f.write(model.getvalue())
  os.replace(tmp, path)
  return path


def _sentences(texts: Iterable[str], max_sentences: int):
  """Non-blank lines of the documents, cut to _MAX_SENTENCE_BYTES, at most `max_sentences` of them."""
  n = 0
  for text in texts:
    for line in text.split("\n"):
      if not line.strip():
        continue
      while line:
        head = line.encode("utf-8")[:_MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore") or line[:1]
        yield head
        line = line[len(head):]
        n += 1
        if n >= max_sentences:
          return


def load(path: str):
  """A meshlm SentencePiece `.model` file (`Tokenizer`) or a Hugging Face tokenizer directory
  (`data.hf_tokenizer_load.HFTokenizer`: tokenizer.json or tokenizer.model, with its chat template)."""
  if os.path.isdir(path):
    from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
    return hf_tokenizer_load.load(path)
  return Tokenizer.load(path)


def prompt_ids(tokenizer, ids: list[int]) -> list[int]:
  """A text's ids as the model sees a prompt: BOS first where the family's tokenizer adds it (meshlm's and Llama's
  do; Qwen's has no BOS: `add_bos_token` False), as transformers' tokenizer(text) gives them."""
  return ([tokenizer.bos_id] if getattr(tokenizer, "add_bos_token", True) else []) + list(ids)


def expected_vocab_size(config) -> int:
  """The tokenizer vocabulary size a run needs: config.data.tokenizer_vocab_size, or model.vocab_size if 0."""
  return config.data.tokenizer_vocab_size or config.model.vocab_size


def check_vocab(tokenizer: Tokenizer, config) -> None:
  """Refuses a tokenizer whose vocabulary does not match the model, naming the key to change."""
  want = expected_vocab_size(config)
  model_vocab = config.model.vocab_size
  if not isinstance(tokenizer, Tokenizer):  # a Hugging Face tokenizer: its model's embedding may be padded
    if tokenizer.vocab_size > model_vocab:
      raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but config.model.vocab_size is "
                       f"{model_vocab}; the embedding table must hold every token id")
    return
  if want > model_vocab:
    raise ValueError(f"config.data.tokenizer_vocab_size={want} exceeds config.model.vocab_size={model_vocab}; the "
                     "embedding table must hold every token id")
  if tokenizer.vocab_size != want:
    where = ("config.data.tokenizer_vocab_size" if config.data.tokenizer_vocab_size else "config.model.vocab_size")
    raise ValueError(
        f"tokenizer {tokenizer.path or '(in memory)'} has {tokenizer.vocab_size} pieces but {where} is {want}: set "
        f"--config.model.vocab_size={tokenizer.vocab_size} (or --config.data.tokenizer_vocab_size="
        f"{tokenizer.vocab_size} to keep a padded embedding of {model_vocab}), or point --config.data.tokenizer "
        f"at a {want}-piece model")


def prepare(config, workdir: str, plan: plan_lib.DataPlan | None = None) -> str:
  """Returns the path of the run's tokenizer, after checking its vocabulary against the model.

  `config.data.tokenizer` if set (a .model file or a Hugging Face tokenizer directory); otherwise WORKDIR/tokenizer.model, trained on the configured training sources
  only if absent (so a resumed run reuses it). `plan`: the run's parsed config.data (data/plan.py; resolved
  from config.data when None and a tokenizer is to be trained).
  """
  path = config.data.tokenizer or os.path.join(workdir, "tokenizer.model")
  if not config.data.tokenizer and not os.path.exists(path):
    t0 = time.time()
    plan = plan or plan_lib.resolve(config.data)
    if _copy_cache_tokenizer(plan, path):
      check_vocab(load(path), config)
      return path
    texts = _training_texts(plan.open(), plan.specs, plan.eval_fraction)
    train(texts, path, expected_vocab_size(config), config.data.tokenizer_type,
          character_coverage=config.data.tokenizer_character_coverage,
          byte_fallback=config.data.tokenizer_byte_fallback, max_sentences=config.data.tokenizer_max_sentences)
    log.info("trained a %d-piece %s tokenizer in %.1fs -> %s", expected_vocab_size(config),
             config.data.tokenizer_type, time.time() - t0, path)
  check_vocab(load(path), config)
  return path


def _copy_cache_tokenizer(plan: plan_lib.DataPlan, path: str) -> bool:
  """With a tokenized cache among the sources, the run's tokenizer is the cache's (copied to `path`): a tokenizer
  trained anew would not match its ids. False when there is no cache."""
  caches = [s for s in plan.specs if s.kind == "tokens"]
  if not caches:
    return False
  copy = os.path.join(os.path.dirname(os.path.abspath(caches[0].arg)), "tokenizer.model")
  if not os.path.exists(copy):
    raise ValueError(f"source {caches[0].name!r} is a tokenized cache without its tokenizer.model (made with a "
                     "Hugging Face tokenizer?); set config.data.tokenizer to the tokenizer that made it")
  files.atomic_write(path, files.read_bytes(copy))
  log.info("using the tokenized cache's tokenizer %s -> %s", copy, path)
  return True


def _training_texts(srcs, specs, eval_fraction: float):
  """Training-split documents, the sources interleaved in proportion to their weights (a seeded order), so the
  sentence cap samples every source."""
  rng = np.random.default_rng(0)
  orders = [rng.permutation(sources_lib.split_indices(len(s), eval_fraction, "train")) for s in srcs]
  pos = [0] * len(srcs)
  weights = np.array([s.weight for s in specs])
  while True:
    live = [i for i in range(len(srcs)) if pos[i] < len(orders[i])]
    if not live:
      return
    w = weights[live] / weights[live].sum()
    i = live[int(rng.choice(len(live), p=w))]
    text = srcs[i][int(orders[i][pos[i]])]
    pos[i] += 1
    if text.strip():
      yield text


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m data.tokenizer", description=__doc__.split("\n\n")[0])
  parser.add_argument("--output", help="where to write the trained .model")
  parser.add_argument("--sources", default="builtin", help="mixture spec (see data/sources.py)")
  parser.add_argument("--text_field", default="text")
  parser.add_argument("--vocab_size", type=int, default=2048)
  parser.add_argument("--model_type", default="bpe", choices=("bpe", "unigram"))
  parser.add_argument("--character_coverage", type=float, default=0.9995)
  parser.add_argument("--max_sentences", type=int, default=30_000)
  parser.add_argument("--no_byte_fallback", action="store_true")
  parser.add_argument("--model", help="an existing .model to inspect with --encode")
  parser.add_argument("--encode", help="text to encode and decode with --model (or the trained --output)")
  args = parser.parse_args(argv)
  if not args.output and not args.model:
    parser.error("give --output to train a tokenizer or --model with --encode to inspect one")
  if args.output:
    plan = plan_lib.resolve_spec(args.sources, text_field=args.text_field)  # parsed once, like a run's
    t0 = time.time()
    train(_training_texts(plan.open(), plan.specs, 0.0), args.output, args.vocab_size, args.model_type,
          character_coverage=args.character_coverage, byte_fallback=not args.no_byte_fallback,
          max_sentences=args.max_sentences)
    print(f"wrote {args.output} ({args.vocab_size} pieces, {args.model_type}) in {time.time() - t0:.1f}s")
  if args.encode is not None:
    tok = Tokenizer.load(args.model or args.output)
    ids = tok.encode(args.encode)
    print({"ids": ids, "pieces": [tok.id_to_piece(i) for i in ids], "decoded": tok.decode(ids)})
  return 0


if __name__ == "__main__":
  sys.exit(main())
