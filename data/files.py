"""Reading input files: the one layer under the training sources (`data/sources.py`) and curation (`data/curate/`).

Paths are local globs (`**` works) or etils.epath URLs (`gs://bucket/dir/*.jsonl`); a file ending in `.gz` is
decompressed on the fly. One set of rules for bad input, wherever it is read:

- a pattern that matches no file: FileNotFoundError naming the pattern and the config key;
- invalid UTF-8: replaced by U+FFFD, counted, and warned once per file with the count;
- an unparseable JSON line, or a record whose text field is missing or not a string: skipped, counted, and warned
  once per file (naming the first one's location and what it holds); with `strict` a ValueError instead;
- a Parquet file without the text column: ValueError listing its columns;
- a WARC/WET record without a header line or length, one cut short by the end of the file, or a .gz stream that
  breaks off: skipped, counted with its offset, warned once per file (the records before it are read).

Counts go to `COUNTERS` (process-local) and, for streamed files, to the `Problems` object the caller passes.
"""
from __future__ import annotations

import collections
import glob as glob_lib
import gzip
import io
import json
import logging
import os
import zlib
from typing import Iterator, Sequence

log = logging.getLogger(__name__)

# Formats of `read_documents` (streamed, one file after the other).
FORMATS = ("jsonl", "parquet", "text", "wet", "warc")
TEXT_MODES = ("blank_line", "line", "file")
_REPLACEMENT = "\ufffd".encode()

# Process-local counts of input problems: invalid_utf8_documents, invalid_utf8_sequences, unparseable_records,
# records_without_text. Worker processes keep their own; the warnings in the log are the cross-process record.
COUNTERS: collections.Counter = collections.Counter()
_WARNED: set = set()


def warn_once(key, message: str) -> None:
  """Logs `message` the first time `key` is seen in this process."""
  if key not in _WARNED:
    _WARNED.add(key)
    log.warning(message)


def _split_glob(pattern: str) -> tuple[str, str]:
  """'gs://b/d/*/x.jsonl' -> ('gs://b/d', '*/x.jsonl'): the literal directory prefix and the glob remainder."""
  parts = pattern.split("/")
  for i, part in enumerate(parts):
    if any(c in part for c in "*?["):
      return "/".join(parts[:i]), "/".join(parts[i:])
  return pattern, ""


def expand(patterns: str | Sequence[str], key: str) -> list[str]:
  """Sorted, de-duplicated files matching a glob, a comma-separated string of globs, or a sequence of globs
  (local, or etils.epath URLs such as gs://b/d/*.jsonl). `key` names the setting in errors.

  Raises FileNotFoundError naming the pattern when one matches nothing (almost always a typo)."""
  if isinstance(patterns, str):
    patterns = patterns.split(",")
  found: set[str] = set()
  for pattern in (p.strip() for p in patterns):
    if not pattern:
      continue
    if "://" in pattern:
      from etils import epath  # lazy: only remote paths need it
      head, rest = _split_glob(pattern)
      paths = [str(p) for p in epath.Path(head).glob(rest)] if rest else (
          [pattern] if epath.Path(pattern).exists() else [])
    else:
      paths = [os.path.abspath(p) for p in glob_lib.glob(os.path.expanduser(pattern), recursive=True)
               if os.path.isfile(p)]
    if not paths:
      raise FileNotFoundError(f"{key}: pattern {pattern!r} matches no file; check the path (and quote the glob "
                              "so the shell leaves it alone)")
    found.update(paths)
  return sorted(found)


def open_binary(path: str):
  """A binary file object for a local path or an etils.epath URL; `.gz` files decompressed."""
  if "://" in path:
    from etils import epath
    raw = epath.Path(path).open("rb")
  else:
    raw = open(path, "rb")
  return gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw


