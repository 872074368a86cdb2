"""The lifecycle on several hosts: the same `python -m train.lifecycle` command on every host of a pod.

Each host's process learns its place from the launcher's environment (the JAX_*, SLURM, Open MPI or Cloud TPU
variables its training children read too: `parallel.distributed.process_of_environment`). Process 0 leads: it
alone keeps WORKDIR/lifecycle.json and the report, decides what each stage does, and runs the single-host stages
(curate, tokenizer, evaluate, export) while the others wait. A training stage runs on every host at once: process
0 sends its command to the others, each host starts it as its child (the existing multi-host program, which
joins jax.distributed from the same environment), and the stage has finished when every host's child has; its
exit code is the first nonzero one. WORKDIR must be the same shared directory on every host, as for any
multi-host run.

The processes talk over one TCP connection each to process 0 (`lifecycle.pod_address`, default: the JAX
coordinator's host at its port + 1), in JSON lines:
  follower -> leader  {"hello": id, "digests", "sequence", "workdir", "from", "only"}  (must equal the leader's)
  leader -> follower  {"ok": true} | {"error": message}
  leader -> follower  {"stage": name, "action": "skip" | "process 0"}          (for the follower's log)
  leader -> follower  {"run": name, "argv": [...]}  ->  follower -> leader  {"rc": code}
  leader -> follower  {"end": code}
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Callable

from parallel import distributed

_TPU_COORDINATOR_PORT = 8476  # jax's default coordinator port on Cloud TPU


class PodError(ValueError):
  """The hosts cannot run together (different arguments, none reachable): the message says which and the fix."""


def say(process: int, message: str) -> None:
  print(f"[lifecycle process {process}] {message}", flush=True)


def address(section, env=None) -> tuple[str, int]:
  """(host, port) where process 0 listens: `lifecycle.pod_address`, else JAX_COORDINATOR_ADDRESS's host at its
  port + 1, else the first of TPU_WORKER_HOSTNAMES at jax's TPU coordinator port + 1."""
  env = os.environ if env is None else env
  given = section.get("pod_address", "")
  if given:
    host, _, port = given.rpartition(":")
    if not host or not port.isdigit():
      raise PodError(f"lifecycle.pod_address={given!r}: give HOST:PORT (process 0's host, a free port)")
    return host, int(port)
  coordinator = env.get("JAX_COORDINATOR_ADDRESS", "")
  if coordinator:
    host, _, port = coordinator.rpartition(":")
    if host and port.isdigit():
      return host.strip("[]"), int(port) + 1
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if hosts:
    return hosts[0].strip(), _TPU_COORDINATOR_PORT + 1
  raise PodError("this process is one of several (the launcher's environment says so) but process 0's address is "
                 "unknown: set JAX_COORDINATOR_ADDRESS or --config.lifecycle.pod_address=HOST:PORT")


def single_host_env() -> dict[str, str]:
  """The environment for a single-host stage's child on process 0: without the launcher's cluster variables, so
  it does not wait for the other hosts to join."""
  return {k: v for k, v in os.environ.items() if k not in distributed.LAUNCHER_VARIABLES}


class _Channel:
  """JSON lines over one socket."""

  def __init__(self, sock: socket.socket):
    sock.settimeout(None)
    self.sock = sock
    self.file = sock.makefile("rw", encoding="utf-8")

  def send(self, message: dict) -> None:
    self.file.write(json.dumps(message) + "\n")
    self.file.flush()

  def recv(self) -> dict | None:
    """The next message; None when the other side has gone."""
    try:
      line = self.file.readline()
    except OSError:
      return None
    return json.loads(line) if line else None

  def close(self) -> None:
    for closing in (self.file.close, self.sock.close):
      try:
        closing()
      except OSError:
        pass


class Pod:
  """This process's place on the pod and its connections (process 0: one per follower; a follower: process 0)."""

  def __init__(self, process: int, count: int, channels: dict[int, _Channel]):
    self.process, self.count, self.channels = process, count, channels

  @property
  def leader(self) -> bool:
    return self.process == 0

  def tell(self, message: dict) -> None:
    for channel in self.channels.values():
      try:
        channel.send(message)
      except OSError:
        pass  # a follower that went away is found when its exit code is read

  def run_everywhere(self, stage: str, argv: list[str], run: Callable[[list[str]], int]) -> int:
    """Process 0: `argv` on every host at once (this one by `run`); the first nonzero exit code, else 0."""
    self.tell({"run": stage, "argv": argv})
    codes = [run(argv)]
    for process, channel in sorted(self.channels.items()):
      reply = channel.recv()
      if reply is None:
        say(0, f"{stage}: process {process} went away before its command ended")
      codes.append(1 if reply is None else int(reply["rc"]))
      if codes[-1]:
        say(0, f"{stage}: process {process}'s command ended with exit {codes[-1]}")
    return next((c for c in codes if c), 0)

  def close(self, code: int) -> None:
    self.tell({"end": code})
    for channel in self.channels.values():
      channel.close()


