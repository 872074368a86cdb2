"""The per-process grain pipeline: read ▶ mix ▶ [FIM] ▶ tokenize ▶ pack ▶ batch, deterministic and exactly resumable.

Global order. The mixture is one infinite, seeded sequence of documents (`mixture_dataset`). The global batch has
B = config.train.batch_size rows; row r of every batch is filled, in order, from the documents r, r+B, r+2B, ...
of that sequence by its own packer. Process p of P computes rows [p*B/P, (p+1)*B/P) only, so its batch is
exactly its slice of the global batch and the processes read disjoint documents: concatenating the per-process
batches of step s (in process order) gives the 1-process batch of step s, for any P dividing B.

Batch (numpy, each [B/P, seq_len]): `inputs`, `targets`, `segment_ids`, `positions` int32 and `loss_mask` float32
(with data.objective_mixture also `prefix` int32, 1 on a denoised example's bidirectional input).
A document d_1..d_n becomes inputs BOS d_1..d_n and targets d_1..d_n EOS; documents longer than a row are split
into row-sized pieces (first_fit) or across rows (concat). With data.fim_rate > 0, training documents are first
rearranged for fill-in-the-middle (data/fim.py), or with data.objective_mixture denoised (UL2, data/denoise.py:
span corruption or a prefix split, one example per chunk); the eval split stays left-to-right. Conversations (chat
sources, data/chat.py) are rendered with the chat template, truncated to seq_len (never split: first_fit packing
keeps each one whole in one row) and carry their assistant-token loss mask. segment_ids number the pieces in a row
from 1 (0 = padding), positions restart at 0 for every piece, and padding has loss_mask 0. Preference sources
(data/preference.py) give one pair per row instead, unpacked: `chosen_*` and `rejected_*` versions of those five
arrays and `margin`, so both sides of a pair sit in the same row of the same data shard.

Resume. `get_state()` holds each batch row's packer state (keyed by global row) next to the layout: process
index/count, batch size, sequence length, worker count, packing, sources. `set_state()` continues exactly and
refuses a state from another layout, naming both values. A changed process count is handled exactly by
`set_global_state(states of all old processes)` (what `data.checkpoint.IteratorRestore` does): every global row
continues where it stopped. The realised mixture and packing efficiency (`stats(iterator)`) are part of the state.
"""
from __future__ import annotations

import copy
import hashlib
from typing import Any, Sequence

import grain
import numpy as np

from common.segments import positions_from_segments
from data import chat as chat_lib
from data import denoise as denoise_lib
from data import fim as fim_lib
from data import mixture as mixture_lib
from data import plan as plan_lib
from data import preference as preference_lib
from data import sources as sources_lib
from data import tokenizer as tokenizer_lib

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# The eval split's order is fixed (not shuffle_seed), so runs with different seeds evaluate on the same batches.
_EVAL_ORDER_SEED = 104729


def mixture_dataset(specs, srcs, split: str, eval_fraction: float, seed: int) -> grain.MapDataset:
  """Infinite MapDataset of (source_id, text): each source's split shuffled anew every epoch, mixed by weight
  (see data/mixture.py)."""
  docs, indices, weights, ids = [], [], [], []
  for sid, (spec, src) in enumerate(zip(specs, srcs)):
    if len(src) == 0:
      raise ValueError(f"data source {spec.name!r} ({spec.kind}:{spec.arg}) has no documents")
    split_idx = sources_lib.source_split(src, eval_fraction, split)
    if len(split_idx) == 0:
      continue  # e.g. a one-document source holds nothing out; the eval mixture renormalises without it
    docs.append(src)
    indices.append(split_idx)
    weights.append(spec.weight)
    ids.append(sid)
  if not docs:
    if split == "train":
      raise ValueError("no documents in the 'train' split; add documents")
    why = ("config.data.eval_fraction=0 holds none out" if eval_fraction == 0 else
           "no source has the 2 or more documents needed to hold one out")
    raise ValueError(f"no documents in the 'eval' split: {why}; set config.train.eval_every=0 (no evaluation)"
                     + (", or add documents" if eval_fraction else ", or config.data.eval_fraction > 0"))
  return grain.MapDataset.source(mixture_lib.MixtureDocs(docs, indices, weights, seed, ids))


