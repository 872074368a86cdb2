"""Readers for curation input: JSONL, Parquet, plain text and Common Crawl WET, one input file = one shard.

Every reader yields dicts with at least `id` (str) and `text` (str); JSONL and Parquet keep their other fields.
Files ending in .gz are decompressed on the fly.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
from typing import Iterator

FORMATS = ("jsonl", "parquet", "text", "wet")


def expand_inputs(patterns: str | tuple | list) -> list[str]:
  """Sorted, de-duplicated files matching one glob, a comma-separated list of globs, or a sequence of globs.

  Raises ValueError naming the pattern when nothing matches (an empty input is almost always a typo)."""
  if isinstance(patterns, str):
    patterns = [p for p in patterns.split(",") if p.strip()]
  if not patterns:
    raise ValueError("no input given: pass --input GLOB (e.g. --input 'crawl/*.jsonl')")
  files: set[str] = set()
  for pattern in patterns:
    found = [f for f in glob.glob(os.path.expanduser(pattern.strip()), recursive=True) if os.path.isfile(f)]
    if not found:
      raise ValueError(f"input pattern {pattern!r} matches no file; check the path and quote the glob")
    files.update(os.path.abspath(f) for f in found)
  return sorted(files)


def detect_format(path: str) -> str:
  """jsonl | parquet | text | wet from the file name (a trailing .gz ignored)."""
  name = path[:-3] if path.endswith(".gz") else path
  if name.endswith(".wet") or name.endswith(".warc"):
    return "wet"
  ext = os.path.splitext(name)[1].lower()
  if ext in (".jsonl", ".json", ".ndjson"):
    return "jsonl"
  if ext in (".parquet", ".pq"):
    return "parquet"
  if ext in (".txt", ".text", ""):
    return "text"
  raise ValueError(f"cannot tell the format of {path!r} from its extension; set input_format to one of {FORMATS}")


def _open_text(path: str) -> io.TextIOBase:
  if path.endswith(".gz"):
    return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace", newline="\n")
  return open(path, encoding="utf-8", errors="replace", newline="\n")


def _open_binary(path: str):
  return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_jsonl(path: str, id_field: str = "id", text_field: str = "text") -> Iterator[dict]:
  """One JSON object per line; records without an id get `<file name>:<line number>`."""
  base = os.path.basename(path)
  with _open_text(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); JSONL input needs one object per line") from None
      yield _standardise(record, path, f"{base}:{lineno}", id_field, text_field)


def read_parquet(path: str, id_field: str = "id", text_field: str = "text") -> Iterator[dict]:
  """Rows of a Parquet file, read in batches; rows without an id get `<file name>:<row number>`."""
  import pyarrow.parquet as pq
  base = os.path.basename(path)
  row = 0
  for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
    for record in batch.to_pylist():
      yield _standardise(record, path, f"{base}:{row}", id_field, text_field)
      row += 1


def read_text(path: str, mode: str = "blank_line") -> Iterator[dict]:
  """Plain text. `mode`: blank_line (documents separated by blank lines, their lines are paragraphs),
  line (one document per line) or file (the whole file is one document)."""
  base = os.path.basename(path)
  with _open_text(path) as f:
    if mode == "file":
      text = f.read().strip("\n")
      if text.strip():
        yield {"id": f"{base}:0", "text": text}
      return
    if mode not in ("line", "blank_line"):
      raise ValueError(f"text_mode {mode!r} unknown; use blank_line, line or file")
    block: list[str] = []
    n = 0
    for line in f:
      line = line.rstrip("\n")
      if mode == "line":
        if line.strip():
          yield {"id": f"{base}:{n}", "text": line}
          n += 1
      elif line.strip():
        block.append(line)
      elif block:
        yield {"id": f"{base}:{n}", "text": "\n".join(block)}
        n += 1
        block = []
    if block:
      yield {"id": f"{base}:{n}", "text": "\n".join(block)}


def read_wet(path: str) -> Iterator[dict]:
  """Common Crawl WET (WARC of extracted text): one document per `conversion` record, id = WARC-Record-ID,
  with `url` and `date` kept."""
  with _open_binary(path) as f:
    while True:
      line = f.readline()
      if not line:
        return
      if not line.strip():
        continue
      if not line.startswith(b"WARC/"):
        raise ValueError(f"{path}: expected a WARC record header, got {line[:40]!r}; is this a WET file?")
      headers = {}
      for header in iter(f.readline, b""):
        header = header.strip()
        if not header:
          break
        key, _, value = header.decode("utf-8", "replace").partition(":")
        headers[key.strip().lower()] = value.strip()
      length = int(headers.get("content-length", "0"))
      body = f.read(length)
      if headers.get("warc-type") != "conversion":
        continue
      yield {"id": headers.get("warc-record-id", "").strip("<>"), "text": body.decode("utf-8", "replace").strip(),
             "url": headers.get("warc-target-uri", ""), "date": headers.get("warc-date", "")}


def _standardise(record: dict, path: str, default_id: str, id_field: str, text_field: str) -> dict:
  if not isinstance(record, dict):
    raise ValueError(f"{path}: record {default_id} is not an object; JSONL/Parquet input needs objects with a "
                     f"{text_field!r} field")
  if text_field not in record or not isinstance(record[text_field], str):
    raise ValueError(f"{path}: record {default_id} has no string field {text_field!r}; set text_field to the "
                     "field that holds the text")
  out = dict(record)
  text = out.pop(text_field)
  doc_id = out.pop(id_field, None)
  out["id"] = str(doc_id) if doc_id is not None else default_id
  out["text"] = text
  return out


def read_shard(path: str, input_format: str = "auto", text_mode: str = "blank_line", id_field: str = "id",
               text_field: str = "text") -> Iterator[dict]:
  """Documents of one input file in file order (see the module docstring)."""
  fmt = detect_format(path) if input_format == "auto" else input_format
  if fmt == "jsonl":
    return read_jsonl(path, id_field, text_field)
  if fmt == "parquet":
    return read_parquet(path, id_field, text_field)
  if fmt == "text":
    return read_text(path, text_mode)
  if fmt == "wet":
    return read_wet(path)
  raise ValueError(f"input_format {input_format!r} unknown; use auto or one of {FORMATS}")
