"""Orbax arguments for the data-iterator state: grain's handler plus a clear refusal of a changed process count.

Use `IteratorSave(iterator)` / `IteratorRestore(iterator)` inside an `ocp.args.Composite` exactly like
`grain.checkpoint.CheckpointSave/Restore` (same files: one `process_<i>-of-<n>.json` per process). Restoring a
checkpoint written by a different number of processes raises ValueError naming both counts instead of grain's
"file does not exist".
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from grain._src.python.checkpoint import handler as grain_handler
from grain._src.core import sharding
import orbax.checkpoint as ocp

_FILE_RE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")


def saved_process_counts(directory) -> set[int]:
  """Process counts of the iterator-state files in a checkpoint's data directory."""
  return {int(m[2]) for p in directory.iterdir() if (m := _FILE_RE.match(p.name))}


class IteratorHandler(grain_handler.CheckpointHandler):
  """grain's CheckpointHandler; restore first checks that the state was saved by this many processes."""

  def restore(self, directory, item=None, args=None):
    process_index, process_count = sharding.get_process_index_and_count()
    counts = saved_process_counts(directory)
    if counts and process_count not in counts:
      raise ValueError(
          f"the data iterator state in {directory} was saved by {sorted(counts)[0]} process(es), but this run has "
          f"{process_count}: each process owns fixed rows of the global batch, so it cannot be re-divided "
          f"without duplicating or skipping documents. Resume with {sorted(counts)[0]} process(es), or start the "
          "data order afresh (a new run directory with config.train.init_from pointing at this one).")
    return super().restore(directory, item=item, args=args)


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  item: Any