class _Tokenize:
  """(source_id, text[, plan]) -> {inputs: BOS+ids, targets: ids+EOS, loss_mask: ones, source_ids}, or None
  for an empty document; records of chat sources go through `chat` (data/chat.py: rendered, assistant mask,
  truncated); a FIM plan (data/fim.py) rearranges the document's ids around the FIM sentinels; a denoising plan
  (data/denoise.py, with `denoiser`) makes a list of examples. `with_prefix` adds the `prefix` array (zeros but on
  denoised examples' inputs)."""

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer, chat: chat_lib.ChatEncoder | None = None,
               chat_sources: Sequence[int] = (), denoiser: denoise_lib.Denoiser | None = None,
               with_prefix: bool = False):
    self.tokenizer, self.chat, self.chat_sources = tokenizer, chat, frozenset(chat_sources)
    self.denoiser, self.with_prefix = denoiser, with_prefix

  def __call__(self, element):
    source_id, text, plan = element if len(element) == 3 else (*element, None)
    if isinstance(text, np.ndarray):  # a tokenized cache's document (data/pretokenize.py): ids already
      return self._from_ids(text, source_id, plan)
    if not text or not text.strip():
      return None
    if source_id in self.chat_sources:
      out = self.chat(text)
      if out is None:
        return None
      return self._finish(out, source_id)
    fim = plan is not None and not isinstance(plan, denoise_lib.Plan)
    ids = fim_lib.encode(self.tokenizer, text, plan) if fim else self.tokenizer.encode(text)
    return self._from_ids(np.asarray(ids, np.int32), source_id, plan)

  def _from_ids(self, ids, source_id, plan):
    """The example(s) of a document whose ids are `ids` (int32 [n]): denoised with a denoising plan, else
    BOS + ids -> ids + EOS. A tokenized cache's documents come here directly (FIM needs the text and is refused
    with caches, in make_dataset)."""
    if ids.size == 0:
      return None
    if isinstance(plan, denoise_lib.Plan):
      return [self._finish(e, source_id) for e in self.denoiser(ids.tolist(), plan)] or None
    return self._finish({"inputs": np.concatenate([[self.tokenizer.bos_id], ids]).astype(np.int32),
                         "targets": np.concatenate([ids, [self.tokenizer.eos_id]]).astype(np.int32),
                         "loss_mask": np.ones(ids.size + 1, np.float32)}, source_id)

  def _finish(self, out, source_id):
    n = len(out["inputs"])
    out = dict(out, source_ids=np.full(n, source_id, np.int32))
    if self.with_prefix and "prefix" not in out:
      out["prefix"] = np.zeros(n, np.int32)
    return out


class _EncodePair:
  """(source_id, text) -> one pair's rows (data/preference.py) plus `source_ids` [seq_len] (the source on the
  chosen side's tokens, -1 on its padding), or None for a skipped pair."""

  def __init__(self, encoder: preference_lib.PairEncoder):
    self.encoder = encoder

  def __call__(self, element):
    source_id, text = element
    out = self.encoder(text)
    if out is None:
      return None
    return dict(out, source_ids=np.where(out["chosen_segment_ids"] > 0, source_id, -1).astype(np.int32))


def _pair_stream(mixture: grain.MapDataset, row: int, global_rows: int, encode: _EncodePair) -> grain.IterDataset:
  """Rows of global batch row `row` from preference pairs: pairs row, row+global_rows, ... (one pair per row)."""
  ds = mixture[row::global_rows].map(encode)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).filter(_is_document)


def _is_document(element) -> bool:
  return element is not None


class _SplitLong(grain.experimental.FlatMapTransform):
  """Cuts a tokenized document (or each of a list of examples) into pieces of at most `seq_len` tokens
  (first-fit packs whole pieces)."""
  max_fan_out = 1 << 20

  def __init__(self, seq_len: int):
    self.seq_len = seq_len

  def flat_map(self, element):
    return [{k: v[i:i + self.seq_len] for k, v in e.items()}
            for e in (element if isinstance(element, list) else [element])
            for i in range(0, len(e["inputs"]), self.seq_len)]


