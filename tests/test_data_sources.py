"""Sources and mixture specs: every reader returns what was written; bad input fails or is skipped clearly."""
import json
import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import tiny
from data import pipeline
from data import sources
from data import tokenizer as tokenizer_lib


def test_spec_parsing():
  specs = sources.parse_spec("builtin")
  assert [(s.name, s.kind, s.arg) for s in specs] == [("prose", "builtin", "prose"), ("code", "builtin", "code")]
  assert [s.weight for s in specs] == pytest.approx([0.9, 0.1])
  specs = sources.parse_spec(("web=jsonl:/d/*.jsonl@3", "text:/b/*.txt"), weights=())
  assert [(s.name, s.kind, s.arg) for s in specs] == [("web", "jsonl", "/d/*.jsonl"), ("text", "text", "/b/*.txt")]
  assert [s.weight for s in specs] == pytest.approx([0.75, 0.25])
  specs = sources.parse_spec("a=parquet:gs://bucket/x/*.parquet,b=arrayrecord:/r/*.array_record", (1, 3))
  assert [s.weight for s in specs] == pytest.approx([0.25, 0.75]) and specs[0].arg == "gs://bucket/x/*.parquet"
  for bad, msg in [("csv:/x", "KIND:PATH"), ("builtin:poetry", "builtin:prose"), ("jsonl:/a,jsonl:/b", "repeat"),
                   ("jsonl:/a@0", "must be > 0"), ("", "empty")]:
    with pytest.raises(sources.SpecError, match=msg):
      sources.parse_spec(bad)
  with pytest.raises(sources.SpecError, match="one weight per source"):
    sources.parse_spec("builtin", (1.0,))


def test_glob_that_matches_nothing_names_the_pattern(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"nothing-\*\.jsonl"):
    sources.JsonlFiles("x", str(tmp_path / "nothing-*.jsonl"))
  (tmp_path / "sub").mkdir()
  for name in ("sub/b.txt", "a.txt", "c.md"):
    (tmp_path / name).write_text(name)
  assert sources.expand_glob(str(tmp_path / "**" / "*.txt")) == [str(tmp_path / "a.txt"), str(tmp_path / "sub/b.txt")]


def test_text_files_and_invalid_utf8(tmp_path, caplog):
  (tmp_path / "a.txt").write_text("first document ✓")
  (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes \xc3")
  src = sources.TextFiles("t", str(tmp_path / "*.txt"))
  before = sources.COUNTERS["invalid_utf8_sequences"]
  assert len(src) == 2 and src[0] == "first document ✓"
  with caplog.at_level(logging.WARNING):
    assert src[1] == "bad \ufffd\ufffd bytes \ufffd"
  assert sources.COUNTERS["invalid_utf8_sequences"] - before == 3
  assert "b.txt: 3 invalid UTF-8" in caplog.text


def test_jsonl_skips_bad_lines_with_location_and_reports_missing_field_once(tmp_path, caplog):
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join([json.dumps({"text": "one"}), "", "{not json", json.dumps({"body": "x", "id": 1}),
                             json.dumps({"body": "y", "id": 2}), json.dumps({"text": "two"})]) + "\n")
  src = sources.JsonlFiles("j", str(path))
  assert len(src) == 5  # the blank line is not a record
  with caplog.at_level(logging.WARNING):
    docs = [src[i] for i in range(len(src))]
  assert docs == ["one", "", "", "", "two"]
  assert f"{path}:3: unparseable JSON" in caplog.text
  assert caplog.text.count("no text field 'text'") == 1 and "['body', 'id']" in caplog.text
  strict = sources.JsonlFiles("j", str(path), strict=True)
  with pytest.raises(ValueError, match=f"{path}:3: unparseable JSON"):
    strict[1]
  with pytest.raises(ValueError, match=r"has no text field 'text' \(it has \['body', 'id'\]\)"):
    strict[2]
  assert sources.JsonlFiles("j", str(path), field="body")[2] == "x"


def test_parquet_and_arrayrecord_read_back_what_was_written(tmp_path):
  texts = [f"row {i} ünïcode" for i in range(25)]
  pq.write_table(pa.table({"text": texts[:15], "n": list(range(15))}), tmp_path / "a.parquet", row_group_size=4)
  pq.write_table(pa.table({"text": texts[15:], "n": list(range(10))}), tmp_path / "b.parquet")
  src = sources.ParquetFiles("p", str(tmp_path / "*.parquet"))
  assert [src[i] for i in range(len(src))] == texts
  assert src[3] == texts[3]  # random access back into an earlier row group
  with pytest.raises(ValueError, match=r"no column 'body' \(it has \['text', 'n'\]\)"):
    sources.ParquetFiles("p", str(tmp_path / "*.parquet"), field="body")
  from array_record.python.array_record_module import ArrayRecordWriter
  writer = ArrayRecordWriter(str(tmp_path / "r.array_record"), "group_size:1")
  for t in texts:
    writer.write(t.encode())
  writer.close()
  ar = sources.ArrayRecordFiles("r", str(tmp_path / "*.array_record"))
  assert [ar[i] for i in range(len(ar))] == texts


def test_builtin_corpus_is_prose_and_code_from_the_installation():
  prose, code = sources.Builtin("prose", "prose"), sources.Builtin("code", "code")
  files = sources.stdlib_files()
  assert len(code) == len(files) > 300
  assert sum(os.path.getsize(f) for f in files) > 5e6  # several million tokens of code
  i = next(i for i, f in enumerate(files) if f.endswith(os.sep + "textwrap.py"))
  with open(files[i], encoding="utf-8") as f:
    assert code[i] == f.read()
  doc = prose[len(prose.topics) + i]
  import textwrap
  assert doc.startswith("textwrap\n\n" + textwrap.__doc__.strip()[:40])
  assert "textwrap.TextWrapper.wrap\n\n" in doc
  assert len(prose.topics) > 50 and all(isinstance(t, str) and t for t in prose.topics[:5])


def test_empty_documents_are_skipped_by_the_pipeline(tmp_path):
  rng = np.random.default_rng(0)
  words = "alpha beta gamma delta pack row".split()
  real = [f"doc{i:04d} " + " ".join(rng.choice(words, 20)) for i in range(120)]
  with open(tmp_path / "d.jsonl", "w") as f:
    for i, t in enumerate(real):
      f.write(json.dumps({"text": t}) + "\n")
      f.write(json.dumps({"text": "" if i % 2 else "  \n "}) + "\n")
  tok_path = tokenizer_lib.train(real, str(tmp_path / "t.model"), 320)
  tok = tokenizer_lib.Tokenizer.load(tok_path)
  c = tiny.get_config()
  c.model.vocab_size, c.train.batch_size, c.train.seq_len = 320, 2, 64
  c.data.update(sources=f"jsonl:{tmp_path}/d.jsonl", tokenizer=tok_path, eval_fraction=0.0)
  it = pipeline.make_iterator(c, tok, process_index=0, process_count=1)
  starts = 0
  for _ in range(10):
    b = next(it)
    for inp, tgt, seg in zip(b["inputs"], b["targets"], b["segment_ids"]):
      for s in np.unique(seg[seg > 0]):
        piece_in, piece_tgt = inp[seg == s], tgt[seg == s]
        if piece_in[0] == tok.bos_id:
          starts += 1
          assert len(piece_in) > 1 and tok.decode(piece_in).startswith("doc"), "an empty document was packed"
  it.close()
  assert starts >= 10