def atomic_write(path: str, data: bytes | str) -> None:
  """Writes `data` (str as UTF-8) to a local `path` through a temporary file and a rename, creating its directory:
  a reader sees the old file or the whole new one, never a partial one."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data.encode("utf-8") if isinstance(data, str) else data)
  os.replace(tmp, path)


def read_bytes(path: str) -> bytes:
  """The whole (decompressed) content of a file."""
  with open_binary(path) as f:
    return f.read()


def size(path: str) -> int:
  """Size in bytes of the file as stored (compressed size for .gz)."""
  if "://" in path:
    from etils import epath
    return epath.Path(path).stat().length
  return os.path.getsize(path)


def detect_format(path: str, key: str = "input_format") -> str:
  """jsonl | parquet | text | wet | warc from the file name (a trailing .gz ignored); `key` is the setting that overrides
  it, named in the error."""
  name = path[:-3] if path.endswith(".gz") else path
  if name.endswith(".wet"):
    return "wet"
  if name.endswith(".warc"):
    return "warc"
  ext = os.path.splitext(name)[1].lower()
  if ext in (".jsonl", ".json", ".ndjson"):
    return "jsonl"
  if ext in (".parquet", ".pq"):
    return "parquet"
  if ext in (".txt", ".text", ".md", ""):
    return "text"
  raise ValueError(f"cannot tell the format of {path!r} from its extension; set {key} to one of {', '.join(FORMATS)}")


def decode_utf8(data: bytes, path: str, warn: bool = True) -> str:
  """UTF-8 text with invalid bytes replaced by U+FFFD, counted in COUNTERS; warned once per file (`path`)."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("utf-8", errors="replace")
    n = text.count("\ufffd") - data.count(_REPLACEMENT)
    COUNTERS["invalid_utf8_documents"] += 1
    COUNTERS["invalid_utf8_sequences"] += n
    if warn:
      warn_once(("utf8", path), f"{path}: {n} invalid UTF-8 sequence(s) replaced by U+FFFD (later ones in this "
                f"file are replaced and counted without a warning)")
    return text


def invalid_utf8_lines(data: bytes) -> tuple[int, int]:
  """(lines holding invalid UTF-8, invalid sequences in them) of a whole file's bytes; (0, 0) when valid."""
  try:
    data.decode("utf-8")
    return 0, 0
  except UnicodeDecodeError:
    pass
  lines = sequences = 0
  for line in data.split(b"\n"):
    try:
      line.decode("utf-8")
    except UnicodeDecodeError:
      lines += 1
      sequences += line.decode("utf-8", errors="replace").count("\ufffd") - line.count(_REPLACEMENT)
  return lines, sequences


def parse_json(line: str, where: str) -> tuple[object, str]:
  """(the parsed value, "") or (None, why it is not JSON, naming `where`)."""
  try:
    return json.loads(line), ""
  except json.JSONDecodeError as e:
    return None, f"{where}: unparseable JSON ({e})"


def record_text(record, field: str, where: str) -> tuple[str | None, str]:
  """(record[field], "") when it is a string, else (None, what is wrong, naming `where`)."""
  if not isinstance(record, dict):
    return None, f"{where}: record is a JSON {type(record).__name__}, not an object with a text field {field!r}"
  if field not in record:
    return None, f"{where}: record has no text field {field!r} (it has {sorted(record)})"
  value = record[field]
  if not isinstance(value, str):
    return None, f"{where}: text field {field!r} is not a string (it is {type(value).__name__} {str(value)[:40]})"
  return value, ""


class Problems:
  """Counts of skipped or repaired records of streamed files, per kind (JSON-serialisable via `to_dict`)."""

  def __init__(self):
    self.counts: collections.Counter = collections.Counter()

  def to_dict(self) -> dict:
    return dict(sorted(self.counts.items()))


class _FileTally:
  """One streamed file's problems: counted, the first of each kind kept for the one warning at the end."""

  def __init__(self, path: str, strict: bool, hint: str):
    self.path, self.strict, self.hint = path, strict, hint
    self.counts: collections.Counter = collections.Counter()
    self.first: dict[str, str] = {}

  def skip(self, kind: str, message: str) -> None:
    if self.strict:
      raise ValueError(f"{message}; {self.hint}")
    self.counts[kind] += 1
    self.first.setdefault(kind, message)

  def decode(self, data: bytes) -> str:
    try:
      return data.decode("utf-8")
    except UnicodeDecodeError:
      text = data.decode("utf-8", errors="replace")
      self.counts["invalid_utf8_documents"] += 1
      self.counts["invalid_utf8_sequences"] += text.count("\ufffd") - data.count(_REPLACEMENT)
      return text

  def close(self, problems: Problems | None, report: bool) -> None:
    COUNTERS.update(self.counts)
    if problems is not None:
      problems.counts.update(self.counts)
    if not report or not self.counts:
      return
    parts = []
    if self.counts["invalid_utf8_documents"]:
      parts.append(f"{self.counts['invalid_utf8_documents']} record(s) with invalid UTF-8 "
                   f"({self.counts['invalid_utf8_sequences']} sequences replaced by U+FFFD)")
    for kind, label in (("unparseable_records", "unparseable record(s)"),
                        ("records_without_text", "record(s) without a string text field"),
                        ("bad_warc_records", "malformed WARC record(s)"),
                        ("truncated_warc_records", "truncated WARC record(s)"),
                        ("truncated_archives", "truncated compressed stream(s)")):
      if self.counts[kind]:
        parts.append(f"{self.counts[kind]} {label} skipped (first: {self.first[kind]})")
    log.warning("%s: %s", self.path, "; ".join(parts))