class _Row:
  """Packed grain features -> one batch row with positions restarting per segment and padding masked."""

  def __init__(self, pad_id: int, with_prefix: bool = False):
    self.pad_id, self.with_prefix = pad_id, with_prefix

  def __call__(self, packed):
    seg = np.asarray(packed["inputs_segment_ids"], np.int32)
    row = {
        "inputs": np.where(seg > 0, packed["inputs"], self.pad_id).astype(np.int32),
        "targets": np.where(seg > 0, packed["targets"], self.pad_id).astype(np.int32),
        "segment_ids": seg,
        "positions": positions_from_segments(seg),
        "loss_mask": np.where(seg > 0, packed["loss_mask"], 0.0).astype(np.float32),
        "source_ids": np.where(seg > 0, packed["source_ids"], -1).astype(np.int32),
    }
    if self.with_prefix:
      row["prefix"] = np.where(seg > 0, packed["prefix"], 0).astype(np.int32)
    return row


class _Rows(grain.IterDataset):
  """Batches stacked from one packed stream per batch row; the state is keyed by global row number, so states
  saved by any process layout can be recombined (`DataIterator.set_global_state`)."""

  def __init__(self, streams: Sequence[grain.IterDataset], rows: Sequence[int]):
    super().__init__(list(streams))
    self.rows = list(rows)

  def __iter__(self):
    return _RowsIterator([p.__iter__() for p in self._parents], self.rows)


class _RowsIterator(grain.DatasetIterator):

  def __init__(self, parents, rows):
    super().__init__(parents)
    self.rows = rows

  def __next__(self) -> dict[str, np.ndarray]:
    rows = [next(p) for p in self._parents]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

  def get_state(self) -> dict[str, Any]:
    return {"rows": {str(r): p.get_state() for r, p in zip(self.rows, self._parents)}}

  def set_state(self, state: dict[str, Any]) -> None:
    missing = [r for r in self.rows if str(r) not in state["rows"]]
    if missing:
      raise ValueError(f"the data iterator state has no entry for batch rows {missing}")
    for r, p in zip(self.rows, self._parents):
      p.set_state(state["rows"][str(r)])


def _row_stream(mixture: grain.MapDataset, row: int, global_rows: int, tokenize: _Tokenize, data_config,
                seq_len: int) -> grain.IterDataset:
  """Packed rows of global batch row `row`: documents row, row+global_rows, ... of the mixture."""
  ds = mixture[row::global_rows].map(tokenize)
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).filter(_is_document)
  lengths = {"inputs": seq_len, "targets": seq_len, "loss_mask": seq_len, "source_ids": seq_len}
  if tokenize.with_prefix:
    lengths["prefix"] = seq_len
  if data_config.packing == "first_fit":
    ds = grain.experimental.FlatMapIterDataset(ds, _SplitLong(seq_len))
    ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct=lengths,
                                                    num_packing_bins=data_config.packing_bins, shuffle_bins=False)
  elif data_config.packing == "concat":
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct=lengths)
  else:
    raise ValueError(f"config.data.packing must be 'first_fit' or 'concat', got {data_config.packing!r}")
  return ds.map(_Row(tokenize.tokenizer.pad_id, tokenize.with_prefix))


