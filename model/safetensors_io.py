"""Streaming reads and writes of Hugging Face safetensors directories, one tensor (or one slice) at a time.

A directory holds `model.safetensors`, or Hugging Face's sharded layout: `model-0000k-of-0000n.safetensors` files
listed by `model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`).
A safetensors file is an 8-byte little-endian header length, a JSON header `{name: {"dtype", "shape",
"data_offsets": [begin, end]}}` (offsets into the data that follows the header) and the raw row-major data.

`Reader` memory-maps the files and reads only the requested slice of a tensor (the safetensors library's numpy
reader refuses bfloat16, hence this small reader); `write` plans the shards from shapes and dtypes up front, so
each file's header is written first and every tensor is produced, written and dropped in turn.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterable, NamedTuple, Sequence

import ml_dtypes
import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_SHARD_SIZE = 5 * 10**9  # bytes per file; Hugging Face's default `max_shard_size="5GB"`
DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
          "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
          "BOOL": np.dtype(np.bool_)}
_NAMES = {v: k for k, v in DTYPES.items()}


class FileError(ValueError):
  """A safetensors directory is incomplete or damaged; the message names the file and the fix."""


class TensorInfo(NamedTuple):
  file: str  # path of the file holding the tensor
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int  # absolute byte offset of the tensor's data in `file`


def _read_header(path: str) -> tuple[dict, int]:
  """(header dict, byte offset where the data starts); FileError naming `path` when it is short or garbled."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or 8 + n > size:
      raise FileError(f"{path} is truncated ({size} bytes, shorter than its own header); download or export "
                      "it again")
    try:
      header = json.loads(f.read(n))
    except ValueError:
      raise FileError(f"{path} has no valid safetensors header; download or export it again") from None
  header.pop("__metadata__", None)
  end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
  if 8 + n + end > size:
    raise FileError(f"{path} is truncated: its header describes {8 + n + end} bytes but the file holds {size}; "
                    "download or export it again")
  return header, 8 + n


class Reader:
  """The tensors of a safetensors directory, read lazily through memory maps.

  `names()`, `shape(name)`, `read(name, index)`: the tensor's `index` (a tuple of slices or integer arrays, one
  per dimension) as a NumPy array in the stored dtype; only the pages holding that slice are read.
  Opening checks that every listed file exists and is complete (FileError naming the file otherwise).
  """

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE)):
      weight_map, files = None, [SINGLE]
    else:
      raise FileError(f"{path} holds neither {SINGLE} nor {INDEX}; give a Hugging Face model directory")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
      raise FileError(f"{path}: {INDEX} lists {', '.join(missing)}, missing from the directory; download or "
                      "export the checkpoint again (all of its files)")
    self._tensors: dict[str, TensorInfo] = {}
    for name in files:
      file = os.path.join(path, name)
      header, start = _read_header(file)
      for key, t in header.items():
        if weight_map is None or weight_map.get(key) == name:
          self._tensors[key] = TensorInfo(file, DTYPES[t["dtype"]], tuple(int(d) for d in t["shape"]),
                                          start + int(t["data_offsets"][0]))
    if weight_map is not None:
      absent = sorted(k for k, f in weight_map.items() if k not in self._tensors)
      if absent:
        raise FileError(f"{path}: {absent[0]} is listed in {INDEX} under {weight_map[absent[0]]} but that file "
                        "does not hold it; download or export the checkpoint again")

  def names(self) -> list[str]:
    return list(self._tensors)

  def __contains__(self, name: str) -> bool:
    return name in self._tensors

  def shape(self, name: str) -> tuple[int, ...]:
    return self._tensors[name].shape

  def read(self, name: str, index: tuple = ()) -> np.ndarray:
    """tensor[index] (NumPy basic or `np.ix_` indexing), copied out of a memory map of that tensor alone: the
    map closes on return, so the pages read do not stay in this process's resident memory."""
    t = self._tensors[name]
    if not t.shape or 0 in t.shape:
      return np.zeros(t.shape, t.dtype)[index]
    mapped = np.memmap(t.file, dtype=t.dtype, mode="r", offset=t.begin, shape=t.shape)
    block = np.array(mapped[index])
    del mapped  # unmaps (the last reference)
    return block


