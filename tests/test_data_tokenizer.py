"""SentencePiece training, loading, byte-fallback round trips, and the run's tokenizer preparation."""
import os
import pickle
import re

import pytest

from configs import tiny
from data import sources
from data import tokenizer as tokenizer_lib

TRICKY = [
    "emoji 😀🚀👩‍💻 and flags 🇯🇵",
    "CJK 漢字かな交じり文 한국어 中文标点，。",
    "control \x00\x01\x07\x1b[0m\x7f chars\ttab\r\nnewline",
    "def f(x):\n    return {'a': [1, 2]}  # indentation  kept\n\n\n",
    "  leading and trailing spaces  ",
    "mixed naïve café Ωμέγα ∑∫√ \u200b zero-width",
]


def _texts():
  """A small English + code corpus from Python's own installation (the built-in source's first documents)."""
  prose = sources.Builtin("prose", "prose")
  code = sources.Builtin("code", "code")
  return [prose[i] for i in range(40)] + [code[i] for i in range(0, 400, 20)]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def model_path(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tok") / f"{request.param}.model")
  return tokenizer_lib.train(_texts(), path, 600, request.param, max_sentences=3_000)


def test_round_trip_with_byte_fallback(model_path):
  tok = tokenizer_lib.Tokenizer.load(model_path)
  assert tok.vocab_size == 600
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
  ids_batch = tok.encode_batch(TRICKY)
  for text, ids in zip(TRICKY, ids_batch):
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)
  # Characters unseen in training are spelled as UTF-8 bytes (byte fallback), not <unk>.
  pieces = [tok.id_to_piece(i) for i in tok.encode("😀")]
  assert pieces == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
  assert 1 not in [i for ids in ids_batch for i in ids], "no <unk> with byte fallback"
  # Independently of sentencepiece's decoder: the ids spell each text exactly, piece by piece, reading only the
  # vocabulary (pieces with U+2581 for a space, <0xHH> for a fallback byte).
  for text, ids in zip(TRICKY + _texts()[:3], tok.encode_batch(TRICKY + _texts()[:3])):
    assert _spell(tok, ids) == text.encode("utf-8")
  # And it is a trained tokenizer, not a byte spelling: English prose from its training corpus compresses.
  prose = _texts()[:10]
  assert sum(map(len, prose)) / sum(map(len, tok.encode_batch(prose))) > 1.5  # ~2.1 characters per token


def _spell(tok, ids) -> bytes:
  """The UTF-8 bytes a sequence of ids stands for, from the piece strings alone."""
  out = b""
  for i in ids:
    piece = tok.id_to_piece(i)
    if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
      out += bytes([int(piece[3:5], 16)])
    else:
      out += piece.replace("\u2581", " ").encode("utf-8")
  return out


def test_special_and_reserved_pieces(model_path):
  tok = tokenizer_lib.Tokenizer.load(model_path)
  reserved = [tok.special_id(p) for p in tokenizer_lib.RESERVED]
  assert len(set(reserved)) == len(reserved) and min(reserved) > tok.eos_id
  assert "<|user|>" in tokenizer_lib.RESERVED
  # Control pieces never come out of encoding text (no injection) and decode to nothing.
  assert tok.special_id("<|user|>") not in tok.encode("<|user|> hi")
  assert tok.decode([tok.bos_id, tok.special_id("<|user|>"), tok.eos_id, tok.pad_id]) == ""
  with pytest.raises(KeyError):
    tok.special_id("<|nope|>")
  clone = pickle.loads(pickle.dumps(tok))
  assert clone.encode(TRICKY[1]) == tok.encode(TRICKY[1])


def test_prepare_trains_once_into_the_workdir_and_checks_the_vocabulary(tmp_path):
  c = tiny.get_config()
  c.model.vocab_size = 400
  c.data.tokenizer_max_sentences = 5_000
  path = tokenizer_lib.prepare(c, str(tmp_path))
  assert path == os.path.join(str(tmp_path), "tokenizer.model")
  assert tokenizer_lib.Tokenizer.load(path).vocab_size == 400
  mtime = os.path.getmtime(path)
  assert tokenizer_lib.prepare(c, str(tmp_path)) == path and os.path.getmtime(path) == mtime  # reused
  c.model.vocab_size = 512
  with pytest.raises(ValueError, match=r"has 400 pieces but config.model.vocab_size is 512.*"
                                       r"--config.model.vocab_size=400"):
    tokenizer_lib.prepare(c, str(tmp_path))
  c.data.tokenizer_vocab_size = 400  # a padded embedding: 400 tokenizer pieces in a 512-row table
  assert tokenizer_lib.prepare(c, str(tmp_path)) == path
  c.data.tokenizer = str(tmp_path / "missing.model")
  with pytest.raises(FileNotFoundError, match="missing.model"):
    tokenizer_lib.prepare(c, str(tmp_path))


def test_bad_arguments_fail_clearly(tmp_path):
  with pytest.raises(ValueError, match="model_type"):
    tokenizer_lib.train(["x"], str(tmp_path / "t.model"), 600, "wordpiece")
  with pytest.raises(ValueError, match="too small"):
    tokenizer_lib.train(["x"], str(tmp_path / "t.model"), 100)
  with pytest.raises(ValueError, match="no text"):
    tokenizer_lib.train(["", "  \n"], str(tmp_path / "t.model"), 600)


def test_command_line_trains_and_encodes(tmp_path, capsys):
  src = tmp_path / "docs.txt"
  src.write_text("\n".join(_texts()[:30]))
  out = str(tmp_path / "cli.model")
  assert tokenizer_lib.main([f"--output={out}", f"--sources=text:{src}", "--vocab_size=400",
                             "--encode=hello 😀"]) == 0
  assert "'decoded': 'hello 😀'" in capsys.readouterr().out
  assert tokenizer_lib.Tokenizer.load(out).vocab_size == 400
