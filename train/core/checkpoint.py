"""Orbax checkpoints of a training run: WORKDIR/checkpoints/<step>/ with three items.

- `state`: the sharded train state pytree (parameters, optimizer state, step, RNG), written by every process.
- `data`: the grain data-iterator state (one JSON file per process), so the data order resumes exactly.
- `metadata`: JSON: step, the resolved config, the non-finite counter, the tokenizer file (base64) and the
  mesh it was saved on.

Saves are asynchronous: `save()` returns once the arrays are copied off the device; the files are written in a
background thread into a temporary directory that orbax renames to `<step>/` only when complete. A process
killed mid-save therefore leaves the previous `<step>/` untouched, and the half-written temporary directory is
ignored (and cleaned up) by the next run. Restoring takes abstract arrays (`jax.ShapeDtypeStruct` with the new
run's shardings), so a checkpoint restores onto another mesh by resharding.
"""
from __future__ import annotations

import base64
import errno
import logging
import os
from typing import Any

import ml_collections
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or read; the message names the path and the fix."""


def _is_disk_full(error: BaseException) -> bool:
  while error is not None:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def _iterator_args():
  # data.checkpoint wraps grain's handler with a clear error for a changed process count.
  from data import checkpoint as data_checkpoint  # pylint: disable=g-import-not-at-top
  return data_checkpoint.IteratorSave, data_checkpoint.IteratorRestore


def encode_file(path: str) -> dict[str, str]:
  """A small binary file (the tokenizer model) as a JSON-able dict: {"name", "base64"}."""
  with open(path, "rb") as f:
    return {"name": os.path.basename(path), "base64": base64.b64encode(f.read()).decode("ascii")}


def decode_file(entry: dict[str, str], directory: str) -> str:
  """Writes a file stored by `encode_file` into `directory` (if absent) and returns its path."""
  path = os.path.join(directory, entry["name"])
  data = base64.b64decode(entry["base64"])
  if not os.path.exists(path):
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  return path


def find_checkpoint_dir(path: str) -> tuple[str, int | None]:
  """Resolves a user-given path to (checkpoints directory, step or None = latest).

  Accepts a run directory (holding `checkpoints/`), a checkpoints directory, or one `checkpoints/<step>/`.
  """
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
    return os.path.join(path, CHECKPOINT_DIR), None
  base = os.path.basename(path.rstrip("/"))
  if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), int(base)
  if os.path.isdir(path) and any(d.isdigit() for d in os.listdir(path)):
    return path, None
  raise CheckpointError(f"no meshlm checkpoint under {path}: expected a run directory with checkpoints/, a "
                        "checkpoints/ directory or a checkpoints/<step>/ directory")


class Checkpointer:
  """Keeps the last `keep` checkpoints (plus every `keep_period`-th step) under `directory`.

  Args:
    directory: the checkpoints directory (created if missing), usually WORKDIR/checkpoints.
    ckpt_config: `config.checkpoint` (every, keep, keep_period, async_save).
    read_only: open existing checkpoints without ever writing or deleting (init_from).
  """

  def __init__(self, directory: str, ckpt_config: ml_collections.ConfigDict | None = None, *,
               read_only: bool = False):
    self.directory = os.path.abspath(directory)
    keep = int(ckpt_config.keep) if ckpt_config is not None else 1
    keep_period = int(ckpt_config.keep_period) if ckpt_config is not None else 0
    if keep < 1:
      raise CheckpointError(f"checkpoint.keep must be >= 1 (got {keep}): the latest checkpoint is needed to resume")
    policies = [ocp.checkpoint_managers.LatestN(n=keep)]
    if keep_period > 0:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_period))
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    if read_only:  # orbax warns that a read-only manager is read-only; that is the point here
      absl_log.setLevel(logging.ERROR)
    try:
      options = ocp.CheckpointManagerOptions(
          preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies) if not read_only else None,
          enable_async_checkpointing=bool(ckpt_config.async_save) if ckpt_config is not None else False,
          cleanup_tmp_directories=not read_only,
          create=not read_only,
          read_only=read_only,
      )
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    finally:
      absl_log.setLevel(level)

  def all_steps(self) -> list[int]:
    """Steps of the checkpoints in this directory, ascending (half-written ones left by a killed run excluded)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Any, data_iterator: Any | None, metadata: dict[str, Any]) -> None:
    """Starts saving `state` (a pytree of jax arrays), the iterator position and `metadata` as `<step>/`.

    Returns once the arrays are on the host (the caller may then donate `state` to the next step). Raises
    CheckpointError on a full disk (earlier checkpoints stay intact).
    """
    items = {"state": ocp.args.PyTreeSave(state), "metadata": ocp.args.JsonSave(dict(metadata, step=int(step)))}
    if data_iterator is not None:
      iterator_save, _ = _iterator_args()
      items["data"] = iterator_save(data_iterator)
    try:
      # force: the loop decides when to save; orbax must not skip a save it is asked for.
      self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_disk_full(e)
      raise

  def wait(self) -> None:
    """Blocks until the pending asynchronous save is complete on disk."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      self._raise_if_disk_full(e)
      raise

  def _raise_if_disk_full(self, error: BaseException) -> None:
    if _is_disk_full(error):
      latest = self.all_steps()
      previous = f"the previous checkpoint (step {latest[-1]}) is intact" if latest else "no earlier checkpoint exists"
      raise CheckpointError(
          f"disk full while writing a checkpoint under {self.directory}; {previous}. Free space (or point "
          "--workdir at a larger disk, or lower checkpoint.keep) and run the same command to resume.") from error

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata of checkpoint `step` (default: latest)."""
    step = self._resolve(step)
    restored = self._manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return dict(restored["metadata"])

  def state_layout(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"params/embed/embedding": (shape, dtype name), ...} of checkpoint `step`'s state, read from its metadata
    (no arrays are loaded): what `restore` needs the abstract state to match."""
    from etils import epath  # pylint: disable=g-import-not-at-top
    step = self._resolve(step)
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state").tree
    return {"/".join(map(str, k)): (tuple(v.shape), str(v.dtype)) for k, v in ocp.tree.to_flat_dict(tree).items()}

  def restore(self, abstract_state: Any, data_iterator: Any | None = None,
              step: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Restores (state, metadata) of checkpoint `step` (default: latest) onto the shardings in `abstract_state`.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct`s with `.sharding` (Trainer.abstract_state()); the
    arrays are resharded onto them whatever mesh they were saved from. `data_iterator`, if given, is moved to
    the saved position in place.
    """
    step = self._resolve(step)
    items = {
        "state": ocp.args.PyTreeRestore(item=abstract_state,
                                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)),
        "metadata": ocp.args.JsonRestore(),
    }
    if data_iterator is not None:
      _, iterator_restore = _iterator_args()
      items["data"] = iterator_restore(data_iterator)
    restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"], dict(restored["metadata"])

  def restore_subtree(self, abstract_subtree: Any, step: int | None = None) -> Any:
    """Restores only the leaves present in `abstract_subtree` (a pruned copy of the state tree: e.g. parameters
    for init_from), onto its shardings."""
    step = self._resolve(step)
    args = ocp.args.PyTreeRestore(item=abstract_subtree,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_subtree),
                                  partial_restore=True)
    return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]

  def _resolve(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"no complete checkpoint in {self.directory}")
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
    return step

  def close(self) -> None:
    """Waits for the pending save and releases orbax's threads."""
    try:
      self.wait()
    finally:
      self._manager.close()
