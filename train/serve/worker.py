"""The engine's thread: one thread owns the `model.engine.Engine` and steps it while requests are pending.

Request handlers (on the server's event loop) `submit` a request and get its tokens through a callback; the
thread drains submissions and cancellations between engine steps, so the engine is only ever touched by it (JAX
calls included). Admission control happens at `submit`: a request that `Engine.check` refuses raises ValueError
at once (a 400), and one beyond `max_seqs + max_queue` pending raises `Overloaded` (a 429).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Callable, Sequence

log = logging.getLogger(__name__)

# sink(new token ids, finish reason or None): called on the engine's thread after every step that gave the
# request tokens; reason "stop" (a stop id), "length" (max tokens), "cancelled" or "error: ..." ends it.
Sink = Callable[[list[int], "str | None"], None]


class Overloaded(RuntimeError):
  """More requests pending than the server's limits admit; retry later."""


@dataclasses.dataclass
class _Pending:
  sink: Sink
  shown: int = 0  # tokens handed to the sink so far
  rid: int | None = None  # the engine's id once added


class Worker:
  """Owns `engine` on its own thread (module docstring). `scope()` is entered on that thread around the engine's
  work (the mesh and sharding rules the model was loaded under)."""

  def __init__(self, engine, *, max_queue: int, scope: Callable = None):
    self.engine = engine
    self.capacity = engine.max_seqs + max_queue
    self._scope = scope
    self._inbox: queue.Queue = queue.Queue()
    self._pending: dict[int, _Pending] = {}  # ticket -> its request (touched by the engine thread only)
    self._count = 0  # submitted and not finished (under _lock)
    self._lock = threading.Lock()
    self._tickets = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="meshlm-engine", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def submit(self, prompt: Sequence[int], max_new_tokens: int, sink: Sink, **settings) -> int:
    """Queues a request for the engine (settings: Engine.add's); returns its ticket for `cancel`. ValueError when
    the engine would refuse it, Overloaded when the server is full, RuntimeError when it is shutting down."""
    check = {k: v for k, v in settings.items() if k not in ("stop_ids", "seed", "row")}
    self.engine.check(prompt, max_new_tokens, **check)
    with self._lock:
      if self._stop.is_set():
        raise RuntimeError("the server is shutting down")
      if self._count >= self.capacity:
        raise Overloaded(f"{self._count} requests pending, the server's limit (max_seqs + max_queue = "
                         f"{self.capacity}); retry later")
      self._count += 1
      self._tickets += 1
      ticket = self._tickets
    self._inbox.put(("add", ticket, (list(prompt), int(max_new_tokens), sink, settings)))
    return ticket

  def cancel(self, ticket: int) -> None:
    """Stops a request early (a client gone, a stop string seen); its sink gets no more calls."""
    self._inbox.put(("cancel", ticket, None))

  def stop(self) -> None:
    """Ends the thread after cancelling whatever is still pending (their sinks get "cancelled")."""
    self._stop.set()
    self._inbox.put(("wake", 0, None))
    if self._thread.is_alive():
      self._thread.join()

  @property
  def pending(self) -> int:
    return self._count

  # ---- the engine's thread -----------------------------------------------------------------------------
  def _run(self) -> None:
    if self._scope is None:
      self._loop()
    else:
      with self._scope():
        self._loop()

  def _loop(self) -> None:
    while not self._stop.is_set():
      self._drain(block=not self.engine.busy())
      if self._stop.is_set() or not self.engine.busy():
        continue
      try:
        finished = {r.rid: r for r in self.engine.step()}
      except Exception as e:  # pylint: disable=broad-except  (fail the requests, keep serving)
        log.exception("engine step failed")
        self._fail_all(f"error: the engine failed ({type(e).__name__}: {e})")
        continue
      self._deliver(finished)
    self._fail_all("cancelled")

  def _drain(self, block: bool) -> None:
    try:
      item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      self._handle(*item)
      try:
        item = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _handle(self, kind: str, ticket: int, payload) -> None:
    if kind == "add":
      prompt, max_new_tokens, sink, settings = payload
      pending = _Pending(sink)
      try:
        pending.rid = self.engine.add(prompt, max_new_tokens, **settings)
      except ValueError as e:  # checked at submit; kept for a race with a config change
        self._finish(pending, [], f"error: {e}")
        return
      self._pending[ticket] = pending
    elif kind == "cancel" and ticket in self._pending:
      pending = self._pending.pop(ticket)
      self.engine.cancel(pending.rid)
      self._release()

  def _deliver(self, finished: dict) -> None:
    """Hands every pending request its new tokens; the finished ones (rid -> Request) also their reason."""
    for ticket, pending in list(self._pending.items()):
      request = self.engine.live.get(pending.rid) or finished.get(pending.rid)
      new = request.tokens[pending.shown:]
      pending.shown += len(new)
      if request.done:
        del self._pending[ticket]
        self._finish(pending, new, "stop" if request.tokens[-1] in request.stop_ids else "length")
      elif new:
        pending.sink(new, None)

  def _finish(self, pending: _Pending, tokens: list[int], reason: str) -> None:
    try:
      pending.sink(tokens, reason)
    finally:
      self._release()

  def _release(self) -> None:
    with self._lock:
      self._count -= 1

  def _fail_all(self, reason: str) -> None:
    for ticket, pending in list(self._pending.items()):
      del self._pending[ticket]
      if pending.rid is not None:
        self.engine.cancel(pending.rid)
      self._finish(pending, [], reason)
