"""Document sources and the mixture spec: random-access collections of text documents.

A source is any object with `name`, `__len__` and `__getitem__(i) -> str` (one document; "" for a record that
cannot be used, which the pipeline skips). All sources here are picklable (grain worker processes get copies)
and importing this module has no side effects.

Mixture spec (`config.data.sources`): a string of comma-separated items, or a tuple of such strings. Each item is
`[NAME=]KIND:ARG[@WEIGHT]`:

  builtin                         = prose=builtin:prose@0.9, code=builtin:code@0.1 (no download)
  prose=builtin:prose             Python's pydoc topics + standard-library docstrings (English prose)
  code=builtin:code               Python's standard-library source files
  text:/data/books/*.txt          one document per file (glob; local or etils.epath paths such as gs://...)
  jsonl:/data/web/*.jsonl@0.7     one document per line, text in `config.data.text_field`
  parquet:gs://bucket/x/*.parquet one document per row, text in `config.data.text_field`
  arrayrecord:/data/*.array_record one document per record (UTF-8 text)
  chat:/data/sft/*.jsonl          one conversation per line (data/chat.py: messages or prompt/completion)
  instruct=builtin:instruct       the built-in instruction task (data/instruct.py), generated from a seed

Weights are document sampling weights (normalised to sum to 1); `config.data.weights`, when set, overrides them.
"""
from __future__ import annotations

import ast
import bisect
import collections
import dataclasses
import glob as glob_lib
import json
import logging
import os
import re
import sysconfig
import threading
from typing import Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

KINDS = ("builtin", "text", "jsonl", "parquet", "arrayrecord", "chat")
BUILTIN_DEFAULT = "prose=builtin:prose@0.9,code=builtin:code@0.1"
# Held-out documents are chosen by a fixed permutation, independent of the shuffle seed, so that changing the
# shuffle seed never moves a document between the training and evaluation splits.
_EVAL_SPLIT_SEED = 0x5EED

# Process-local counters of input problems (documents with invalid UTF-8, skipped records). Worker processes keep
# their own; the warnings in the log are the cross-process record.
COUNTERS: collections.Counter = collections.Counter()


