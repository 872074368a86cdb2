"""Loading Hugging Face tokenizer directories (`python -m train.export` writes them for meshlm runs): `tokenizer.json` through the `tokenizers` library (Llama 3 ships only this)
or `tokenizer.model` through sentencepiece (Llama 2, Mistral), with `tokenizer_config.json` for the special tokens
and the Jinja `chat_template`.

`load(directory)` returns an object with the interface of `data.tokenizer.Tokenizer` (encode, decode, bos_id,
eos_id, pad_id, special_id, vocab_size, id_to_piece, encode_with_specials) plus `chat_template` (str or None) and
`stop_ids` (EOS and the end-of-turn tokens the config names). It pickles with its files' bytes, so grain worker
processes can use it.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from data import spm_tokenizer as tokenizer_lib

FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def is_hf_dir(path: str) -> bool:
  """Whether `path` is a directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer.model)."""
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in FILES[:2])


def _token_text(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer:
  """A loaded Hugging Face tokenizer directory (module docstring)."""

  def __init__(self, files: dict[str, bytes], path: str = ""):
    self.path, self._files = path, dict(files)
    config = json.loads(files.get("tokenizer_config.json", b"{}") or b"{}")
    specials_map = json.loads(files.get("special_tokens_map.json", b"{}") or b"{}")
    self.chat_template = config.get("chat_template")
    if isinstance(self.chat_template, list):  # several named templates: the default one
      named = {t.get("name"): t.get("template") for t in self.chat_template}
      self.chat_template = named.get("default") or next(iter(named.values()), None)
    if "tokenizer.json" in files:
      import tokenizers  # pylint: disable=g-import-not-at-top
      self._tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
      self._tok.encode_special_tokens = True  # special-token strings in plain text stay text (see encode)
      self._sp = None
      added = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
    else:
      self._tok = None
      self._sp = tokenizer_lib.Tokenizer(files["tokenizer.model"], path)
      added = []
    self._specials = sorted({*added, *(t for t in (_token_text(config.get(k)) or _token_text(specials_map.get(k))
                                                   for k in ("bos_token", "eos_token", "pad_token", "unk_token"))
                                       if t)})
    def token_id(key, default):
      text = _token_text(config.get(key)) or _token_text(specials_map.get(key))
      i = self._piece_id(text) if text else None
      return default if i is None else i
    sp_bos = self._sp.bos_id if self._sp else -1
    sp_eos = self._sp.eos_id if self._sp else -1
    self._bos, self._eos = token_id("bos_token", sp_bos), token_id("eos_token", sp_eos)
    self._pad = token_id("pad_token", -1)
    stops = {self._eos} | {self._piece_id(t) for t in ("<|eot_id|>", "<|im_end|>", "<|end_of_turn|>", "<end_of_turn>")}
    self.stop_ids = tuple(sorted(i for i in stops if i is not None and i >= 0))

  @classmethod
  def load(cls, directory: str) -> "HFTokenizer":
    if not is_hf_dir(directory):
      raise FileNotFoundError(f"{directory!r} holds no tokenizer.json or tokenizer.model (a Hugging Face tokenizer "
                              "directory is expected)")
    files = {}
    for name in FILES:
      path = os.path.join(directory, name)
      if os.path.isfile(path):
        with open(path, "rb") as f:
          files[name] = f.read()
    return cls(files, directory)

  def __getstate__(self):
    return {"path": self.path, "files": self._files}

  def __setstate__(self, state):
    self.__init__(state["files"], state["path"])

  def files(self) -> dict[str, bytes]:
    """The directory's tokenizer files (name -> bytes), e.g. to copy them into a run directory."""
    return dict(self._files)

  def _piece_id(self, piece: str | None) -> int | None:
    if piece is None:
      return None
    if self._tok is not None:
      return self._tok.token_to_id(piece)
    try:
      return self._sp.special_id(piece)
    except KeyError:
      return None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True) if self._tok is not None else self._sp.vocab_size

  @property
  def bos_id(self) -> int:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def pad_id(self) -> int:
    """The padding id; 0 when the tokenizer defines none (segment_ids, not the id, mark padding)."""
    return self._pad if self._pad >= 0 else 0

  def special_id(self, piece: str) -> int:
    """Id of a special / added token such as '<|eot_id|>'; KeyError if the tokenizer lacks it."""
    i = self._piece_id(piece)
    if i is None:
      raise KeyError(f"tokenizer has no piece {piece!r}")
    return i

  def encode(self, text: str) -> list[int]:
    """Token ids of plain text: no BOS/EOS, and special-token strings inside it stay ordinary text."""
    if self._tok is None:
      return self._sp.encode(text)
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_with_specials(self, text: str) -> list[int]:
    """Token ids of rendered template text: the special tokens written in it become their ids."""
    ids = []
    for part in tokenizer_lib.split_specials(text, self._specials):
      ids += [self.special_id(part)] if part in self._specials else self.encode(part)
    return ids

  def encode_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
    del num_threads
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    return self._tok.decode(ids, skip_special_tokens=True) if self._tok is not None else self._sp.decode(ids)

  def decode_batch(self, ids_batch) -> list[str]:
    return [self.decode(ids) for ids in ids_batch]

  def id_to_piece(self, i: int) -> str:
    return self._tok.id_to_token(int(i)) if self._tok is not None else self._sp.id_to_piece(i)


def load(directory: str) -> HFTokenizer:
  """The tokenizer of a Hugging Face model directory (module docstring)."""
  return HFTokenizer.load(directory)