def read_documents(path: str, fmt: str = "auto", *, text_mode: str = "blank_line", id_field: str = "id",
                   text_field: str = "text", strict: bool = False, problems: Problems | None = None,
                   report: bool = True, format_key: str = "input_format",
                   field_key: str = "text_field") -> Iterator[dict]:
  """The documents of one file, streamed in file order: dicts with `id` (str) and `text` (str).

  jsonl: a line (other fields kept; `id` from `id_field`, else `file:line`); parquet: a row (likewise,
  `file:row`); text: a block separated by blank lines, a line, or the whole file (`text_mode`), `file:n`;
  wet / warc: a Common Crawl WET `conversion` record, or a WARC `response` record of an HTML page (its main text
  extracted; needs the curation extras), with `url`, `date`, `content_type` (`id` = WARC-Record-ID); bad,
  truncated records and a truncated .gz are counted with their offsets and skipped. Bad records follow the
  module's rules; one warning per file at its end when `report`, counts added to `problems`. `format_key` and
  `field_key` name the settings in errors."""
  fmt = detect_format(path, format_key) if fmt == "auto" else fmt
  if fmt not in FORMATS:
    raise ValueError(f"{format_key}={fmt!r} is not one of auto, {', '.join(FORMATS)}")
  tally = _FileTally(path, strict, f"set {field_key} to the field holding the text, or fix the file")
  readers = {"jsonl": _read_jsonl, "parquet": _read_parquet, "text": _read_text, "wet": _read_warc,
             "warc": _read_warc}
  yield from readers[fmt](path, tally, text_mode=text_mode, id_field=id_field, text_field=text_field)
  tally.close(problems, report)


def _document(record: dict, text: str, default_id: str, id_field: str, text_field: str) -> dict:
  out = dict(record)
  del out[text_field]
  doc_id = out.pop(id_field, None)
  out["id"] = str(doc_id) if doc_id is not None else default_id
  out["text"] = text
  return out


def _read_jsonl(path: str, tally: _FileTally, *, id_field: str, text_field: str, **_) -> Iterator[dict]:
  base = os.path.basename(path)
  with open_binary(path) as f:
    for lineno, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      where = f"{path}:{lineno}"
      record, error = parse_json(tally.decode(raw), where)
      if error:
        tally.skip("unparseable_records", error)
        continue
      text, error = record_text(record, text_field, where)
      if error:
        tally.skip("records_without_text", error)
        continue
      yield _document(record, text, f"{base}:{lineno}", id_field, text_field)


def _read_parquet(path: str, tally: _FileTally, *, id_field: str, text_field: str, **_) -> Iterator[dict]:
  import pyarrow.parquet as pq  # lazy: heavy import
  base = os.path.basename(path)
  with open_binary(path) as f:
    parquet = pq.ParquetFile(f)
    check_parquet_column(parquet.schema_arrow.names, path, text_field, tally.hint)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
      for record in batch.to_pylist():
        value = record[text_field]
        if isinstance(value, bytes):
          value = record[text_field] = tally.decode(value)
        text, error = record_text(record, text_field, f"{path}: row {row}")
        if error:
          tally.skip("records_without_text", error)
        else:
          yield _document(record, text, f"{base}:{row}", id_field, text_field)
        row += 1


def check_parquet_column(columns: list[str], path: str, field: str, hint: str) -> None:
  """ValueError listing the columns when a Parquet file has no column `field`."""
  if field not in columns:
    raise ValueError(f"{path}: Parquet file has no column {field!r} (it has {columns}); {hint}")


def _read_text(path: str, tally: _FileTally, *, text_mode: str, **_) -> Iterator[dict]:
  if text_mode not in TEXT_MODES:
    raise ValueError(f"text_mode={text_mode!r} is not one of {', '.join(TEXT_MODES)}")
  base = os.path.basename(path)
  with open_binary(path) as f:
    if text_mode == "file":
      text = tally.decode(f.read()).replace("\r\n", "\n").strip("\n")
      if text.strip():
        yield {"id": f"{base}:0", "text": text}
      return
    block: list[str] = []
    n = 0
    for raw in f:
      line = tally.decode(raw).rstrip("\r\n")
      if text_mode == "line":
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


