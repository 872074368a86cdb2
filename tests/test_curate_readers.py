"""Curation input (JSONL, Parquet, plain text, Common Crawl WET through data/files.py) and the `python -m data.curate`
CLI, with the commands the README and docs/curation.md show."""
import gzip
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import curate as curate_config
from data import sources
from data.curate import __main__ as cli
from data.curate import pipeline
from data import files


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
  docs = list(files.read_documents(str(path)))
  assert [d["id"] for d in docs] == ["urn:uuid:1", "urn:uuid:2"]
  assert docs[0]["text"] == body and docs[0]["url"] == "http://example.org/a"
  assert docs[0]["date"] == "2024-01-01T00:00:00Z"


def test_jsonl_parquet_and_text(tmp_path):
  with open(tmp_path / "a.jsonl", "w") as f:
    f.write(json.dumps({"doc_id": 7, "body": "one", "lang_hint": "en"}) + "\n\n")
    f.write(json.dumps({"body": "two"}) + "\n")
  docs = list(files.read_documents(str(tmp_path / "a.jsonl"), id_field="doc_id", text_field="body"))
  assert docs == [{"id": "7", "text": "one", "lang_hint": "en"}, {"id": "a.jsonl:3", "text": "two"}]
  pq.write_table(pa.table({"id": ["x", "y"], "text": ["first", "second"], "score": [1.5, 2.5]}),
                 tmp_path / "b.parquet")
  assert list(files.read_documents(str(tmp_path / "b.parquet"))) == [
      {"id": "x", "text": "first", "score": 1.5}, {"id": "y", "text": "second", "score": 2.5}]
  (tmp_path / "c.txt").write_text("para one\nline two\n\n\npara two\n")
  assert [d["text"] for d in files.read_documents(str(tmp_path / "c.txt"))] == ["para one\nline two", "para two"]
  assert len(list(files.read_documents(str(tmp_path / "c.txt"), text_mode="line"))) == 3
  assert len(list(files.read_documents(str(tmp_path / "c.txt"), text_mode="file"))) == 1


def test_bad_input_gets_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="matches no file"):
    files.expand(str(tmp_path / "nothing-*.jsonl"), "input")
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: unparseable JSON"):
    list(files.read_documents(str(tmp_path / "bad.jsonl"), strict=True))
  with pytest.raises(ValueError, match="set input_format to one of"):
    files.detect_format("data.csv")


def test_extensionless_reference_error_names_its_own_key(tmp_path):
  (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "Some text about the harbour. " * 20}) + "\n")
  (tmp_path / "wiki.dump").write_text("a reference sentence\n")
  cfg = curate_config.get_config()
  cfg.input, cfg.output, cfg.num_workers = str(tmp_path / "docs.jsonl"), str(tmp_path / "out"), 1
  cfg.perplexity.reference = (str(tmp_path / "wiki.dump"),)
  with pytest.raises(ValueError, match="set perplexity.reference_format to one of"):
    pipeline.run(cfg)


@pytest.mark.slow  # a subprocess with worker processes
def test_readme_curation_command_works_as_written(tmp_path):
  """The README's command, verbatim, on a copy of the repository's docs: exit 0, and without a reference corpus
  the perplexity stage is skipped with a notice (printed, and in stats.md) instead of failing."""
  root = pathlib.Path(__file__).resolve().parents[1]
  (command,) = [line.strip() for line in (root / "README.md").read_text().splitlines()
                if line.strip().startswith("python -m data.curate")]
  shutil.copytree(root / "docs", tmp_path / "docs")
  env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
  done = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  assert "perplexity stage skipped: no perplexity.reference" in done.stderr
  output = tmp_path / shlex.split(command)[shlex.split(command).index("--output") + 1]
  assert "Notice: perplexity stage skipped" in (output / "stats.md").read_text()
  stats = json.loads((output / "stats.json").read_text())
  assert stats["stages"][0]["docs_in"] == len(list((root / "docs").glob("*.md")))
  assert all(bucket == "all" for lang in stats["output"].values() for bucket in lang)


def test_training_example_in_the_curation_docs_parses():
  """docs/curation.md shows how to train on curated shards: its sources must parse (named, no repeats)."""
  root = pathlib.Path(__file__).resolve().parents[1]
  (spec,) = re.findall(r"--config\.data\.sources=\"([^\"]+)\"", (root / "docs" / "curation.md").read_text())
  specs = sources.parse_spec(spec)
  assert len({s.name for s in specs}) == len(specs) >= 3 and all(s.kind == "jsonl" for s in specs)


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