def plan(tensors: Sequence[tuple[str, tuple[int, ...], np.dtype]], max_shard_size: int) -> list[list[int]]:
  """Hugging Face's split of tensors (in order) into files: a new file starts when the next tensor would take
  the current one past `max_shard_size` bytes; a tensor larger than that gets a file of its own."""
  files: list[list[int]] = [[]]
  size = 0
  for i, (_, shape, dtype) in enumerate(tensors):
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if files[-1] and size + nbytes > max_shard_size:
      files.append([])
      size = 0
    files[-1].append(i)
    size += nbytes
  return files


def write(path: str, tensors: Sequence[tuple[str, tuple[int, ...], np.dtype]],
          produce: Callable[[int], np.ndarray | None], max_shard_size: int = DEFAULT_SHARD_SIZE,
          progress: Callable[[Iterable], Iterable] = iter) -> list[str]:
  """Writes `tensors` (name, shape, dtype) into `path` as one `model.safetensors` or sharded files + index.

  produce(i) returns tensor i's array (shape and dtype as declared), or None on a process that does not write; it
  is called for every i in order on every process, so it may gather across processes. Weight files of an earlier
  save that the new layout does not use are removed afterwards.
  Returns the file names written.
  """
  groups = plan(tensors, max_shard_size)
  names = [SINGLE] if len(groups) == 1 else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                                             for k in range(len(groups))]
  todo = progress(range(len(tensors)))
  handles = {}
  for k, group in enumerate(groups):
    header, offset = {}, 0
    for i in group:
      name, shape, dtype = tensors[i]
      nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
      header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset,
                                                                                                offset + nbytes]}
      offset += nbytes
    handles[k] = (header, offset)
  file_of = {i: k for k, group in enumerate(groups) for i in group}
  out, current = None, -1
  try:
    for i in todo:
      array = produce(i)
      if array is None:
        continue
      if file_of[i] != current:
        if out is not None:
          out.close()
        current = file_of[i]
        out = open(os.path.join(path, names[current]), "wb")
        header = {"__metadata__": {"format": "pt"}, **handles[current][0]}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
        out.write(len(blob).to_bytes(8, "little") + blob)
      name, shape, dtype = tensors[i]
      if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: produced {array.dtype}{list(array.shape)}, declared {np.dtype(dtype)}"
                         f"{list(shape)}")
      out.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
  finally:
    if out is not None:
      out.close()
  if out is None:  # a process that writes nothing
    return names
  if len(groups) > 1:
    weight_map = {tensors[i][0]: names[k] for k, group in enumerate(groups) for i in group}
    total = sum(size for _, size in handles.values())
    with open(os.path.join(path, INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  keep = set(names) | ({INDEX} if len(groups) > 1 else set())
  for stale in os.listdir(path):  # an earlier save's files would shadow or contradict the new ones
    if (stale in (SINGLE, INDEX) or SHARD_RE.fullmatch(stale)) and stale not in keep:
      os.remove(os.path.join(path, stale))
  return names


def parse_size(value: int | str) -> int:
  """Bytes from an int or a string like "5GB", "500MB", "40KB" (decimal, as Hugging Face counts) or "2GiB"."""
  if isinstance(value, int):
    return value
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(value), re.IGNORECASE)
  if not m:
    raise ValueError(f"shard size {value!r}: give bytes or a size such as 5GB, 500MB, 2GiB")
  unit = (m.group(2) or "B").upper()
  scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
           "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
  size = int(float(m.group(1)) * scale)
  if size < 1:
    raise ValueError(f"shard size {value!r} must be at least one byte")
  return size
