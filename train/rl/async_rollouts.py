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

Weights. After each iteration the learner waits until the worker has made every rollout it can without the new
policy (iterations i + 1 .. i + s, `settle`), runs its stop check and checkpoint, and only then publishes the
parameters: copied to the rollout mesh (replicated on its devices; the sampler shards the batch over them) or,
sharing the devices, referenced as they are. So the worker is idle while the learner runs programs over every
device (the processes agreeing on a stop, orbax's barriers).

Processes. With several processes each keeps rl.rollout_devices of its own devices for sampling, a mesh of that
process alone: its worker samples its block of each iteration's rows there (drawing as the whole batch would), so
the worker never runs a program another process takes part in. The learner gathers the blocks (`take`,
`pending`: an all-gather over the training mesh on the learner's thread, at the same point on every process) and
counts the failed rewards there. Worker programs spanning processes beside the learner's would have to be issued
in the same order on every process, which two threads do not promise (and XLA's CPU collectives hung even with
the two meshes on different devices, measured); so several processes need rl.rollout_devices > 0.

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

from parallel import sharding as sharding_lib


def split_devices(count: int) -> tuple[list, list]:
  """(training devices, rollout devices): the last `count` local devices of each process sample (this process's,
  a mesh of its own), the rest, over all processes, train. ValueError when a process would keep no device for
  training."""
  local = jax.local_devices()
  if count >= len(local):
    raise ValueError(f"rl.rollout_devices={count} leaves none of this process's {len(local)} devices for "
                     "training; lower it (0 = rollouts on the training devices)")
  rollout_ids = {d.id for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)[-count:]}
  return [d for d in jax.devices() if d.id not in rollout_ids], local[-count:]


class Worker:
  """The rollout thread (module docstring). `publish(version, state)` after every update; `take(i)` blocks until
  iteration i's rollouts exist; `settle(j)` until those it can make before version j exists; `pending(j)` the
  rollouts made for iterations after j; `close()` stops it. take and pending gather the processes' shares: call
  them from the learner's thread, at the same points on every process."""

  def __init__(self, session, start: int, last: int, pending: dict[int, dict[str, Any]],
               rollout_mesh=None):
    self.session, self.last, self.rollout_mesh = session, last, rollout_mesh
    self.staleness = session.config.rl.max_staleness
    self.floor = start  # the oldest version this run can have: the restored one
    self.part = (jax.process_index(), jax.process_count()) if rollout_mesh is not None else (0, 1)
    self.versions: dict[int, Any] = {}
    self.results: dict[int, dict[str, Any]] = {i: rows(roll, *self.part) for i, roll in pending.items()}
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
      params = sharding_lib.to_local(params, replicated)
    with self.cond:
      self.versions[version] = {"params": params}
      for old in [v for v in self.versions if v < version - self.staleness]:
        del self.versions[old]  # no later iteration samples with it
      self.cond.notify_all()

  def take(self, iteration: int) -> dict[str, Any]:
    """Iteration `iteration`'s rollouts, every process's rows (waits for the worker; re-raises its error); their
    failed rewards are counted here."""
    self._wait([iteration])
    with self.cond:
      mine = self.results.pop(iteration)
    roll = self._whole(mine)  # (a collective: not under the lock the worker stores its results with)
    self.session.count_bad(roll["raw"], roll.get("failures", []))  # (none kept by checkpoints before 2026-12-06)
    return roll

  def settle(self, iteration: int) -> None:
    """Waits for the rollouts of iterations iteration + 1 .. iteration + s (from versions up to `iteration` - 1,
    which exist): after them the worker waits for version `iteration`."""
    self._wait(range(iteration + 1, min(iteration + self.staleness, self.last) + 1))

  def pending(self, iteration: int) -> dict[int, dict[str, Any]]:
    """The rollouts of iterations iteration + 1 .. iteration + s (`settle`), every process's rows."""
    self.settle(iteration)
    with self.cond:
      mine = {i: self.results[i] for i in range(iteration + 1, min(iteration + self.staleness, self.last) + 1)}
    return {i: self._whole(roll) for i, roll in mine.items()}

  def _wait(self, iterations) -> None:
    with self.cond:
      while any(i not in self.results for i in iterations) and self.error is None:
        self.cond.wait()
      if self.error is not None:
        raise self.error

  def _whole(self, roll: dict[str, Any]) -> dict[str, Any]:
    """Every process's share of a rollout, in process order (gathered over the training mesh)."""
    if self.part[1] == 1:
      return roll
    return concat(sharding_lib.allgather_objects(roll, self.session.mesh))

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
                                   self.session.rollout_seed(i), policy=policy, part=self.part, count=False)
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
          "turns", "lag", "failures")
  return {int(i): {k: (np.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in roll.items() if k in keep}
          for i, roll in pending.items()}


def block(n: int, k: int, K: int) -> tuple[int, int]:
  """[start, stop) of the k-th of K equal blocks of n rows (process k's share of a rollout batch)."""
  return k * n // K, (k + 1) * n // K


def rows(roll: dict[str, Any], k: int, K: int) -> dict[str, Any]:
  """The k-th of K equal blocks of a rollout's rows (per-row lists and arrays, `parts` by name; the failed
  rewards' messages go with block 0; everything else, e.g. `lag`, as it is)."""
  if K == 1:
    return roll
  a, b = block(len(roll["tokens"]), k, K)
  out = {}
  for key, v in roll.items():
    if key == "failures":
      out[key] = list(v) if k == 0 else []
    elif key == "parts":
      out[key] = {name: values[a:b] for name, values in v.items()}
    elif isinstance(v, (list, np.ndarray)):
      out[key] = v[a:b]
    else:
      out[key] = v
  return out


def concat(shares: list[dict[str, Any]]) -> dict[str, Any]:
  """One rollout from the processes' shares, in order (the inverse of `rows`; `stats`, `lag` and timings are the
  first share's)."""
  out = {}
  for key, v in shares[0].items():
    if key == "parts":
      out[key] = {name: np.concatenate([s[key][name] for s in shares]) for name in v}
    elif isinstance(v, list):
      out[key] = [x for s in shares for x in s[key]]
    elif isinstance(v, np.ndarray):
      out[key] = np.concatenate([s[key] for s in shares])
    else:
      out[key] = v
  return out