def _ensure_absl_flags_parsed() -> None:
  """Grain reads absl flags before spawning workers; outside an absl app they are unparsed and it would fail."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class _Finalize(grain.IterDataset):
  """Top of the pipeline (main process): strips per-token source ids into counters, checks and adds the layout
  metadata to the state."""

  def __init__(self, parent: grain.IterDataset, meta: dict[str, Any], source_names: Sequence[str], bos_id: int,
               inputs_key: str = "inputs"):
    super().__init__(parent)
    self.meta, self.source_names, self.bos_id, self.inputs_key = meta, list(source_names), bos_id, inputs_key

  def __iter__(self):
    return DataIterator(self._parent.__iter__(), self.meta, self.source_names, self.bos_id, self.inputs_key)


class DataIterator(grain.DatasetIterator):
  """What `make_iterator` returns: a grain DatasetIterator of batch dicts with `stats()` and a checked state."""

  def __init__(self, parent, meta, source_names, bos_id, inputs_key: str = "inputs"):
    super().__init__(parent)
    # inputs_key: the array whose BOS tokens count documents (`chosen_inputs` for preference pairs)
    self.meta, self.source_names, self.bos_id, self.inputs_key = meta, source_names, bos_id, inputs_key
    n = len(source_names)
    self._counts = {"batches": 0, "tokens": 0, "slots": 0, "source_tokens": [0] * n, "source_docs": [0] * n}

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._parent)
    source_ids = batch.pop("source_ids")
    n = len(self.source_names)
    real = source_ids >= 0
    c = self._counts
    c["batches"] += 1
    c["tokens"] += int(real.sum())
    c["slots"] += int(source_ids.size)
    tok = np.bincount(source_ids[real], minlength=n)
    docs = np.bincount(source_ids[real & (batch[self.inputs_key] == self.bos_id)], minlength=n)
    c["source_tokens"] = [a + int(b) for a, b in zip(c["source_tokens"], tok)]
    c["source_docs"] = [a + int(b) for a, b in zip(c["source_docs"], docs)]
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"meta": dict(self.meta), "counts": copy.deepcopy(self._counts), "pipeline": self._parent.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    saved = state.get("meta", {}) if isinstance(state, dict) else {}
    if saved.get("process_count") != self.meta["process_count"]:
      raise ValueError(
          f"the data iterator state was saved by a run with {saved.get('process_count')} processes, but this run "
          f"has {self.meta['process_count']}: one process's state holds only its own batch rows. Restore through "
          "data.checkpoint.IteratorRestore (it reads every process's state and re-divides the rows exactly), "
          f"or resume with {saved.get('process_count')} processes")
    self._check_layout(saved, ignore=("process_index",))
    if saved.get("process_index") != self.meta["process_index"]:
      raise ValueError(f"the data iterator state belongs to process {saved.get('process_index')}, not "
                       f"{self.meta['process_index']}")
    self._parent.set_state(state["pipeline"])
    self._counts = copy.deepcopy(state["counts"])

  def set_global_state(self, states: Sequence[dict[str, Any]]) -> None:
    """Restores from the states of ALL processes of a run with any process count (same batch size and data
    settings): each global batch row continues exactly where it stopped, so no document is repeated or skipped.

    Needs thread prefetch (worker_count=0) in both runs; the statistics continue from the old processes' sums.
    """
    metas = [s.get("meta", {}) for s in states]
    old_count = metas[0].get("process_count") if metas else None
    if sorted(m.get("process_index") for m in metas) != list(range(old_count or 0)):
      raise ValueError(f"set_global_state needs the states of all {old_count} processes; got process indices "
                       f"{sorted(m.get('process_index') for m in metas)}")
    for m in metas:
      self._check_layout(m, ignore=("process_index", "process_count"))
    if self.meta["worker_count"] != 0:
      raise ValueError(
          f"cannot re-divide a data iterator state between {old_count} and {self.meta['process_count']} processes "
          "with worker processes (config.data.worker_count > 0): worker states are per process. Resume with "
          f"{old_count} processes, or with config.data.worker_count=0 in both runs")
    rows = {}
    for s in states:
      rows.update(s["pipeline"]["rows"])
    self._parent.set_state({"rows": rows})
    counts = [s["counts"] for s in states]
    self._counts = {
        "batches": max(c["batches"] for c in counts),
        **{k: sum(c[k] for c in counts) for k in ("tokens", "slots")},
        **{k: [sum(v) for v in zip(*(c[k] for c in counts))] for k in ("source_tokens", "source_docs")}}

  def _check_layout(self, saved: dict[str, Any], ignore: Sequence[str]) -> None:
    for key, value in self.meta.items():
      if key not in ignore and saved.get(key) != value:
        raise ValueError(f"the data iterator state was saved with {key}={saved.get(key)!r} but this run has "
                         f"{key}={value!r}; resume with the same config.data/train settings (or start the data "
                         "order afresh in a new run directory)")

  def stats(self) -> dict[str, float]:
    """Realised mixture (token and document fractions per source) and packing efficiency (non-pad fraction) of
    every batch this process has yielded since the run started (restored state included), plus the counts of
    invalid UTF-8 and skipped records read in this process."""
    c = self._counts
    out = {"data/batches": float(c["batches"]),
           "data/packing_efficiency": c["tokens"] / c["slots"] if c["slots"] else 0.0}
    docs = sum(c["source_docs"])
    for name, tokens, n in zip(self.source_names, c["source_tokens"], c["source_docs"]):
      out[f"data/mixture_tokens/{name}"] = tokens / c["tokens"] if c["tokens"] else 0.0
      out[f"data/mixture_docs/{name}"] = n / docs if docs else 0.0
    # Input problems met in this process (with worker processes, theirs appear only as log warnings).
    out.update({f"data/{k}": float(v) for k, v in sorted(sources_lib.COUNTERS.items())})
    return out


def stats(iterator: DataIterator) -> dict[str, float]:
  """`iterator.stats()`: metric name -> value, ready to log (see DataIterator.stats)."""
  return iterator.stats()


def _check_layout(config, split: str, process_index: int, process_count: int) -> None:
  """ValueError naming the key when the split, this process's place or the batch layout cannot be read."""
  d, batch_size, seq_len = config.data, config.train.batch_size, config.train.seq_len
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is not in [0, process_count={process_count})")
  if batch_size % process_count:
    raise ValueError(f"config.train.batch_size={batch_size} is not divisible by the {process_count} processes; "
                     f"use a multiple of {process_count}")
  if seq_len < 2:
    raise ValueError(f"config.train.seq_len must be at least 2, got {seq_len}")
  if d.worker_count < 0 or d.prefetch < 0 or d.packing_bins < 1:
    raise ValueError("config.data.worker_count and config.data.prefetch must be >= 0 and packing_bins >= 1")


