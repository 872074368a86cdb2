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
  """Runs shards in `num_workers` processes (spawned, so no state leaks in from the parent); 0 = CPU count."""

  def __init__(self, num_workers: int = 0):
    self.num_workers = num_workers or os.cpu_count() or 1

  def map(self, fn: Callable, args: Sequence[tuple]) -> list[Any]:
    if self.num_workers == 1 or len(args) <= 1:
      return [fn(*a) for a in args]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(self.num_workers, len(args))) as pool:
      return pool.starmap(fn, args, chunksize=1)


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


def make_executor(cfg) -> LocalExecutor | RayExecutor:
  """From the curation config's `executor`, `num_workers` and `ray_address`."""
  if cfg.executor == "local":
    return LocalExecutor(cfg.num_workers)
  if cfg.executor == "ray":
    return RayExecutor(cfg.ray_address)
  raise ValueError(f"executor {cfg.executor!r} unknown; use local or ray")
