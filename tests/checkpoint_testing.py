"""A run's saved state read with orbax directly, as numpy arrays: independent of the training loop's restore."""
import numpy as np


def saved(workdir, step, part: str = "") -> dict:
  """WORKDIR/checkpoints/STEP/state (its `part`, e.g. "params", when given) as numpy arrays in a flat dict keyed
  by key-path tuples."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top
  path = epath.Path(workdir) / "checkpoints" / str(step) / "state"
  handler = ocp.PyTreeCheckpointHandler()
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), handler.metadata(path).tree)
  state = handler.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  return ocp.tree.to_flat_dict(state[part] if part else state)