def _check_token_caches(specs, srcs, tokenizer, fim_rate: float) -> None:
  """Refuses a tokenized cache made with another tokenizer (naming both), or one mixed with FIM (which rearranges
  the text before tokenizing)."""
  caches = [(spec, src) for spec, src in zip(specs, srcs) if isinstance(src, sources_lib.TokenCache)]
  if not caches:
    return
  if fim_rate > 0:
    raise ValueError(f"config.data.fim_rate={fim_rate:g} rearranges documents as text before tokenizing, but "
                     f"source {caches[0][0].name!r} is a tokenized cache; read the text source instead, or set "
                     "config.data.fim_rate=0")
  from data import pretokenize  # pylint: disable=g-import-not-at-top
  proto = getattr(tokenizer, "model_proto", None)  # a meshlm .model; a Hugging Face tokenizer: its directory
  mine = (hashlib.sha256(proto).hexdigest() if proto is not None else
          pretokenize.tokenizer_fingerprint(tokenizer.path))
  for spec, src in caches:
    if src.tokenizer_sha256 != mine:
      raise ValueError(f"source {spec.name!r} ({spec.arg}) was tokenized with another tokenizer (sha256 "
                       f"{src.tokenizer_sha256[:12]}, {src.tokenizer_path or 'its manifest names it'}) than this run's "
                       f"{tokenizer.path or '(in memory)'} (sha256 {mine[:12]}); make the cache again with this "
                       "tokenizer, or set config.data.tokenizer to the cache's")