class Source(Protocol):
  name: str

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> str: ...


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One parsed mixture item."""
  name: str
  kind: str
  arg: str
  weight: float


class SpecError(ValueError):
  """A mixture spec that cannot be parsed; the message shows the expected form."""


_ITEM_RE = re.compile(r"^(?:(?P<name>[A-Za-z_][\w\-]*)=)?(?P<kind>[a-z]+):(?P<arg>.+?)(?:@(?P<weight>[0-9.eE+\-]+))?$")


def parse_spec(sources: str | Sequence[str], weights: Sequence[float] = ()) -> list[SourceSpec]:
  """Parses `config.data.sources` (+ optional `config.data.weights`) into specs with weights summing to 1."""
  items = [sources] if isinstance(sources, str) else list(sources)
  parts = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
  if not parts:
    raise SpecError("config.data.sources is empty; use 'builtin' or e.g. 'jsonl:/data/*.jsonl@0.9,text:/x/*.txt@0.1'")
  expanded: list[str] = []
  for p in parts:
    expanded.extend(BUILTIN_DEFAULT.split(",") if p == "builtin" else [p])
  specs = []
  for p in expanded:
    m = _ITEM_RE.match(p)
    if not m or m["kind"] not in KINDS:
      raise SpecError(f"cannot parse source {p!r}: expected [NAME=]KIND:PATH[@WEIGHT] with KIND one of "
                      f"{', '.join(KINDS)} (e.g. 'web=jsonl:/data/*.jsonl@0.9')")
    kind, arg = m["kind"], m["arg"]
    if kind == "builtin" and arg not in ("prose", "code", "instruct"):
      raise SpecError(f"unknown built-in source {arg!r} in {p!r}: use builtin:prose, builtin:code or "
                      "builtin:instruct")
    name = m["name"] or (arg if kind == "builtin" else kind)
    weight = float(m["weight"]) if m["weight"] else 1.0
    specs.append(SourceSpec(name, kind, arg, weight))
  if weights:
    if len(weights) != len(specs):
      raise SpecError(f"config.data.weights has {len(weights)} entries but config.data.sources names "
                      f"{len(specs)} sources ({', '.join(s.name for s in specs)}); give one weight per source")
    specs = [dataclasses.replace(s, weight=float(w)) for s, w in zip(specs, weights)]
  names = [s.name for s in specs]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise SpecError(f"source names {dupes} repeat; name them, e.g. 'a=jsonl:/x/*.jsonl,b=jsonl:/y/*.jsonl'")
  bad = [s for s in specs if not s.weight > 0]
  if bad:
    raise SpecError(f"source {bad[0].name!r} has weight {bad[0].weight}; weights must be > 0 (drop the source "
                    "instead)")
  total = sum(s.weight for s in specs)
  return [dataclasses.replace(s, weight=s.weight / total) for s in specs]


def expand_glob(pattern: str) -> list[str]:
  """Sorted paths matching `pattern` (local or an etils.epath URL such as gs://b/d/*.jsonl); fails if none."""
  if "://" in pattern:
    from etils import epath  # lazy: only remote paths need it
    head, rest = _split_glob(pattern)
    paths = sorted(str(p) for p in epath.Path(head).glob(rest)) if rest else (
        [pattern] if epath.Path(pattern).exists() else [])
  else:
    paths = sorted(p for p in glob_lib.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
  if not paths:
    raise FileNotFoundError(f"data source pattern {pattern!r} matches no files; check the path in "
                            "config.data.sources")
  return paths


def _split_glob(pattern: str) -> tuple[str, str]:
  """'gs://b/d/*/x.jsonl' -> ('gs://b/d', '*/x.jsonl'): the literal directory prefix and the glob remainder."""
  parts = pattern.split("/")
  for i, part in enumerate(parts):
    if any(c in part for c in "*?["):
      return "/".join(parts[:i]), "/".join(parts[i:])
  return pattern, ""


def _open(path: str, mode: str = "rb"):
  if "://" in path:
    from etils import epath
    return epath.Path(path).open(mode)
  return open(path, mode)


def decode_utf8(data: bytes, where: str) -> str:
  """UTF-8 text with invalid bytes replaced by U+FFFD; counts and logs (once per `where`) the replacement."""
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    text = data.decode("utf-8", errors="replace")
    n = text.count("\ufffd") - data.count("\ufffd".encode())
    COUNTERS["invalid_utf8_documents"] += 1
    COUNTERS["invalid_utf8_sequences"] += n
    warn_once(f"utf8:{where}", f"{where}: {n} invalid UTF-8 sequence(s) replaced by U+FFFD")
    return text


_WARNED: set[str] = set()
_AST_LOCK = threading.Lock()


def warn_once(key: str, message: str) -> None:
  """Logs `message` once per `key` in this process."""
  if key not in _WARNED:
    _WARNED.add(key)
    log.warning(message)


class TextFiles:
  """One document per file."""

  def __init__(self, name: str, pattern: str):
    self.name = name
    self.paths = expand_glob(pattern)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> str:
    with _open(self.paths[index]) as f:
      return decode_utf8(f.read(), self.paths[index])


class JsonlFiles:
  """One document per non-blank line; the text is `record[field]`.

  Indexing reads every file once to find line offsets (no parsing). An unparseable line is skipped with a warning
  naming file:line (or raises in strict mode); records without `field` are reported once per file with the keys
  they do have.
  """

  def __init__(self, name: str, pattern: str, field: str = "text", strict: bool = False):
    self.name, self.field, self.strict = name, field, strict
    self.paths = expand_glob(pattern)
    offsets, lines, counts = [], [], []
    for path in self.paths:
      data = _read_all(path)
      starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + 1])
      ends = np.append(starts[1:], len(data))
      keep = [i for i, (s, e) in enumerate(zip(starts, ends)) if data[s:e].strip()]
      offsets.append(starts[keep].astype(np.int64))
      lines.append(np.asarray(keep, np.int64) + 1)
      counts.append(len(keep))
    self._offsets, self._lines = offsets, lines
    self._cum = np.cumsum([0] + counts).tolist()
    self._files: dict[int, object] = {}

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_files"] = {}  # open file handles stay in their process
    return state

  def __len__(self) -> int:
    return self._cum[-1]

  def __getitem__(self, index: int) -> str:
    f_idx = bisect.bisect_right(self._cum, index) - 1
    row = index - self._cum[f_idx]
    f = self._files.get(f_idx)
    if f is None:
      f = self._files[f_idx] = _open(self.paths[f_idx])
    f.seek(int(self._offsets[f_idx][row]))
    raw = f.readline()
    where = f"{self.paths[f_idx]}:{int(self._lines[f_idx][row])}"
    try:
      record = json.loads(decode_utf8(raw, where))
    except json.JSONDecodeError as e:
      if self.strict:
        raise ValueError(f"{where}: unparseable JSON ({e}); fix the line or set config.data.strict=False to skip "
                         "it") from None
      COUNTERS["unparseable_records"] += 1
      warn_once(f"json:{where}", f"{where}: unparseable JSON line skipped ({e})")
      return ""
    return _field(record, self.field, self.strict, self.paths[f_idx], where)


