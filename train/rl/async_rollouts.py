"""Asynchronous rollouts for `python -m train.rl` (rl.async_rollouts): a worker thread samples while the learner
trains, on a mesh of its own (rl.rollout_devices) or on the learner's devices.

Schedule. Policy version k is the policy after k iterations' updates (version 0: the start). The rollouts of
iteration i come from version max(0, i - 1 - s), s = rl.max_staleness, so the worker runs up to s iterations
ahead of the learner, which trains on iteration i's rollouts once they are done: with s = 0 that is version i - 1,
the synchronous loop's policy, and the run equals it. Every iteration's prompts and sampling seeds are the
synchronous loop's (`Session._prompts_for`, `seed_for`), so nothing depends on thread timing. The learner
recomputes the old log-probs with its own (newer) policy and, where the sampler's policy lagged, weights each
token's clipped term by the truncated importance ratio min(exp(old_logp - sampler_logp), rl.tis_cap)
(train/objectives/policy.py), logged with the policy lag (`policy_lag`: versions between the sampler's policy and
the learner's; with no lag the two log-probs differ by rounding only, left uncorrected as in the synchronous
loop).

Weights. After each iteration the learner publishes its parameters: copied to the rollout mesh (replicated on its
devices; the sampler shards the batch over them) or, sharing the devices, referenced as they are.

Checkpoints. A checkpoint at iteration j carries the rollouts already made for iterations j + 1 .. j + s
(`pending`, written beside it by the loop); a resumed run reloads them and goes on with the schedule above, so it
repeats the uninterrupted run exactly. Only when that file is missing (a checkpoint written by a synchronous run)
are they made again from the restored policy.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import jax
import numpy as np


def split_devices(count: int) -> tuple[list, list]:
  """(training devices, rollout devices): the last `count` local devices of every process sample, the rest
  train. ValueError when a process would keep no device for training."""
  local = jax.local_devices()
  if count >= len(local):
    raise ValueError(f"rl.rollout_devices={count} leaves none of this process's {len(local)} devices for "
                     "training; lower it (0 = rollouts on the training devices)")
  rollout_ids = {d.id for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[-count:]}
  train = [d for d in jax.devices() if d.id not in rollout_ids]
  return train, [d for d in jax.devices() if d.id in rollout_ids]


class Worker:
  """The rollout thread (module docstring). `publish(version, state)` after every update; `take(i)` blocks until
  iteration i's rollouts exist; `pending(j)` the rollouts made for iterations after j; `close()` stops it."""

  def __init__(self, session, start: int, last: int, pending: dict[int, dict[str, Any]],
               rollout_mesh=None):
    self.session, self.last, self.rollout_mesh = session, last, rollout_mesh
    self.staleness = session.config.rl.max_staleness
    self.floor = start  # the oldest version this run can have: the restored one
    self.versions: dict[int, Any] = {}
    self.results: dict[int, dict[str, Any]] = dict(pending)
    self.error: BaseException | None = None
    self.stopped = False
    self.cond = threading.Condition()
    self.thread = threading.Thread(target=self._loop, args=(start + 1 + len(pending),), daemon=True,
                                   name="rl-rollouts")
    self.thread.start()

  def publish(self, version: int, state) -> None:
    """Makes policy `version` (the learner's state after `version` iterations) available to the sampler."""
    params = state["params"]
    if self.rollout_mesh is not None:
      replicated = jax.sharding.NamedSharding(self.rollout_mesh, jax.sharding.PartitionSpec())
      params = jax.device_put(params, replicated)
    with self.cond:
      self.versions[version] = {"params": params}
      for old in [v for v in self.versions if v < version - self.staleness]:
        del self.versions[old]  # no later iteration samples with it
      self.cond.notify_all()

  def take(self, iteration: int) -> dict[str, Any]:
    """Iteration `iteration`'s rollouts (waits for the worker; re-raises its error)."""
    with self.cond:
      while iteration not in self.results and self.error is None:
        self.cond.wait()
      if self.error is not None:
        raise self.error
      return self.results.pop(iteration)

  def pending(self, iteration: int) -> dict[int, dict[str, Any]]:
    """The rollouts of iterations iteration + 1 .. iteration + s, waiting for the ones in progress (they come from
    versions up to `iteration` - 1, which exist)."""
    want = range(iteration + 1, min(iteration + self.staleness, self.last) + 1)
    with self.cond:
      while any(i not in self.results for i in want) and self.error is None:
        self.cond.wait()
      if self.error is not None:
        raise self.error
      return {i: self.results[i] for i in want}

  def close(self) -> None:
    with self.cond:
      self.stopped = True
      self.cond.notify_all()
    self.thread.join()

  def _loop(self, first: int) -> None:
    r = self.session.config.rl
    try:
      for i in range(first, self.last + 1):
        version = max(self.floor, i - 1 - self.staleness)
        with self.cond:
          while version not in self.versions and not self.stopped:
            self.cond.wait()
          if self.stopped:
            return
          policy = (self.versions[version], self.rollout_mesh)
        t0 = time.perf_counter()
        roll = self.session.sample(self.session._prompts_for(i), r.samples_per_prompt,  # pylint: disable=protected-access
                                   self.session.rollout_seed(i), policy=policy)
        roll["lag"], roll["worker_seconds"] = float(i - 1 - version), time.perf_counter() - t0
        with self.cond:
          self.results[i] = roll
          self.cond.notify_all()
    except BaseException as e:  # pylint: disable=broad-except  (handed to the learner by take / pending)
      with self.cond:
        self.error = e
        self.cond.notify_all()


def encode(pending: dict[int, dict[str, Any]]) -> dict[str, Any]:
  """Pending rollouts as a picklable dict of plain lists and arrays (generation stats dropped)."""
  keep = ("prompt_ids", "tokens", "logprobs", "masks", "raw", "shaped", "valid", "ended", "lengths", "parts",
          "turns", "lag")
  return {int(i): {k: (np.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in roll.items() if k in keep}
          for i, roll in pending.items()}
