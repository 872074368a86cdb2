"""A loaded SentencePiece model (`Tokenizer`) and meshlm's special ids; data/tokenizer.py trains and prepares
them (and re-exports these names), data/hf_tokenizer_load.py wraps a Tokenizer for Hugging Face `tokenizer.model`
directories."""
from __future__ import annotations

import os
import re
from typing import Sequence

import numpy as np
import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Control pieces reserved for later chat and fill-in-the-middle formats: never produced by encoding text, only
# inserted by id (`Tokenizer.special_id(name)`).
RESERVED = ("<|system|>", "<|user|>", "<|assistant|>", "<|end_of_turn|>", "<|fim_prefix|>", "<|fim_middle|>",
            "<|fim_suffix|>", "<|fim_pad|>") + tuple(f"<|reserved_{i}|>" for i in range(8))
# The masked-LM mask token (train/objectives/mlm.py, evals/pll.py); control ids follow PAD, UNK, BOS, EOS in
# RESERVED order. <|reserved_1..7|> are UL2's mode tokens and span sentinels (data/denoise.py).
MASK_PIECE = "<|reserved_0|>"
MASK_ID = EOS_ID + 1 + RESERVED.index(MASK_PIECE)


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

  @property
  def model_proto(self) -> bytes:
    """The serialized SentencePiece model: the bytes of its .model file."""
    return self._proto

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
    return self.encode_with_offsets(text)[0]

  def encode_with_offsets(self, text: str, specials: Sequence[str] | None = None
                          ) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode_with_specials`' ids and each id's (start, end) character span in `text` (the bytes of one
    character share its span). `specials`: the pieces matched as single ids (default BOS/EOS/PAD and RESERVED;
    the model's user-defined pieces are matched by SentencePiece itself)."""
    if specials is None:
      specials = [self.id_to_piece(i) for i in (self.bos_id, self.eos_id, self.pad_id)] + list(RESERVED)
    ids, offsets, start = [], [], 0
    for part in split_specials(text, specials):
      if part in specials:
        ids.append(self._sp.piece_to_id(part))
        offsets.append((start, start + len(part)))
      else:
        out = self._sp.encode(part, return_type="offset_mapping")
        ids += out["ids"]
        offsets += [(start + a, start + b) for a, b in _char_spans(out["offsets"])]
      start += len(part)
    return ids, offsets

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


def _char_spans(offsets) -> list[tuple[int, int]]:
  """SentencePiece offsets with the byte pieces of one character, which it gives empty spans before the last,
  widened to that character's span."""
  spans = [tuple(o) for o in offsets]
  for k in range(len(spans) - 2, -1, -1):
    if spans[k][0] == spans[k][1] and spans[k + 1][0] == spans[k][0]:
      spans[k] = spans[k + 1]
  return spans


def split_specials(text: str, specials: Sequence[str]) -> list[str]:
  """`text` cut before and after every occurrence of a special piece (longest match first); empty parts dropped."""
  if not specials:
    return [text] if text else []
  pattern = "(" + "|".join(re.escape(s) for s in sorted(set(specials), key=len, reverse=True)) + ")"
  return [p for p in re.split(pattern, text) if p]
