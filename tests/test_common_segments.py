"""One `positions_from_segments` for the data pipeline (NumPy) and the model (JAX)."""
import jax
import jax.numpy as jnp
import numpy as np

from common.segments import positions_from_segments


def _brute_force(segment_ids_L):
  """Position = tokens since the current run of equal ids began; 0 on padding."""
  out, run_start = [], 0
  for i, s in enumerate(segment_ids_L):
    if i > 0 and s != segment_ids_L[i - 1]:
      run_start = i
    out.append(0 if s == 0 else i - run_start)
  return out


def test_positions_match_a_brute_force_count_on_numpy_and_jax():
  rng = np.random.default_rng(0)
  rows = [np.array([1, 1, 1, 2, 2, 0, 0, 3], np.int32), np.array([0, 0, 1, 1], np.int32),
          np.array([5], np.int32)]
  rows += [np.sort(rng.integers(0, 4, size=32)).astype(np.int32)[::-1].copy() for _ in range(4)]
  for row in rows:
    want = _brute_force(row.tolist())
    got_np = positions_from_segments(row)
    assert isinstance(got_np, np.ndarray) and got_np.dtype == np.int32 and got_np.tolist() == want
    batch_BL = jnp.stack([jnp.asarray(row)] * 2)
    got_jax = jax.jit(positions_from_segments)(batch_BL)
    assert got_jax.dtype == jnp.int32 and np.asarray(got_jax).tolist() == [want, want]
