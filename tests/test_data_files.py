"""One I/O layer (data/files.py) under the training sources and curation: the same formats and the same rules for
bad input, whichever side reads the file."""
import gzip
import json
import logging

import pytest

from data import files
from data import sources


def _write_bad_utf8_jsonl(path, bad_lines=13, good_lines=7):
  with open(path, "wb") as f:
    for i in range(bad_lines + good_lines):
      text = f"record {i} ".encode() + (b"caf\xe9 \xff" if i < bad_lines else "café".encode())
      f.write(b'{"text": "' + text + b'"}\n')


def test_invalid_utf8_is_warned_once_per_file_with_a_count(tmp_path, caplog):
  path = tmp_path / "crawl.jsonl"
  _write_bad_utf8_jsonl(path)
  with caplog.at_level(logging.WARNING):
    src = sources.JsonlFiles("web", str(path))
    docs = [src[i] for i in range(len(src))]
  assert docs[0] == "record 0 caf\ufffd \ufffd" and docs[-1] == "record 19 café"
  warnings = [r.getMessage() for r in caplog.records if "UTF-8" in r.getMessage()]
  assert len(warnings) == 1 and f"{path}: 13 line(s)" in warnings[0] and "26 sequences" in warnings[0]
  caplog.clear()
  problems = files.Problems()
  with caplog.at_level(logging.WARNING):
    streamed = [d["text"] for d in files.read_documents(str(path), problems=problems)]
  assert streamed == docs
  warnings = [r.getMessage() for r in caplog.records if "UTF-8" in r.getMessage()]
  assert len(warnings) == 1 and "13 record(s) with invalid UTF-8 (26 sequences" in warnings[0]
  assert problems.to_dict() == {"invalid_utf8_documents": 13, "invalid_utf8_sequences": 26}


@pytest.mark.parametrize("record,message", [
    ({"text": 42}, r"text field 'text' is not a string \(it is int 42\)"),
    ({"text": None, "body": "x"}, r"text field 'text' is not a string \(it is NoneType None\)"),
    ({"body": "x", "id": 1}, r"record has no text field 'text' \(it has \['body', 'id'\]\)"),
])
def test_a_record_without_a_string_text_is_named_the_same_way_on_both_sides(tmp_path, record, message):
  path = tmp_path / "d.jsonl"
  path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(record) + "\n")
  with pytest.raises(ValueError, match=f"{path}:2: {message}"):
    sources.JsonlFiles("j", str(path), strict=True)[1]
  with pytest.raises(ValueError, match=f"{path}:2: {message}"):
    list(files.read_documents(str(path), strict=True))


def test_bad_records_are_skipped_counted_and_warned_once_per_file_on_both_sides(tmp_path, caplog):
  path = tmp_path / "d.jsonl"
  lines = [json.dumps({"text": "one"}), "{not json", json.dumps({"text": 42}), "[1, 2", json.dumps({"text": 7}),
           json.dumps({"text": "two"})]
  path.write_text("\n".join(lines) + "\n")
  with caplog.at_level(logging.WARNING):
    src = sources.JsonlFiles("j", str(path))
    before = dict(files.COUNTERS)
    for _ in range(2):  # a second epoch reads the same bad records again: they count once
      assert [src[i] for i in range(len(src))] == ["one", "", "", "", "", "two"]
    counted = {k: files.COUNTERS[k] - before.get(k, 0) for k in ("unparseable_records", "records_without_text")}
    assert counted == {"unparseable_records": 2, "records_without_text": 2}
  assert caplog.text.count("unparseable JSON") == 1 and f"{path}:2: unparseable JSON" in caplog.text
  assert caplog.text.count("is not a string") == 1 and f"{path}:3: text field" in caplog.text
  caplog.clear()
  problems = files.Problems()
  with caplog.at_level(logging.WARNING):
    assert [d["text"] for d in files.read_documents(str(path), problems=problems)] == ["one", "two"]
  (warning,) = [r.getMessage() for r in caplog.records]
  assert f"2 unparseable record(s) skipped (first: {path}:2:" in warning
  assert f"2 record(s) without a string text field skipped (first: {path}:3:" in warning
  assert problems.to_dict() == {"records_without_text": 2, "unparseable_records": 2}


def test_gzip_and_text_formats_read_the_same_on_both_sides(tmp_path):
  records = [{"text": f"document {i} über"} for i in range(5)]
  with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  src = sources.JsonlFiles("j", str(tmp_path / "*.jsonl.gz"))
  assert [src[i] for i in (3, 0, 4)] == [records[i]["text"] for i in (3, 0, 4)]  # random access into a .gz
  assert [d["text"] for d in files.read_documents(str(tmp_path / "a.jsonl.gz"))] == [r["text"] for r in records]
  with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
    f.write("one file, one document ✓\n".encode())
  assert sources.TextFiles("t", str(tmp_path / "b.txt.gz"))[0] == "one file, one document ✓\n"
  assert [d["text"] for d in files.read_documents(str(tmp_path / "b.txt.gz"), text_mode="file")] == [
      "one file, one document ✓"]


def test_patterns_and_formats_fail_naming_the_setting(tmp_path):
  (tmp_path / "a.txt").write_text("x")
  with pytest.raises(FileNotFoundError, match=r"config.data.sources: pattern .*nothing-\*\.jsonl' matches no file"):
    sources.JsonlFiles("x", str(tmp_path / "nothing-*.jsonl"))
  with pytest.raises(FileNotFoundError, match=r"input: pattern .*nothing-\*\.jsonl' matches no file"):
    files.expand(str(tmp_path / "a.txt") + "," + str(tmp_path / "nothing-*.jsonl"), "input")
  with pytest.raises(ValueError, match="set perplexity.reference_format to one of"):
    files.detect_format("wiki.dump", "perplexity.reference_format")
  # Remote (etils.epath) patterns are globbed below their literal directory prefix.
  assert files._split_glob("gs://bucket/d/*/x-*.jsonl") == ("gs://bucket/d", "*/x-*.jsonl")
