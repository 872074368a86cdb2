"""Curation input readers (JSONL, Parquet, plain text, Common Crawl WET) and the `python -m data.curate` CLI."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.curate import __main__ as cli
from data.curate import readers


def _wet_record(headers, body):
  payload = body.encode("utf-8")
  head = "WARC/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
  return (head + f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload + b"\r\n\r\n"


def test_wet(tmp_path):
  path = tmp_path / "crawl.warc.wet.gz"
  body = "Erste Zeile der Seite.\nZweite Zeile mit Umlauten: äöü."
  with gzip.open(path, "wb") as f:
    f.write(_wet_record({"WARC-Type": "warcinfo", "WARC-Record-ID": "<urn:uuid:info>"}, "software: test"))
    f.write(_wet_record({"WARC-Type": "conversion", "WARC-Target-URI": "http://example.org/a",
                         "WARC-Date": "2024-01-01T00:00:00Z", "WARC-Record-ID": "<urn:uuid:1>",
                         "Content-Type": "text/plain"}, body))
    f.write(_wet_record({"WARC-Type": "conversion", "WARC-Target-URI": "http://example.org/b",
                         "WARC-Record-ID": "<urn:uuid:2>"}, "Second page."))
  docs = list(readers.read_shard(str(path)))
  assert [d["id"] for d in docs] == ["urn:uuid:1", "urn:uuid:2"]
  assert docs[0]["text"] == body and docs[0]["url"] == "http://example.org/a"
  assert docs[0]["date"] == "2024-01-01T00:00:00Z"


def test_jsonl_parquet_and_text(tmp_path):
  with open(tmp_path / "a.jsonl", "w") as f:
    f.write(json.dumps({"doc_id": 7, "body": "one", "lang_hint": "en"}) + "\n\n")
    f.write(json.dumps({"body": "two"}) + "\n")
  docs = list(readers.read_shard(str(tmp_path / "a.jsonl"), id_field="doc_id", text_field="body"))
  assert docs == [{"id": "7", "text": "one", "lang_hint": "en"}, {"id": "a.jsonl:3", "text": "two"}]
  pq.write_table(pa.table({"id": ["x", "y"], "text": ["first", "second"], "score": [1.5, 2.5]}),
                 tmp_path / "b.parquet")
  assert list(readers.read_shard(str(tmp_path / "b.parquet"))) == [
      {"id": "x", "text": "first", "score": 1.5}, {"id": "y", "text": "second", "score": 2.5}]
  (tmp_path / "c.txt").write_text("para one\nline two\n\n\npara two\n")
  assert [d["text"] for d in readers.read_shard(str(tmp_path / "c.txt"))] == ["para one\nline two", "para two"]
  assert len(list(readers.read_shard(str(tmp_path / "c.txt"), text_mode="line"))) == 3
  assert len(list(readers.read_shard(str(tmp_path / "c.txt"), text_mode="file"))) == 1


def test_bad_input_gets_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="matches no file"):
    readers.expand_inputs(str(tmp_path / "nothing-*.jsonl"))
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
    list(readers.read_shard(str(tmp_path / "bad.jsonl")))
  (tmp_path / "nofield.jsonl").write_text('{"content": "x"}\n')
  with pytest.raises(ValueError, match="no string field 'text'"):
    list(readers.read_shard(str(tmp_path / "nofield.jsonl")))
  with pytest.raises(ValueError, match="cannot tell the format"):
    readers.detect_format("data.csv")


def test_cli_runs_with_overrides_and_rejects_unknown_keys(tmp_path, capsys):
  with open(tmp_path / "in.jsonl", "w") as f:
    for i, topic in enumerate(("harbour and its boats", "market and its stalls", "garden and its trees")):
      f.write(json.dumps({"id": str(i), "text": f"This document is about the {topic}. " * 3}) + "\n")
  args = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--config.num_workers=1",
          "--config.dedup.min_length=0", "--config.quality.enabled=false", "--config.perplexity.enabled=false",
          "--config.minhash.enabled=false"]
  assert cli.main(args) == 0
  assert "| langid |" in capsys.readouterr().out
  with open(tmp_path / "out" / "en" / "all" / "part-00000.jsonl") as f:
    assert [json.loads(line)["id"] for line in f] == ["0", "1", "2"]
  assert cli.main(args + ["--config.minhash.treshold=0.5"]) == 2
  assert "did you mean 'minhash.threshold'" in capsys.readouterr().err
  assert cli.main(["--output", str(tmp_path / "o2"), "--config.num_workers=1"]) == 2
  assert "pass --input" in capsys.readouterr().err
