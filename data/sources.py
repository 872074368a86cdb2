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
  jsonl:/data/web/*.jsonl@0.7     one document per line, text in `config.data.text_field` (.gz read too)
  parquet:gs://bucket/x/*.parquet one document per row, text in `config.data.text_field`
  arrayrecord:/data/*.array_record one document per record (UTF-8 text)
  chat:/data/sft/*.jsonl          one conversation per line (data/chat.py: messages or prompt/completion)
  instruct=builtin:instruct       the built-in instruction task (data/instruct.py), generated from a seed
  tasks=builtin:tasks             the built-in RL tasks' conversations, answers tagged (data/tasks.py; cold start)
  builtin:arithmetic              one family of them (also builtin:number_sorting, builtin:countdown,
                                  builtin:calculator), the families rl.prompts names the same way
  preference:/data/pairs/*.jsonl  one preference pair per line (data/preference.py: prompt, chosen, rejected)
  pairs=builtin:preference        the built-in preference task (data/preference.py), generated from a seed
  tokens:/cache/dir               a tokenized cache (python -m data.pretokenize): every source it holds, with its
                                  names and weights; web=tokens:/cache/dir/web@0.7 one of them. Documents are
                                  token ids (int32 arrays), read without tokenizing again

Weights are document sampling weights (normalised to sum to 1); `config.data.weights`, when set, overrides them.
Files are opened, decompressed and decoded by `data.files`, with its rules for bad input (the same as curation's).
"""
from __future__ import annotations

import ast
import bisect
import dataclasses
import io
import json
import logging
import os
import re
import sysconfig
import threading
from typing import Protocol, Sequence

import numpy as np

from data import files
from data import tasks

log = logging.getLogger(__name__)

KINDS = ("builtin", "text", "jsonl", "parquet", "arrayrecord", "chat", "preference", "tokens")
# A tokenized cache (data/pretokenize.py): the whole cache's manifest, and each source's index in DIR/NAME/.
TOKEN_MANIFEST, TOKEN_SOURCE = "manifest.json", "source.json"
BUILTIN_DEFAULT = "prose=builtin:prose@0.9,code=builtin:code@0.1"
# Held-out documents are chosen by a fixed permutation, independent of the shuffle seed, so that changing the
# shuffle seed never moves a document between the training and evaluation splits.
_EVAL_SPLIT_SEED = 0x5EED

# Process-local counters of input problems (documents with invalid UTF-8, skipped records), kept by `data.files`.
COUNTERS = files.COUNTERS
_AST_LOCK = threading.Lock()


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


def is_chat_source(spec: SourceSpec) -> bool:
  """Whether a parsed mixture item holds conversations (chat:PATH, builtin:instruct, builtin:tasks or one of its
  families; data/chat.py)."""
  return spec.kind == "chat" or (spec.kind == "builtin" and spec.arg in _CHAT_BUILTINS)


def is_preference_source(spec: SourceSpec) -> bool:
  """Whether a parsed mixture item holds preference pairs (preference:PATH or builtin:preference;
  data/preference.py)."""
  return spec.kind == "preference" or (spec.kind == "builtin" and spec.arg == "preference")


# builtin:tasks and each of its families (data/tasks.py) are chat sources as builtin:instruct is.
_CHAT_BUILTINS = ("instruct", "tasks", *tasks.FAMILIES)
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
    if kind == "builtin" and arg not in ("prose", "code", "preference", *_CHAT_BUILTINS):
      raise SpecError(f"unknown built-in source {arg!r} in {p!r}: use builtin:prose, builtin:code, "
                      "builtin:instruct, builtin:tasks (or one of its families: "
                      f"{', '.join('builtin:' + f for f in tasks.FAMILIES)}) or builtin:preference")
    name = m["name"] or (arg if kind == "builtin" else kind)
    weight = float(m["weight"]) if m["weight"] else 1.0
    if kind == "tokens":
      specs.extend(_token_specs(m["name"], arg, weight, p))
      continue
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


def _read_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def _token_specs(name: str | None, directory: str, weight: float, item: str) -> list[SourceSpec]:
  """A `tokens:DIR` item: one spec per source of the cache at DIR (its names; its weights times `weight`), or the
  one source at DIR when DIR is a source's directory inside a cache."""
  directory = directory.rstrip("/")
  if os.path.exists(os.path.join(directory, TOKEN_SOURCE)):
    index = _read_json(os.path.join(directory, TOKEN_SOURCE))
    return [SourceSpec(name or index["name"], "tokens", directory, weight)]
  manifest_path = os.path.join(directory, TOKEN_MANIFEST)
  if not os.path.exists(manifest_path):
    hint = (" (its settings.json shows an unfinished cache: run python -m data.pretokenize again to finish it)"
            if os.path.exists(os.path.join(directory, "settings.json")) else "")
    raise SpecError(f"{item!r}: no tokenized cache at {directory} (no {TOKEN_MANIFEST}){hint}; make one with "
                    f"python -m data.pretokenize --sources SPEC --tokenizer tok.model --output {directory}")
  entries = _read_json(manifest_path)["sources"]
  if name and len(entries) > 1:
    raise SpecError(f"{item!r}: the cache holds {len(entries)} sources ({', '.join(e['name'] for e in entries)}), "
                    f"so one name cannot label them; name them one by one, e.g. "
                    f"'{name}=tokens:{directory}/{entries[0]['name']}'")
  total = sum(e["weight"] for e in entries)
  return [SourceSpec(name or e["name"], "tokens", os.path.join(directory, e["name"]), weight * e["weight"] / total)
          for e in entries]


def expand_glob(pattern: str) -> list[str]:
  """Sorted paths matching `pattern` (local or an etils.epath URL such as gs://b/d/*.jsonl); fails if none."""
  return files.expand([pattern], "config.data.sources")


class TextFiles:
  """One document per file (`.gz` decompressed)."""

  def __init__(self, name: str, pattern: str):
    self.name = name
    self.paths = expand_glob(pattern)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> str:
    return files.decode_utf8(files.read_bytes(self.paths[index]), self.paths[index])


class JsonlFiles:
  """One document per non-blank line; the text is `record[field]`.

  Indexing reads every file once to find line offsets (no parsing) and to count the lines with invalid UTF-8
  (one warning per file with the count). An unparseable line, or a record whose `field` is missing or not a
  string, is skipped with one warning per file naming the first (or raises in strict mode). A `.gz` file is held
  decompressed in memory (random access into a gzip stream would re-read it from the start).
  """

  def __init__(self, name: str, pattern: str, field: str = "text", strict: bool = False):
    self.name, self.field, self.strict = name, field, strict
    self.paths = expand_glob(pattern)
    offsets, lines, counts = [], [], []
    for path in self.paths:
      data = files.read_bytes(path)
      bad_lines, sequences = files.invalid_utf8_lines(data)
      if bad_lines:
        files.warn_once(("utf8", path), f"{path}: {bad_lines} line(s) hold invalid UTF-8 ({sequences} sequences), "
                        "read with U+FFFD in their place")
      starts = np.concatenate([[0], np.flatnonzero(np.frombuffer(data, np.uint8) == 10) + 1])
      ends = np.append(starts[1:], len(data))
      keep = [i for i, (s, e) in enumerate(zip(starts, ends)) if data[s:e].strip()]
      offsets.append(starts[keep].astype(np.int64))
      lines.append(np.asarray(keep, np.int64) + 1)
      counts.append(len(keep))
    self._offsets, self._lines = offsets, lines
    self._cum = np.cumsum([0] + counts).tolist()
    self._counted: set[int] = set()  # indices of skipped records already counted (a record read again is not)
    self._files: dict[int, object] = {}

  def __getstate__(self):
    state = dict(self.__dict__)
    state["_files"] = {}  # open file handles (and decompressed .gz files) stay in their process
    return state

  def __len__(self) -> int:
    return self._cum[-1]

  def _file(self, f_idx: int):
    f = self._files.get(f_idx)
    if f is None:
      path = self.paths[f_idx]
      f = self._files[f_idx] = (io.BytesIO(files.read_bytes(path)) if path.endswith(".gz")
                                else files.open_binary(path))
    return f

  def __getitem__(self, index: int) -> str:
    f_idx = bisect.bisect_right(self._cum, index) - 1
    row = index - self._cum[f_idx]
    f = self._file(f_idx)
    f.seek(int(self._offsets[f_idx][row]))
    raw = f.readline()
    path = self.paths[f_idx]
    where = f"{path}:{int(self._lines[f_idx][row])}"
    record, error = files.parse_json(files.decode_utf8(raw, path, warn=False), where)
    if error:
      return self._skip("unparseable_records", path, error, index)
    if self.field == "":  # chat / preference sources: the whole record, rendered later (data/chat.py, preference.py)
      return json.dumps(record)
    text, error = files.record_text(record, self.field, where)
    if error:
      return self._skip("records_without_text", path, error, index)
    return text

  def _skip(self, kind: str, path: str, message: str, index: int) -> str:
    """'' for a bad record (counted once per record, however often it is read), or ValueError when strict."""
    if self.strict:
      raise ValueError(f"{message}; set config.data.text_field to the field holding the text, fix the line, or set "
                       "config.data.strict=False to skip such records")
    if index in self._counted:
      return ""
    self._counted.add(index)
    files.COUNTERS[kind] += 1
    files.warn_once((kind, path), f"{message}: skipped (later such records in this file are skipped and counted in "
                    f"data/{kind} without a warning)")
    return ""


class ParquetFiles:
  """One document per row; the text is column `field`. Reads one row group at a time (cached)."""

  def __init__(self, name: str, pattern: str, field: str = "text"):
    import pyarrow.parquet as pq  # lazy: heavy import
    self.name, self.field = name, field
    self.paths = expand_glob(pattern)
    self._groups: list[tuple[int, int]] = []  # (file index, row group) per group, in order
    counts = []
    for f_idx, path in enumerate(self.paths):
      with files.open_binary(path) as f:
        meta = pq.ParquetFile(f).metadata
        files.check_parquet_column(meta.schema.names, path, field,
                                   "set config.data.text_field to the column holding the text")
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
      with files.open_binary(self.paths[f_idx]) as f:
        column = pq.ParquetFile(f).read_row_group(group, columns=[self.field]).column(0)
      self._cache = (g, column.to_pylist())
    value = self._cache[1][index - self._cum[g]]
    if isinstance(value, bytes):
      value = files.decode_utf8(value, self.paths[self._groups[g][0]])
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
    # One warning per source (its records do not say which file they came from).
    return files.decode_utf8(self._source[index], f"arrayrecord source {self.name!r}")


class TokenCache:
  """One source of a tokenized cache (data/pretokenize.py): document i is the int32 token ids of the text
  source's document i (no BOS / EOS; empty where the text source had nothing usable), read from ArrayRecord
  shards. `tokenizer_sha256` is the tokenizer that made them; `tokenizer_path` the cache's copy of it ("" when
  the cache was made with a Hugging Face directory)."""

  def __init__(self, name: str, directory: str):
    from grain import sources as grain_sources  # lazy: array_record import
    self.name, self.directory = name, directory
    index = _read_json(os.path.join(directory, TOKEN_SOURCE))
    self.tokenizer_sha256 = index["tokenizer_sha256"]
    self.num_tokens = index["tokens"]
    copy = os.path.join(os.path.dirname(os.path.abspath(directory)), "tokenizer.model")
    self.tokenizer_path = copy if os.path.exists(copy) else ""
    self._source = grain_sources.ArrayRecordDataSource([os.path.join(directory, s["file"]) for s in index["shards"]])
    if len(self._source) != index["docs"]:
      raise ValueError(f"{directory}: {len(self._source)} records in the shards but {TOKEN_SOURCE} counts "
                       f"{index['docs']}; the cache is damaged: make it again with python -m data.pretokenize")

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> np.ndarray:
    # A read-only view of the record (no copy): the pipeline only concatenates or lists it.
    return np.frombuffer(self._source[index], np.dtype("<i4"))


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
      source = files.decode_utf8(f.read(), path)
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
  if spec.kind == "builtin" and spec.arg in ("tasks", *tasks.FAMILIES):
    return tasks.TaskSource(spec.name, family=None if spec.arg == "tasks" else spec.arg)
  if spec.kind == "builtin" and spec.arg == "preference":
    from data import preference_task  # pylint: disable=g-import-not-at-top
    return preference_task.PreferenceTask(spec.name)
  if spec.kind == "builtin":
    return Builtin(spec.name, spec.arg)
  if spec.kind in ("chat", "preference"):
    return JsonlFiles(spec.name, spec.arg, "", strict)
  if spec.kind == "text":
    return TextFiles(spec.name, spec.arg)
  if spec.kind == "jsonl":
    return JsonlFiles(spec.name, spec.arg, text_field, strict)
  if spec.kind == "parquet":
    return ParquetFiles(spec.name, spec.arg, text_field)
  if spec.kind == "arrayrecord":
    return ArrayRecordFiles(spec.name, spec.arg)
  if spec.kind == "tokens":
    return TokenCache(spec.name, spec.arg)
  raise SpecError(f"unknown source kind {spec.kind!r}; use one of {', '.join(KINDS)}")


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
