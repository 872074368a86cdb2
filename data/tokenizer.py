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
import re
import sys
import tempfile
import time
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from data import sources as sources_lib

log = logging.getLogger(__name__)

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Control pieces reserved for later chat and fill-in-the-middle formats: never produced by encoding text, only
# inserted by id (`Tokenizer.special_id(name)`).
RESERVED = ("<|system|>", "<|user|>", "<|assistant|>", "<|end_of_turn|>", "<|fim_prefix|>", "<|fim_middle|>",
            "<|fim_suffix|>", "<|fim_pad|>") + tuple(f"<|reserved_{i}|>" for i in range(8))
# The masked-LM mask token (train/objectives/mlm.py, evals/pll.py); control ids follow PAD, UNK, BOS, EOS in
# RESERVED order. <|reserved_1..7|> are UL2's mode tokens and span sentinels (data/denoise.py).
MASK_PIECE = "<|reserved_0|>"
MASK_ID = EOS_ID + 1 + RESERVED.index(MASK_PIECE)
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


class Tokenizer:
  """A loaded SentencePiece model. Picklable (carries the serialized model), so grain workers can use it."""

  def __init__(self, model_proto: bytes, path: str = ""):
    self.path = path
    self._proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)

  @classmethod
  def load(cls, path: str) -> "Tokenizer":
    """Loads a .model file (local or an etils.epath URL)."""
    if "://" in path:
      from etils import epath
      data = epath.Path(path).read_bytes()
    else:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist (config.data.tokenizer)")
      with open(path, "rb") as f:
        data = f.read()
    return cls(data, path)

  def __getstate__(self):
    return {"path": self.path, "proto": self._proto}

  def __setstate__(self, state):
    self.__init__(state["proto"], state["path"])

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def bos_id(self) -> int:
    return self._sp.bos_id()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def pad_id(self) -> int:
    """The padding id; 0 when the model defines none (segment_ids, not the id, mark padding)."""
    pad = self._sp.pad_id()
    return pad if pad >= 0 else 0

  def special_id(self, piece: str) -> int:
    """Id of a reserved control piece such as '<|user|>'; KeyError if the model lacks it."""
    i = self._sp.piece_to_id(piece)
    if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i):
      raise KeyError(f"tokenizer has no piece {piece!r}")
    return i

  def encode(self, text: str) -> list[int]:
    """Token ids of one text (no BOS/EOS)."""
    return self._sp.encode(text)

  def encode_with_specials(self, text: str) -> list[int]:
    """Token ids of `text` in which BOS/EOS/PAD and the reserved control pieces written out as text become their
    single ids (rendered Jinja chat templates); `encode` never does this, so user text cannot produce them."""
    specials = [self.id_to_piece(i) for i in (self.bos_id, self.eos_id, self.pad_id)] + list(RESERVED)
    ids = []
    for part in split_specials(text, specials):
      ids += [self._sp.piece_to_id(part)] if part in specials else self.encode(part)
    return ids

  def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
    """Token ids of each text (no BOS/EOS)."""
    return self._sp.encode(list(texts), num_threads=num_threads)

  def decode(self, ids) -> str:
    """Text of a sequence of ids (control ids such as BOS/EOS/PAD decode to nothing)."""
    return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

  def decode_batch(self, ids_batch) -> list[str]:
    return [self.decode(ids) for ids in ids_batch]

  def id_to_piece(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))


def split_specials(text: str, specials: Sequence[str]) -> list[str]:
  """`text` cut before and after every occurrence of a special piece (longest match first); empty parts dropped."""
  if not specials:
    return [text] if text else []
  pattern = "(" + "|".join(re.escape(s) for s in sorted(set(specials), key=len, reverse=True)) + ")"
  return [p for p in re.split(pattern, text) if p]


def load(path: str):
  """A meshlm SentencePiece `.model` file (`Tokenizer`) or a Hugging Face tokenizer directory
  (`data.hf_tokenizer_load.HFTokenizer`: tokenizer.json or tokenizer.model, with its chat template)."""
  if os.path.isdir(path):
    from data import hf_tokenizer_load  # pylint: disable=g-import-not-at-top
    return hf_tokenizer_load.load(path)
  return Tokenizer.load(path)


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


def prepare(config, workdir: str) -> str:
  """Returns the path of the run's tokenizer, after checking its vocabulary against the model.

  `config.data.tokenizer` if set (a .model file or a Hugging Face tokenizer directory); otherwise WORKDIR/tokenizer.model, trained on the configured training sources
  only if absent (so a resumed run reuses it).
  """
  path = config.data.tokenizer or os.path.join(workdir, "tokenizer.model")
  if not config.data.tokenizer and not os.path.exists(path):
    t0 = time.time()
    specs, srcs = sources_lib.open_sources(config.data)
    texts = _training_texts(srcs, specs, config.data.eval_fraction)
    train(texts, path, expected_vocab_size(config), config.data.tokenizer_type,
          character_coverage=config.data.tokenizer_character_coverage,
          byte_fallback=config.data.tokenizer_byte_fallback, max_sentences=config.data.tokenizer_max_sentences)
    log.info("trained a %d-piece %s tokenizer in %.1fs -> %s", expected_vocab_size(config),
             config.data.tokenizer_type, time.time() - t0, path)
  check_vocab(load(path), config)
  return path


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
    specs = sources_lib.parse_spec(args.sources)
    srcs = [sources_lib.open_source(s, args.text_field) for s in specs]
    t0 = time.time()
    train(_training_texts(srcs, specs, 0.0), args.output, args.vocab_size, args.model_type,
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
