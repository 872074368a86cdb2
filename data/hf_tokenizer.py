"""A meshlm SentencePiece tokenizer in Hugging Face form: `tokenizer.json` (the `tokenizers` library) + config.

`write(sp_model_path, directory)` writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`
so that `transformers.AutoTokenizer.from_pretrained(directory)` encodes text to the same ids as the SentencePiece
model, with BOS prepended by default as Llama's tokenizer does (`add_special_tokens=False` gives the bare ids).
`load(directory)` reads it back with `tokenizers` alone (no transformers) as an object with meshlm's
`Tokenizer` encode/decode interface.

How the SentencePiece pipeline is reproduced (meshlm trains with identity normalisation, no dummy prefix, no
whitespace folding, byte fallback, split digits):
- normaliser: spaces become U+2581 (nothing else changes);
- pre-tokeniser: SentencePiece's word split with whitespace-only pieces allowed: a word is a maximal run of
  U+2581 followed by non-U+2581 characters (`▁*[^▁]+`), or a trailing run of U+2581;
- model: BPE with the merges of every vocabulary piece ranked by the piece's SentencePiece score (which is the
  order SentencePiece applies them in), unknown characters as `<0xNN>` byte pieces; unigram models map to
  `tokenizers`' Unigram with the same scores;
- control pieces (<pad>, <unk>, <s>, </s>, the reserved chat/FIM pieces) are special added tokens. Unlike
  SentencePiece, `tokenizers` recognises their literal text (e.g. "<s>") inside input strings.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import sentencepiece as spm

SPACE = "\u2581"
_TYPE_BPE, _TYPE_UNIGRAM = 2, 1  # sentencepiece ModelProto.TrainerSpec.model_type values


def _model_type(sp: spm.SentencePieceProcessor, proto: bytes) -> str:
  from sentencepiece import sentencepiece_model_pb2 as pb  # protobuf ships with sentencepiece's wheel
  m = pb.ModelProto()
  m.ParseFromString(proto)
  kind = m.trainer_spec.model_type
  if kind not in (_TYPE_BPE, _TYPE_UNIGRAM):
    raise ValueError(f"SentencePiece model type {kind} cannot be exported (meshlm trains bpe or unigram)")
  if m.normalizer_spec.add_dummy_prefix or m.normalizer_spec.remove_extra_whitespaces:
    raise ValueError("only SentencePiece models trained as meshlm trains them (no dummy prefix, no whitespace "
                     "folding; data/tokenizer.py) can be exported to tokenizer.json")
  del sp
  return "bpe" if kind == _TYPE_BPE else "unigram"


def build(proto: bytes):
  """The `tokenizers.Tokenizer` equivalent of a serialized SentencePiece model (see the module docstring)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
  sp = spm.SentencePieceProcessor(model_proto=proto)
  kind = _model_type(sp, proto)
  n = sp.get_piece_size()
  pieces = [sp.id_to_piece(i) for i in range(n)]
  special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
  if kind == "bpe":
    vocab = {p: i for i, p in enumerate(pieces)}
    # Merges (left, right) -> piece for every piece that splits into two vocabulary pieces, ranked by the
    # merged piece's score (SentencePiece BPE merges the highest-scoring pair first), ties by the halves' ids.
    merges = []
    for i, piece in enumerate(pieces):
      if i in special or sp.is_byte(i) or len(piece) < 2:
        continue
      for k in range(1, len(piece)):
        left, right = piece[:k], piece[k:]
        if left in vocab and right in vocab:
          merges.append((-sp.get_score(i), i, vocab[left], vocab[right], left, right))
    merges.sort()
    model = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=sp.id_to_piece(sp.unk_id()),
                       fuse_unk=True, byte_fallback=True)
  else:
    model = models.Unigram([(p, sp.get_score(i)) for i, p in enumerate(pieces)], unk_id=sp.unk_id(),
                           byte_fallback=True)
  tok = Tokenizer(model)
  tok.normalizer = normalizers.Replace(" ", SPACE)
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{SPACE}*[^{SPACE}]+|{SPACE}+"), behavior="isolated")
  tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
  tok.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in special])
  bos = sp.id_to_piece(sp.bos_id())
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, sp.bos_id())])
  return tok


def write(sp_model_path: str, directory: str, model_max_length: int | None = None) -> list[str]:
  """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json for a meshlm .model file.

  Returns the written paths. `model_max_length` (tokens) goes into tokenizer_config.json when given.
  """
  with open(sp_model_path, "rb") as f:
    proto = f.read()
  sp = spm.SentencePieceProcessor(model_proto=proto)
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, n) for n in ("tokenizer.json", "tokenizer_config.json",
                                                 "special_tokens_map.json")]
  build(proto).save(paths[0])
  names = {"bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
           "unk_token": sp.id_to_piece(sp.unk_id())}
  if sp.pad_id() >= 0:
    names["pad_token"] = sp.id_to_piece(sp.pad_id())
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, **names}
  if model_max_length:
    config["model_max_length"] = int(model_max_length)
  for path, obj in ((paths[1], config), (paths[2], names)):
    with open(path, "w") as f:
      json.dump(obj, f, indent=2)
  return paths


class HFTokenizer:
  """A tokenizer.json read with `tokenizers`, with meshlm's Tokenizer interface (encode gives no BOS/EOS)."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no tokenizer.json at {path!r}; write one with `python -m train.export`")
    self.path = file
    self._tok = Tokenizer.from_file(file)
    config_path = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    config = {}
    if os.path.isfile(config_path):
      with open(config_path) as f:
        config = json.load(f)

    def special(name, default):
      value = config.get(name, default)
      value = value.get("content") if isinstance(value, dict) else value
      return self._tok.token_to_id(value) if value is not None else None
    self.bos_id = special("bos_token", "<s>")
    self.eos_id = special("eos_token", "</s>")
    self.vocab_size = self._tok.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)
