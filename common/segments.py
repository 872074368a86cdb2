"""Packed-sequence bookkeeping shared by the data pipeline (NumPy, in grain workers) and the model (JAX, traced).

It lives outside `data/` and `model/` because the layering forbids either to import the other, and both must
agree exactly on where a document's positions restart.
"""
from __future__ import annotations

import numpy as np


def positions_from_segments(segment_ids_BL):
  """int32 [..., L]: each token's index inside its run of equal segment ids (0 at a document's first token);
  0 on padding (segment id 0).

  Accepts a NumPy array (returns NumPy, no JAX import: grain workers stay light) or a JAX array / tracer
  (returns JAX). Documents are contiguous runs: a new run starts wherever the id changes.
  """
  if isinstance(segment_ids_BL, np.ndarray):
    xp = np
  else:
    import jax.numpy as xp  # pylint: disable=g-import-not-at-top
  L = segment_ids_BL.shape[-1]
  idx_BL = xp.broadcast_to(xp.arange(L, dtype=xp.int32), segment_ids_BL.shape)
  first_B1 = xp.ones(segment_ids_BL.shape[:-1] + (1,), dtype=bool)
  starts_BL = xp.concatenate([first_B1, segment_ids_BL[..., 1:] != segment_ids_BL[..., :-1]], axis=-1)
  # The latest run start at or before each token, by a running maximum over the start indices.
  run_start_BL = xp.maximum.accumulate(xp.where(starts_BL, idx_BL, 0), axis=-1)
  return xp.where(segment_ids_BL > 0, idx_BL - run_start_BL, 0).astype(xp.int32)