def _field(record, field: str, strict: bool, file_key: str, where: str) -> str:
  """record[field] as text, or "" (reported once per file) when the record has no such string field; with
  field "" the whole record as JSON text (chat sources)."""
  if field == "":
    return json.dumps(record)
  value = record.get(field) if isinstance(record, dict) else None
  if isinstance(value, str):
    return value
  keys = sorted(record) if isinstance(record, dict) else type(record).__name__
  message = (f"{where}: record has no text field {field!r} (it has {keys}); set config.data.text_field to the "
             "field holding the text")
  if strict:
    raise ValueError(message)
  COUNTERS["records_without_text"] += 1
  warn_once(f"field:{file_key}", message + " -- such records are skipped")
  return ""


def _read_all(path: str) -> bytes:
  with _open(path) as f:
    return f.read()


class ParquetFiles:
  """One document per row; the text is column `field`. Reads one row group at a time (cached)."""

  def __init__(self, name: str, pattern: str, field: str = "text"):
    import pyarrow.parquet as pq  # lazy: heavy import
    self.name, self.field = name, field
    self.paths = expand_glob(pattern)
    self._groups: list[tuple[int, int]] = []  # (file index, row group) per group, in order
    counts = []
    for f_idx, path in enumerate(self.paths):
      with _open(path) as f:
        meta = pq.ParquetFile(f).metadata
        columns = meta.schema.names
        if field not in columns:
          raise ValueError(f"{path}: Parquet file has no column {field!r} (it has {columns}); set "
                           "config.data.text_field to the column holding the text")
        for g in range(meta.num_row_groups):
          self._groups.append((f_idx, g))
          counts.append(meta.row_group(g).num_rows)
    self._cum = np.cumsum([0] + counts).tolist()
    self._cache: tuple[int, list] | None = None

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_cache"] = None
    return state

  def __len__(self) -> int:
    return self._cum[-1]

  def __getitem__(self, index: int) -> str:
    import pyarrow.parquet as pq
    g = bisect.bisect_right(self._cum, index) - 1
    if self._cache is None or self._cache[0] != g:
      f_idx, group = self._groups[g]
      with _open(self.paths[f_idx]) as f:
        column = pq.ParquetFile(f).read_row_group(group, columns=[self.field]).column(0)
      self._cache = (g, column.to_pylist())
    value = self._cache[1][index - self._cum[g]]
    if isinstance(value, bytes):
      value = decode_utf8(value, self.paths[self._groups[g][0]])
    return value if isinstance(value, str) else ""


class ArrayRecordFiles:
  """One document per record; records hold UTF-8 text."""

  def __init__(self, name: str, pattern: str):
    from grain import sources as grain_sources  # lazy: array_record import
    self.name = name
    self.paths = expand_glob(pattern)
    self._source = grain_sources.ArrayRecordDataSource(self.paths)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> str:
    return decode_utf8(self._source[index], f"{self.name}[{index}]")


def stdlib_files() -> list[str]:
  """Sorted standard-library .py files, excluding tests and installed packages (about 12 MB on CPython 3.11)."""
  root = sysconfig.get_paths()["stdlib"]
  skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  return out