def _hello(process: int, digests: dict, sequence: list[str], workdir: str, args) -> dict:
  return {"hello": process, "digests": digests, "sequence": sequence, "workdir": workdir,
          "from": args.from_, "only": args.only}


def _accept(listener: socket.socket, count: int, deadline: float, mine: dict) -> dict[int, _Channel]:
  channels: dict[int, _Channel] = {}
  while len(channels) < count - 1:
    listener.settimeout(max(0.1, deadline - time.monotonic()))
    try:
      sock, _ = listener.accept()
    except socket.timeout:
      missing = sorted(set(range(1, count)) - set(channels))
      raise PodError(f"process 0 waited for processes {missing} to connect to port {listener.getsockname()[1]}: "
                     "start the same `python -m train.lifecycle` command on every host (lifecycle.pod_timeout_s "
                     "is the wait)") from None
    channel = _Channel(sock)
    sock.settimeout(max(1.0, deadline - time.monotonic()))  # a connection that never says who it is
    try:
      theirs = channel.recv() or {}
    except ValueError:  # not JSON lines: not a lifecycle process
      theirs = {}
    sock.settimeout(None)
    if not isinstance(theirs, dict) or "hello" not in theirs:  # silent, timed out or a stranger: keep waiting
      channel.close()
      continue
    problem = _mismatch(theirs, mine, count, channels)
    if problem:
      for other in [*channels.values(), channel]:
        other.send({"error": problem})
      raise PodError(problem)
    channels[theirs["hello"]] = channel
  return channels


def _mismatch(theirs: dict, mine: dict, count: int, channels: dict) -> str:
  process = theirs.get("hello")
  if not isinstance(process, int) or not 0 < process < count or process in channels:
    return f"a connection to process 0 said it is process {process!r}; expected one of 1..{count - 1}, once each"
  for key in ("sequence", "workdir", "from", "only", "digests"):
    if theirs.get(key) != mine[key]:
      what = {"digests": "stage settings (config, overrides or recipe files)"}.get(key, key)
      stages = ([s for s in mine["digests"] if mine["digests"][s] != (theirs.get("digests") or {}).get(s)]
                if key == "digests" else [])
      return (f"process {process}'s {what} differ from process 0's" + (f" in stages {stages}" if stages else "")
              + f" ({theirs.get(key)!r} vs {mine[key]!r})" * (key != "digests")
              + ": run the same command, config and files on every host")
  return ""


def _connect(host: str, port: int, deadline: float, process: int) -> _Channel:
  while True:
    try:
      return _Channel(socket.create_connection((host, port), timeout=5))
    except OSError:
      if time.monotonic() > deadline:
        raise PodError(f"process {process} could not reach process 0 at {host}:{port}: start the same command on "
                       "process 0's host, or set lifecycle.pod_address") from None
      time.sleep(0.5)


def join(section, digests: dict, sequence: list[str], workdir: str, args) -> Pod | None:
  """Every process's connection to the others, or None when this is the only process. Raises PodError when the
  hosts do not run the same thing (nothing has run then)."""
  place = distributed.process_of_environment()
  if place is None or place[1] == 1:
    return None
  process, count = place
  host, port = address(section)
  deadline = time.monotonic() + section.get("pod_timeout_s", 900)
  mine = _hello(process, digests, sequence, workdir, args)
  if process == 0:
    with socket.create_server(("", port), backlog=count) as listener:
      return Pod(0, count, _accept(listener, count, deadline, mine))
  channel = _connect(host, port, deadline, process)
  channel.send(mine)
  answer = channel.recv() or {"error": "process 0 closed the connection"}
  if "error" in answer:
    channel.close()
    raise PodError(answer["error"])
  return Pod(process, count, {0: channel})


def accepted(pod: Pod) -> None:
  """Process 0: every follower may go on (their arguments matched)."""
  pod.tell({"ok": True})


def follow(pod: Pod, run: Callable[[list[str]], int]) -> int:
  """A follower: runs what process 0 sends until it ends; returns process 0's exit code."""
  channel = pod.channels[0]
  while True:
    message = channel.recv()
    if message is None:
      say(pod.process, "process 0 went away; run the same command on every host to resume")
      return 1
    if "end" in message:
      say(pod.process, f"process 0 ended with exit {message['end']}; its report is in the workdir")
      return int(message["end"])
    if "stage" in message:
      say(pod.process, f"{message['stage']}: {message['action']}")
    elif "run" in message:
      say(pod.process, f"{message['run']}: start, on every host")
      rc = run(message["argv"])
      say(pod.process, f"{message['run']}: ended with exit {rc}")
      try:
        channel.send({"rc": rc})
      except OSError:
        say(pod.process, "process 0 went away; run the same command on every host to resume")
        return rc or 1