def make_dataset(config, tokenizer: tokenizer_lib.Tokenizer, *, split: str = "train",
                 process_index: int | None = None, process_count: int | None = None,
                 plan: plan_lib.DataPlan | None = None) -> grain.IterDataset:
  """The grain IterDataset behind `make_iterator` (same arguments)."""
  if process_index is None or process_count is None:
    import jax  # lazy: only to learn this process's place; data never needs jax otherwise
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  d, batch_size, seq_len = config.data, config.train.batch_size, config.train.seq_len
  _check_layout(config, split, process_index, process_count)
  tokenizer_lib.check_vocab(tokenizer, config)
  plan = plan or plan_lib.resolve(d)
  specs, srcs = list(plan.specs), plan.open()
  _check_token_caches(specs, srcs, tokenizer, d.fim_rate)
  seed = d.shuffle_seed if split == "train" else _EVAL_ORDER_SEED
  mixture = mixture_dataset(specs, srcs, split, plan.eval_fraction, seed)
  pair_sources = list(plan.preference_names)
  if pair_sources and len(pair_sources) < len(specs):
    raise ValueError(f"config.data.sources mixes preference sources ({', '.join(pair_sources)}) with other kinds; "
                     "a preference run (train.objective=reward|dpo) reads only preference sources")
  chat_sources = list(plan.chat_indices)
  if d.fim_rate > 0 and split == "train":
    fim_lib.sentinels(tokenizer)  # fails early, naming the fix, if the tokenizer has no FIM pieces
    # Indexed by position in the mixture (before the rows take their slices): the plan of every document is a
    # function of (seed, index), the same for any process layout and after a resume.
    mixture = mixture.map_with_index(fim_lib.FimTransform(d.shuffle_seed, d.fim_rate, d.fim_spm_rate,
                                                          chat_sources, d.fim_level))
  denoiser = None
  if d.objective_mixture:
    denoise_lib.check_config(config)
    denoiser = denoise_lib.Denoiser(tokenizer, d, seq_len)  # fails early if the tokenizer lacks the pieces
  if denoiser and split == "train":  # the eval split stays left-to-right (comparable eval_loss), prefix all 0
    mixture = mixture.map_with_index(denoise_lib.MixtureTransform(
        d.shuffle_seed, plan.denoisers, chat_sources))
  chat = None
  if chat_sources and d.packing != "first_fit":
    raise ValueError(f"config.data.packing={d.packing!r} would split conversations across rows; chat sources "
                     "need config.data.packing='first_fit'")
  if chat_sources:
    chat = chat_lib.ChatEncoder(chat_lib.make_template(d, tokenizer), seq_len, d.chat_loss, d.chat_truncation,
                                d.strict)
  tokenize = _Tokenize(tokenizer, chat, chat_sources, denoiser, with_prefix=denoiser is not None)
  rows = batch_size // process_count
  if pair_sources:
    encode = _EncodePair(preference_lib.PairEncoder(chat_lib.make_template(d, tokenizer), seq_len,
                                                    tokenizer.pad_id, d.strict))
    streams = [_pair_stream(mixture, process_index * rows + r, batch_size, encode) for r in range(rows)]
  else:
    streams = [_row_stream(mixture, process_index * rows + r, batch_size, tokenize, d, seq_len)
               for r in range(rows)]
  ds = _Rows(streams, [process_index * rows + r for r in range(rows)])
  # Evaluation reads a few batches from a fresh iterator each time: worker start-up would dominate, and a
  # prefetch thread would outlive an iterator that is dropped without close(); it reads synchronously.
  worker_count, prefetch = (d.worker_count, d.prefetch) if split == "train" else (0, 0)
  if worker_count > 0:
    _ensure_absl_flags_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count,
                                                     per_worker_buffer_size=max(1, prefetch)))
  elif prefetch > 0:
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
  meta = {"split": split, "process_index": process_index, "process_count": process_count,
          "batch_size": batch_size, "seq_len": seq_len, "worker_count": worker_count, "packing": d.packing,
          "packing_bins": d.packing_bins, "shuffle_seed": d.shuffle_seed,
          # Names, weights and document counts fix the order; paths may move (local -> gs://) between runs.
          "sources": [f"{s.name}={s.kind}@{s.weight:.6g}:{len(src)} documents" for s, src in zip(specs, srcs)]}
  if d.fim_rate > 0 and split == "train":  # only then, so states of runs without FIM keep their layout
    meta["fim"] = f"rate {d.fim_rate:g}, spm {d.fim_spm_rate:g}" + (", token" if d.fim_level == "token" else "")
  if d.objective_mixture:
    meta["objective_mixture"] = (f"{d.objective_mixture}; R {d.ul2_r_mean_span:g}/{d.ul2_r_rate:g}, "
                                 f"X {d.ul2_x_mean_span:g}/{d.ul2_x_rate:g}")
  return _Finalize(ds, meta, [s.name for s in specs], tokenizer.bos_id,
                   "chosen_inputs" if pair_sources else "inputs")


def make_iterator(config, tokenizer: tokenizer_lib.Tokenizer, *, split: str = "train",
                  process_index: int | None = None, process_count: int | None = None,
                  plan: plan_lib.DataPlan | None = None) -> DataIterator:
  """This process's batches: a grain DatasetIterator of dicts of numpy arrays, each
  [config.train.batch_size // process_count, config.train.seq_len] (see the module docstring).

  split="train" is infinite (every source reshuffled each epoch); split="eval" draws only held-out documents in
  a fixed order (also infinite: take the number of batches you need), so re-creating it repeats its batches.
  process_index/process_count default to jax's. With config.data.worker_count > 0 the work runs in grain worker
  processes (spawned: guard the entry point with `if __name__ == "__main__":`); call `close()` when done.
  `plan` is the run's parsed config.data (data/plan.py; resolved from config.data when None).
  """
  return iter(make_dataset(config, tokenizer, split=split, process_index=process_index,
                           process_count=process_count, plan=plan))
