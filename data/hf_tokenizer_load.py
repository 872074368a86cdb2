"""Loading Hugging Face tokenizer directories (`python -m train.export` writes them for meshlm runs; Hugging Face
model directories hold them): `tokenizer.json` through the `tokenizers` library (Llama 3, Qwen 2/2.5/3, Gemma and
OLMo 2 ship it) or, without one, `tokenizer.model` through sentencepiece (Llama 2, Mistral, Gemma), with
`tokenizer_config.json` for the special tokens and the Jinja `chat_template` (`chat_template.jinja` instead when
present: transformers 5 saves it there and prefers it), and `generation_config.json` for the ids generation stops
at.

`load(directory)` returns an object with the interface of `data.tokenizer.Tokenizer` (encode, decode, bos_id,
eos_id, pad_id, special_id, vocab_size, id_to_piece, encode_with_specials, encode_with_offsets) plus
`chat_template` (str or None), `template_tokens` (the named special tokens a chat template sees, as
transformers passes them), `add_bos_token` (whether the family's tokenizer starts a text with BOS, as
transformers' AutoTokenizer does by default) and `stop_ids`. It pickles with its files' bytes, so grain worker
processes can use it.

What matches transformers (tests/test_family_tokenizers.py): `encode` gives the ids of AutoTokenizer(text,
add_special_tokens=False); special-token strings in plain text stay text with tokenizer.json (meshlm never lets
data spell a control token; transformers' split_special_tokens=True), while SentencePiece always matches its
user-defined pieces (Gemma's turn markers). `encode_with_specials` gives the ids of rendered template text as
`apply_chat_template(tokenize=True)` does: special and added tokens matched as transformers matches them (their
lstrip/rstrip flags included), the text between them encoded by the model.

BOS: `bos_id` is where meshlm starts a document (data/pipeline.py prepends it). Families with a BOS token
(Llama, Gemma) use it; a vocabulary without one (Qwen: `bos_token` null) starts documents after the separator its
pretraining puts between them, `<|endoftext|>` (EOS when the vocabulary lacks that too, as lm-eval prefixes such
models). `add_bos_token` says whether transformers' AutoTokenizer(text) itself prepends BOS.

Stop ids: EOS, the ids of generation_config.json's `eos_token_id` (an int or a list: Llama 3.1's <|eom_id|>,
<|eot_id|>, <|end_of_text|>; Qwen's <|im_end|>, <|endoftext|>; Gemma's <eos>, <end_of_turn>), and the end-of-turn
tokens of the families the vocabulary has (END_OF_TURN_PIECES).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from data import spm_tokenizer as tokenizer_lib

FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja", "generation_config.json")
# The end-of-turn tokens chat models of each family emit: Llama 3 (<|eot_id|>), Qwen / ChatML (<|im_end|>), meshlm
# (<|end_of_turn|>), Gemma (<end_of_turn>). Stop ids wherever the vocabulary has them.
END_OF_TURN_PIECES = ("<|eot_id|>", "<|im_end|>", "<|end_of_turn|>", "<end_of_turn>")
# Named special tokens (tokenizer_config.json keys) that transformers passes to chat templates.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The document separator of GPT-2-style byte-level vocabularies without a BOS (Qwen): documents start after it.
DOCUMENT_SEPARATOR = "<|endoftext|>"


def is_hf_dir(path: str) -> bool:
  """Whether `path` is a directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer.model)."""
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in FILES[:2])


def _token_text(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def _json(files: dict[str, bytes], name: str) -> dict[str, Any]:
  return json.loads(files.get(name, b"{}") or b"{}")


class HFTokenizer:
  """A loaded Hugging Face tokenizer directory (module docstring)."""

  def __init__(self, files: dict[str, bytes], path: str = ""):
    self.path, self._files = path, dict(files)
    config, specials_map = _json(files, "tokenizer_config.json"), _json(files, "special_tokens_map.json")
    # transformers 5 saves the template as chat_template.jinja, which takes priority over the config's entry.
    self.chat_template = (files["chat_template.jinja"].decode("utf-8") if "chat_template.jinja" in files
                          else config.get("chat_template"))
    if isinstance(self.chat_template, list):  # several named templates: the default one
      named = {t.get("name"): t.get("template") for t in self.chat_template}
      self.chat_template = named.get("default") or next(iter(named.values()), None)
    self._tok_with_specials = None  # built on first use (rendered chat text only; see encode_with_offsets)
    if "tokenizer.json" in files:
      import tokenizers  # pylint: disable=g-import-not-at-top
      self._tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
      self._tok.encode_special_tokens = True  # special-token strings in plain text stay text (see encode)
      self._sp = None
    else:
      self._tok = None
      self._sp = tokenizer_lib.Tokenizer(files["tokenizer.model"], path)
    names = {k: _token_text(config.get(k)) or _token_text(specials_map.get(k)) for k in NAMED_TOKENS}
    self.template_tokens = {k: t for k, t in names.items() if t and self._piece_id(t) is not None}
    # The pieces a sentencepiece model matches as single ids in rendered text, besides its user-defined ones.
    # (transformers 5 writes extra_special_tokens for additional_special_tokens.)
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    self._specials = sorted({*self.template_tokens.values(),
                             *(t for t in extra if t and self._piece_id(t) is not None)})
    self._bos, self._eos, self._pad = (self._named_id(names[k], d) for k, d in (
        ("bos_token", self._sp.bos_id if self._sp else -1), ("eos_token", self._sp.eos_id if self._sp else -1),
        ("pad_token", -1)))
    self.add_bos_token = self._adds_bos(config)
    if self._bos < 0:  # no BOS (Qwen): documents start after the separator (module docstring)
      separator = self._piece_id(DOCUMENT_SEPARATOR)
      self._bos = separator if separator is not None else self._eos
    self.stop_ids = self._stop_ids(_json(files, "generation_config.json"))

  def _named_id(self, text: str | None, default: int) -> int:
    i = self._piece_id(text) if text else None
    return default if i is None else i

  def _adds_bos(self, config: dict[str, Any]) -> bool:
    """Whether transformers' AutoTokenizer(text) prepends BOS: tokenizer_config.json's add_bos_token when set
    (transformers then rebuilds the post-processor from it), else tokenizer.json's post-processor; a
    sentencepiece-only directory (Llama 2, Mistral, Gemma) adds it."""
    if self._bos < 0:
      return False
    if "add_bos_token" in config:
      return bool(config["add_bos_token"])
    if self._tok is None:
      return True
    return self._tok.encode("", add_special_tokens=True).ids[:1] == [self._bos]

  def _stop_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
    listed = generation_config.get("eos_token_id")
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    stops = {self._eos, *listed, *(self._piece_id(t) for t in END_OF_TURN_PIECES)}
    return tuple(sorted(i for i in stops if isinstance(i, int) and 0 <= i < self.vocab_size))

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
    """The id a document starts with (module docstring: BOS, or the document separator without one)."""
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
    return self.encode_with_offsets(text)[0]

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode_with_specials`' ids of `text` and each id's character span in it (chat masks from text spans).

    With tokenizer.json the whole text goes through a second `tokenizers` instance that matches special tokens
    (the plain-text one never does), with the named tokens registered as special as transformers registers them;
    so the ids are apply_chat_template's, added tokens' lstrip/rstrip included."""
    if self._tok is None:
      return self._sp.encode_with_offsets(text, self._specials)
    if self._tok_with_specials is None:
      import tokenizers  # pylint: disable=g-import-not-at-top
      tok = tokenizers.Tokenizer.from_str(self._files["tokenizer.json"].decode("utf-8"))
      added = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
      tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                              for t in self.template_tokens.values() if t not in added])
      self._tok_with_specials = tok
    encoding = self._tok_with_specials.encode(text, add_special_tokens=False)
    return encoding.ids, [tuple(o) for o in encoding.offsets]

  def encode_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
    del num_threads
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    """Text of `ids` without the special tokens (transformers' decode(skip_special_tokens=True)); SentencePiece
    drops its control pieces itself, the named and additional special tokens (Gemma's turn markers) are dropped
    here."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self._tok is not None:
      return self._tok.decode(ids, skip_special_tokens=True)
    skip = {self._piece_id(t) for t in self._specials}
    return self._sp.decode([i for i in ids if i not in skip])

  def decode_batch(self, ids_batch) -> list[str]:
    return [self.decode(ids) for ids in ids_batch]

  def id_to_piece(self, i: int) -> str:
    return self._tok.id_to_token(int(i)) if self._tok is not None else self._sp.id_to_piece(i)


def load(directory: str) -> HFTokenizer:
  """The tokenizer of a Hugging Face model directory (module docstring)."""
  return HFTokenizer.load(directory)
