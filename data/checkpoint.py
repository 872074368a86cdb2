"""Orbax arguments for the data-iterator state: grain's handler, plus restoring into another process count.

Use `IteratorSave(iterator)` / `IteratorRestore(iterator)` inside an `ocp.args.Composite` exactly like
`grain.checkpoint.CheckpointSave/Restore` (same files: one `process_<i>-of-<n>.json` per process). When the
checkpoint was written by a different number of processes, restore reads every process's file and re-divides
the global batch rows exactly (`DataIterator.set_global_state`); where that is impossible (worker processes, a
changed batch size) it raises ValueError naming both values, never duplicating or skipping data.
"""
import dataclasses
import json
import re
from typing import Any

from grain import checkpoint as grain_checkpoint
import jax
import orbax.checkpoint as ocp

_FILE_RE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")


def saved_process_counts(directory) -> set[int]:
  """Process counts of the iterator-state files in a checkpoint's data directory."""
  return {int(m[2]) for p in directory.iterdir() if (m := _FILE_RE.match(p.name))}


class IteratorHandler(grain_checkpoint.CheckpointHandler):
  """grain's CheckpointHandler; restore also accepts a state saved by another number of processes."""

  def restore(self, directory, item=None, args=None):
    item = item or args.item
    process_count = jax.process_count()  # grain names the files by jax's process index and count
    counts = saved_process_counts(directory)
    if not counts or process_count in counts:
      return super().restore(directory, item=item)
    old = max(counts)
    if not hasattr(item, "set_global_state"):
      raise ValueError(f"the data iterator state in {directory} was saved by {old} process(es), but this run has "
                       f"{process_count}; only data.pipeline iterators can be re-divided. Resume with {old}.")
    states = [json.loads((directory / f"process_{i}-of-{old}.json").read_text()) for i in range(old)]
    item.set_global_state(states)
    item.start_prefetch()
    return item


@ocp.args.register_with_handler(IteratorHandler, for_save=True)
@dataclasses.dataclass
class IteratorSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(IteratorHandler, for_restore=True)
@dataclasses.dataclass
class IteratorRestore(ocp.args.CheckpointArgs):
  item: Any