class Builtin:
  """The corpus every Python installation has: `prose` (pydoc topics, then one document of docstrings per
  standard-library module) or `code` (one document per standard-library source file). Documents are produced on
  access, so construction costs only a directory walk."""

  def __init__(self, name: str, kind: str):
    if kind not in ("prose", "code"):
      raise ValueError(f"built-in source kind must be 'prose' or 'code', got {kind!r}")
    self.name, self.kind = name, kind
    self.files = stdlib_files()
    self.topics: list[str] = []
    self._prose_cache: dict[int, str] = {}
    if kind == "prose":
      try:
        from pydoc_data import topics as pydoc_topics
        self.topics = [pydoc_topics.topics[k] for k in sorted(pydoc_topics.topics)]
      except ImportError:  # some distributions strip pydoc_data; docstrings remain
        pass

  def __len__(self) -> int:
    return len(self.topics) + len(self.files)

  def __getitem__(self, index: int) -> str:
    if index < len(self.topics):
      return self.topics[index]
    path = self.files[index - len(self.topics)]
    if self.kind == "prose" and index in self._prose_cache:
      return self._prose_cache[index]
    with open(path, "rb") as f:
      source = decode_utf8(f.read(), path)
    if self.kind == "code":
      return source
    # Parsing a module costs ~4 ms; all prose is ~2.5 MB, so keep it once parsed.
    text = self._prose_cache[index] = module_docstrings(source, path)
    return text

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_prose_cache"] = {}
    return state


def module_docstrings(source: str, path: str) -> str:
  """All docstrings of a module as one prose document: each under the dotted name it documents."""
  try:
    with _AST_LOCK:  # CPython 3.11.7's ast.parse is not thread-safe (gh-106905: "recursion depth mismatch")
      tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return ""
  module = os.path.splitext(os.path.basename(path))[0]
  parts = []

  def visit(node, prefix):
    doc = ast.get_docstring(node, clean=True)
    if doc:
      parts.append(f"{prefix}\n\n{doc}")
    for child in getattr(node, "body", []):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        visit(child, f"{prefix}.{child.name}")

  visit(tree, module)
  return "\n\n".join(parts)


def open_source(spec: SourceSpec, text_field: str = "text", strict: bool = False) -> Source:
  """The Source object for one parsed spec item."""
  if spec.kind == "builtin" and spec.arg == "instruct":
    from data import instruct  # pylint: disable=g-import-not-at-top
    return instruct.InstructTask(spec.name)
  if spec.kind == "builtin":
    return Builtin(spec.name, spec.arg)
  if spec.kind == "chat":
    return JsonlFiles(spec.name, spec.arg, "", strict)
  if spec.kind == "text":
    return TextFiles(spec.name, spec.arg)
  if spec.kind == "jsonl":
    return JsonlFiles(spec.name, spec.arg, text_field, strict)
  if spec.kind == "parquet":
    return ParquetFiles(spec.name, spec.arg, text_field)
  if spec.kind == "arrayrecord":
    return ArrayRecordFiles(spec.name, spec.arg)
  raise SpecError(f"unknown source kind {spec.kind!r}; use one of {', '.join(KINDS)}")


def open_sources(data_config) -> tuple[list[SourceSpec], list[Source]]:
  """(specs, sources) for `config.data`."""
  specs = parse_spec(data_config.sources, tuple(data_config.weights))
  return specs, [open_source(s, data_config.text_field, data_config.strict) for s in specs]


def source_split(src: Source, eval_fraction: float, split: str) -> np.ndarray:
  """A source's `split` indices: its own `split_indices(split)` if it defines one (a generated task keeps
  duplicates on one side), else `split_indices(len(src), eval_fraction, split)`."""
  own = getattr(src, "split_indices", None)
  return own(split) if own is not None else split_indices(len(src), eval_fraction, split)


def split_indices(num_docs: int, eval_fraction: float, split: str) -> np.ndarray:
  """Sorted document indices of `split` ("train" | "eval"): a fixed random eval_fraction is held out.

  At least one document is held out when eval_fraction > 0 and the source has two or more documents.
  """
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if not 0 <= eval_fraction < 1:
    raise ValueError(f"config.data.eval_fraction must be in [0, 1), got {eval_fraction}")
  n_eval = 0 if eval_fraction == 0 or num_docs < 2 else min(num_docs - 1, max(1, round(num_docs * eval_fraction)))
  perm = np.random.default_rng(_EVAL_SPLIT_SEED).permutation(num_docs)
  chosen = perm[:n_eval] if split == "eval" else perm[n_eval:]
  return np.sort(chosen).astype(np.int64)
