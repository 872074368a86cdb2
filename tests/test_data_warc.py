"""Web archives through data/files.py: archives written by warcio with good, non-UTF-8, malformed and truncated
records and a truncated .gz; the good records come through with their metadata, the bad ones are counted with their
offsets, and curating the archive gives the output of a text input of the same documents."""
import gzip
import io
import json
import random

import pytest
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

import curate_corpus
from data import files
from data.curate import pipeline

_WORDS = ("harbour town boats dawn market bakers teachers fishermen story dusk river bridge winter garden lamp bell "
          "tower museum painter station ticket journey mountain forest letter friend kitchen window street rain").split()
_RNG = random.Random(0)
PAGES = [" ".join(_RNG.choice(_WORDS) for _ in range(40)).capitalize() + ". Then the dawn came and the market opened."
         for _ in range(4)]  # four different pages (no near duplicates), each with "dawn"


def _conversion(writer, i, body: bytes):
  writer.write_record(writer.create_warc_record(
      f"http://example.org/{i}", "conversion", payload=io.BytesIO(body),
      warc_content_type="text/plain", warc_headers_dict={"WARC-Date": f"2024-01-0{i + 1}T00:00:00Z"}))


def _response(writer, uri, status, content_type, body: bytes, extra=()):
  http = StatusAndHeaders(status, [("Content-Type", content_type), *extra], protocol="HTTP/1.1")
  writer.write_record(writer.create_warc_record(uri, "response", payload=io.BytesIO(body), http_headers=http))


def _archive(gz: bool) -> bytes:
  out = io.BytesIO()
  writer = WARCWriter(out, gzip=gz)
  writer.write_record(writer.create_warcinfo_record("test.warc", {"software": "test"}))
  _conversion(writer, 0, PAGES[0].encode())
  _conversion(writer, 1, PAGES[1].encode() + b" caf\xe9")  # not UTF-8: replaced and counted
  html = (f"<html><head><title>t</title><script>var x = 1;</script></head><body><nav>Home | About</nav>"
          f"<article><p>{PAGES[2]}</p></article></body></html>")
  _response(writer, "http://example.org/latin", "200 OK", "text/html; charset=iso-8859-1",
            html.replace("dawn", "d\u00e9but").encode("latin-1"))
  _response(writer, "http://example.org/gz", "200 OK", "text/html", gzip.compress(f"<p>{PAGES[3]}</p>".encode()),
            [("Content-Encoding", "gzip")])
  _response(writer, "http://example.org/missing", "404 Not Found", "text/html", b"<p>gone</p>")
  _response(writer, "http://example.org/logo.png", "200 OK", "image/png", b"\x89PNG....")
  return out.getvalue()


def test_good_records_come_through_with_metadata_and_bad_ones_are_counted(tmp_path):
  path = tmp_path / "crawl.warc.gz"
  path.write_bytes(_archive(gz=True))
  problems = files.Problems()
  docs = list(files.read_documents(str(path), problems=problems))
  assert [d["url"] for d in docs] == [f"http://example.org/{i}" for i in (0, 1)] + [
      "http://example.org/latin", "http://example.org/gz"]
  assert docs[0]["text"] == PAGES[0] and docs[0]["date"] == "2024-01-01T00:00:00Z"
  assert docs[1]["text"] == PAGES[1] + " caf\ufffd"
  assert docs[2]["text"] == PAGES[2].replace("dawn", "d\u00e9but")  # the page's own charset; nav and script gone
  assert docs[3]["text"] == PAGES[3] and docs[3]["content_type"] == "text/html"
  assert all(d["id"].startswith("urn:uuid:") for d in docs)
  assert problems.to_dict() == {"invalid_utf8_documents": 1, "invalid_utf8_sequences": 1}


def test_truncated_gzip_malformed_and_cut_records_are_skipped_with_offsets(tmp_path, caplog):
  data = _archive(gz=True)
  cut = tmp_path / "cut.warc.gz"
  cut.write_bytes(data[:len(data) - 40])  # the last member (the PNG response) breaks off
  problems = files.Problems()
  assert len(list(files.read_documents(str(cut), problems=problems))) == 4
  assert problems.counts["truncated_archives"] == 1
  plain = _archive(gz=False)
  second = plain.index(b"WARC/1.0", 10)
  garbled = plain[:second] + b"this line is no record\r\nnor this one\r\n\r\n" + plain[second:]
  (tmp_path / "garbled.warc").write_bytes(garbled)
  problems = files.Problems()
  assert len(list(files.read_documents(str(tmp_path / "garbled.warc"), problems=problems))) == 4
  assert problems.counts["bad_warc_records"] == 1
  (tmp_path / "short.warc").write_bytes(plain[:plain.index(b"WARC/1.0", second + 10) + 400])
  problems = files.Problems()
  assert len(list(files.read_documents(str(tmp_path / "short.warc"), problems=problems))) == 1
  assert problems.counts["truncated_warc_records"] == 1
  assert f"record at byte {plain.index(b'WARC/1.0', second + 10)} declares" in caplog.text
  with pytest.raises(ValueError, match="no WARC/ header line"):
    list(files.read_documents(str(tmp_path / "garbled.warc"), strict=True))


def test_curating_an_archive_equals_curating_its_documents_as_text(tmp_path):
  (tmp_path / "crawl.warc.gz").write_bytes(_archive(gz=True))
  docs = list(files.read_documents(str(tmp_path / "crawl.warc.gz")))
  with open(tmp_path / "same.jsonl", "w") as f:
    f.writelines(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs)
  texts = {}
  for name in ("crawl.warc.gz", "same.jsonl"):
    cfg = curate_corpus.curate_input_config(tmp_path / name, tmp_path / f"out-{name}", langid__enabled=False,
                                            perplexity__enabled=False, quality__min_words=20, dedup__min_length=100)
    pipeline.run(cfg)
    texts[name] = [(d["id"], d["text"]) for d in curate_corpus.output_records(cfg.output)]
  assert len(texts["same.jsonl"]) == 4 and texts["crawl.warc.gz"] == texts["same.jsonl"]
