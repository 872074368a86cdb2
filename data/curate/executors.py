"""Executors run one per-shard function over many shards and return the results in shard order.

`LocalExecutor` uses a multiprocessing pool (or this process when num_workers == 1); `RayExecutor` submits the
same function as Ray tasks. Shard functions take plain picklable arguments and write their own output files, so
both executors produce identical results.
"""
from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable, Sequence


class LocalExecutor:
  """Runs shards in `num_workers` processes (spawned, so no state leaks in from the parent); 0 = CPU count.
  The pool starts on the first `map` and serves every pass until `close()`."""

  def __init__(self, num_workers: int = 0):
    self.num_workers = num_workers or os.cpu_count() or 1
    self._pool = None

  def map(self, fn: Callable, args: Sequence[tuple]) -> list[Any]:
    if self.num_workers == 1 or len(args) <= 1:
      return [fn(*a) for a in args]
    if self._pool is None:
      self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers)
    return self._pool.starmap(fn, args, chunksize=1)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool.join()
      self._pool = None


class RayExecutor:
  """Runs shards as Ray tasks (one CPU each) on the cluster at `address` ("" = a local Ray runtime, or the one
  already initialised in this process)."""

  def __init__(self, address: str = ""):
    try:
      import ray
    except ImportError:
      raise ImportError("executor=ray needs Ray: pip install -c constraints.txt 'ray[default]' "
                        "(or use --config.executor=local)") from None
    self._ray = ray
    if not ray.is_initialized():
      ray.init(address=address or None, include_dashboard=False, log_to_driver=False)

  def map(self, fn: Callable, args: Sequence[tuple]) -> list[Any]:
    remote = self._ray.remote(num_cpus=1, max_retries=3)(fn)
    return self._ray.get([remote.remote(*a) for a in args])

  def close(self) -> None:
    """Leaves the Ray runtime up: it may serve other work in this process."""


def make_executor(cfg) -> LocalExecutor | RayExecutor:
  """From the curation config's `executor`, `num_workers` and `ray_address`."""
  if cfg.executor == "local":
    return LocalExecutor(cfg.num_workers)
  if cfg.executor == "ray":
    return RayExecutor(cfg.ray_address)
  raise ValueError(f"executor {cfg.executor!r} unknown; use local or ray")