def _read_warc(path: str, tally: _FileTally, **_) -> Iterator[dict]:
  """WET `conversion` records (text as stored) and WARC `response` records of HTML pages with status 200 (the main
  text extracted by resiliparse), with `url`, `date` and `content_type`; other record types pass silently."""
  for offset, headers, head, body in _warc_records(path, tally):
    kind = headers.get("warc-type")
    if kind == "conversion":
      text, content_type = tally.decode(body).strip(), headers.get("content-type", "text/plain")
    elif kind == "response":
      text, content_type = _html_response_text(head + body, path, offset, tally)
    else:
      continue
    if text:
      yield {"id": headers.get("warc-record-id", "").strip("<>") or f"{os.path.basename(path)}@{offset}",
             "text": text, "url": headers.get("warc-target-uri", ""), "date": headers.get("warc-date", ""),
             "content_type": content_type}


def _warc_records(path: str, tally: _FileTally) -> Iterator[tuple[int, dict, bytes, bytes]]:
  """(offset, headers lower-cased, the header block's bytes, the body) per well-formed record. A record without a WARC header line or a numeric Content-Length is counted and skipped to the
  next `WARC/` line; a record cut short by the end of the file, or a compressed stream that breaks off, is counted
  with its offset (in the decompressed content) and ends the file."""
  with open_binary(path) as f:
    f = f if isinstance(f, io.BufferedIOBase) else io.BufferedReader(f)
    offset, pending = 0, None
    try:
      while True:
        offset = f.tell() - (len(pending) if pending else 0)
        line, pending = pending or f.readline(), None
        if not line:
          return
        if not line.strip():
          continue
        if not line.startswith(b"WARC/"):
          tally.skip("bad_warc_records", f"{path}: byte {offset}: no WARC/ header line (got {line[:40]!r})")
          pending = _next_warc_line(f)
          continue
        head = [line]
        for header in iter(f.readline, b""):
          head.append(header)
          if not header.strip():
            break
        headers = _warc_headers(head)
        length = headers.get("content-length", "")
        if not length.isdigit():
          tally.skip("bad_warc_records", f"{path}: record at byte {offset}: Content-Length {length!r}")
          pending = _next_warc_line(f)
          continue
        body = f.read(int(length))
        if len(body) < int(length):
          tally.skip("truncated_warc_records", f"{path}: record at byte {offset} declares {length} bytes but the "
                     f"file ends after {len(body)}")
          return
        yield offset, headers, b"".join(head), body
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
      tally.skip("truncated_archives", f"{path}: the compressed stream breaks off in the record at byte {offset} of "
                 f"its content ({e}); the records before it were read")


def _warc_headers(lines: list[bytes]) -> dict:
  out = {}
  for raw in lines[1:]:
    key, sep, value = raw.decode("utf-8", "replace").partition(":")
    if sep:
      out[key.strip().lower()] = value.strip()
  return out


def _next_warc_line(f) -> bytes:
  """Reads up to the next line starting a WARC record and returns it (b"" at the end of the file)."""
  for line in iter(f.readline, b""):
    if line.startswith(b"WARC/"):
      return line
  return b""


_HTML_TYPES = ("text/html", "application/xhtml+xml")


def _html_response_text(raw: bytes, path: str, offset: int, tally: _FileTally) -> tuple[str, str]:
  """(main text, content type) of an HTML response record with status 200, ("", type) for any other response. The
  HTTP message is parsed by warcio (chunked transfer and gzip/deflate/brotli content encodings undone), the page
  decoded with its declared or detected charset and its main content extracted by resiliparse."""
  from resiliparse.extract import html2text  # lazy: the curation extras
  from resiliparse.parse import encoding as resiliparse_encoding
  from warcio.archiveiterator import ArchiveIterator
  try:
    record = next(iter(ArchiveIterator(io.BytesIO(raw + b"\r\n\r\n"))))
    http = record.http_headers
    content_type = (http.get_header("Content-Type") or "") if http else ""
    if http is None or http.get_statuscode() != "200" or content_type.split(";")[0].strip().lower() not in _HTML_TYPES:
      return "", content_type
    payload = record.content_stream().read()
  except Exception as e:  # pylint: disable=broad-except  # any malformed HTTP message: counted, never a crash
    tally.skip("bad_warc_records", f"{path}: response record at byte {offset}: unreadable HTTP message ({e})")
    return "", ""
  declared = content_type.lower().partition("charset=")[2].split(";")[0].strip(" \"'")
  html = resiliparse_encoding.bytes_to_str(payload, declared or resiliparse_encoding.detect_encoding(payload))
  return html2text.extract_plain_text(html, main_content=True).strip(), content_type.split(";")[0].strip()
