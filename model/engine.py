"""The inference engine: continuous batching over a paged KV cache, with chunked prefill and preemption.

    engine = Engine(model, max_seqs=8, page_size=16, num_pages=None, chunk=64, max_len=None)
    rid = engine.add(prompt_ids, max_new_tokens, stop_ids=(), temperature=0.0, seed=0)
    finished = engine.step()          # one iteration; the requests that finished in it
    engine.generate(prompts, max_new_tokens, ...) -> list[list[int]]   (add all, step until done)

Design (docs/serve.md):
  - Pages: one pool of `num_pages` pages of `page_size` slots per layer (model/paged.py; page 0 is scratch), a
    page table per sequence slot, pages taken from a free list as a sequence grows and returned when it finishes.
  - Scheduler: every `step` admits waiting requests into free sequence slots (first come, first served), then runs
    one forward over all running sequences: each feeds its next uncached tokens, one for a decoding sequence, up
    to `chunk` of a prompt for a prefilling one (chunked prefill: a chunk attends to the tokens cached before it),
    so requests join and leave at every step and a long prompt never stalls the others' decoding for more than a
    chunk. Two compiled shapes only, [max_seqs, 1] and [max_seqs, chunk]: nothing recompiles as traffic changes.
  - Preemption by recomputation: when a step needs pages the pool does not have, the most recently admitted
    sequence gives its pages back and waits at the head of the queue with its prompt and the tokens generated so
    far, which it prefills again when readmitted (greedy output unchanged), never an out-of-memory error.
  - Tokens: greedy (temperature 0: the argmax) or sampled from softmax(logits / temperature) with the request's
    key fold_in(fold_in(PRNGKey(seed), row), i) for its i-th token (model.generate's for that row), so a
    request's output does not depend on the traffic around it. Each request also records log p(token) under softmax(logits / max(temperature, 1 if greedy)) as
    `model.generate.sample` does.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import config as config_lib
from model import generate as generate_lib
from model import paged


@dataclasses.dataclass
class Request:
  """One generation request and its progress (host side)."""
  rid: int
  prompt: list[int]
  max_new_tokens: int
  stop_ids: tuple[int, ...] = ()
  temperature: float = 0.0
  top_k: int = 0  # the warps of model.generate.warp_logits (0, 1.0, 0.0 = off) and its repetition penalty (1 = off)
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  seed: int = 0
  row: int = 0  # with seed, the key of its i-th draw: fold_in(fold_in(PRNGKey(seed), row), i), as model.generate's
  tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
  logprobs: list[float] = dataclasses.field(default_factory=list)
  cached: int = 0  # tokens of prompt + tokens in the cache
  pages: list[int] = dataclasses.field(default_factory=list)
  hashes: list[int] = dataclasses.field(default_factory=list)  # of its full prompt pages, chained (prefix cache)
  drafts: list[int] = dataclasses.field(default_factory=list)  # proposed after its last token this step
  mtp_next: int | None = None  # the multi-token head's guess at the token after its newest one (draft="mtp")
  preemptions: int = 0
  done: bool = False

  @property
  def sequence(self) -> list[int]:
    return self.prompt + self.tokens

  @property
  def plain(self) -> bool:
    """Whether its tokens come from softmax(logits / temperature) alone (no warp, no penalty): what speculative
    decoding's acceptance rule verifies."""
    return (self.top_k, self.top_p, self.min_p, self.repetition_penalty) == (0, 1.0, 0.0, 1.0)


def _forward(graphdef, state, k, v, tokens_ST, segment_ids_ST, positions_ST, table_SP, length_S, last_S,
             seed_S, row_S, index_S, temperature_S, *, window: int, warps: tuple[int, float, float], kernel: str,
             hidden: bool):
  """One engine call: the model over [S, T] tokens into the paged cache -> (logits [S, window, V] float32 of each
  row's tokens at indices last_S - window + 1 .. last_S (clipped at 0), picks, the updated pools, and with `hidden`
  the features before the final norm [S, T, D] (the multi-token head's input; else None)). picks: (each row's next
  token [S] and its log-probability [S] picked on the device from the logits at last_S, and the argmax [S, window]
  of every window position with its log-probability, what greedy verification of drafts needs).

  The pick is model.generate.choose's without a repetition penalty: the argmax where temperature_S is 0, else a
  draw from softmax(warp_logits(logits / temperature, *warps)) with the key fold_in(fold_in(PRNGKey(seed), row),
  index); log p under softmax(logits / temperature) (1 when greedy)."""
  model = nnx.merge(graphdef, state)
  cache = paged.PagedKVCache(k, v, table_SP, length_S, kernel=kernel)
  x_STD, cache = model.features(tokens_ST, segment_ids_ST, positions_ST, cache=cache, normed=not hidden)
  h_STD = x_STD if hidden else None
  x_STD = model.final_norm(x_STD) if hidden else x_STD
  index_SW = jnp.maximum(last_S[:, None] - window + 1 + jnp.arange(window)[None, :], 0)
  x_SWD = jnp.take_along_axis(x_STD, index_SW[:, :, None], axis=1)
  logits_SWV = model.logits(x_SWD)
  last_SV = logits_SWV[:, -1]
  greedy_S = temperature_S == 0
  scaled_SV = last_SV / jnp.where(greedy_S, jnp.float32(1), temperature_S)[:, None]
  keys_S = jax.vmap(lambda s, r, i: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), r), i))(
      seed_S, row_S, index_S)
  drawn_S = jax.vmap(jax.random.categorical)(keys_S, generate_lib.warp_logits(scaled_SV, 1.0, *warps))
  token_S = jnp.where(greedy_S, jnp.argmax(last_SV, axis=-1), drawn_S).astype(jnp.int32)
  logp_S = jnp.take_along_axis(jax.nn.log_softmax(scaled_SV, axis=-1), token_S[:, None], axis=-1)[:, 0]
  best_SW = jnp.argmax(logits_SWV, axis=-1).astype(jnp.int32)
  best_logp_SW = jnp.max(jax.nn.log_softmax(logits_SWV, axis=-1), axis=-1)
  return logits_SWV, (token_S, logp_S, best_SW, best_logp_SW), cache.k, cache.v, h_STD


@functools.lru_cache(maxsize=None)
def _jitted_forward(window: int, warps: tuple[int, float, float] = (0, 1.0, 0.0), kernel: str = "xla",
                    hidden: bool = False):
  """`_forward` jitted once per logits window, warps, decode kernel and features output: engines of the same
  shapes share their compilations (callers pass all four positionally: the cache keys on how they are passed)."""
  return jax.jit(functools.partial(_forward, window=window, warps=warps, kernel=kernel, hidden=hidden),
                 donate_argnums=(2, 3))


@functools.partial(jax.jit, donate_argnums=(2, 3))
def _mtp_forward(graphdef, state, k, v, h_STD, ahead_ST, segment_ids_ST, positions_ST, table_SP, length_S, last_S):
  """The first multi-token head over one call's positions (`Transformer.mtp_step`, its one-layer pools k, v): the
  entry of position j (h_j and the token at j + 1) written at slot j -> (the greedy guess [S] at the token two
  places after position last_S of each row, the updated pools)."""
  model = nnx.merge(graphdef, state)
  x_STD, cache = model.mtp_step(h_STD, ahead_ST, segment_ids_ST, positions_ST,
                                paged.PagedKVCache(k, v, table_SP, length_S))
  x_S1D = jnp.take_along_axis(x_STD, last_S[:, None, None], axis=1)
  return jnp.argmax(model.logits(x_S1D)[:, 0], axis=-1).astype(jnp.int32), cache.k, cache.v


def decode_kernel(cfg, attention: str) -> str:
  """The paged cache's decode attention (`paged.PagedKVCache.kernel`) for engine attention="auto" | "xla" |
  "pallas": auto runs the Pallas TPU kernel on TPUs where it applies (no layer windowed: the kernel has no
  window) and the XLA gather elsewhere; "pallas" off TPU runs the kernel in interpret mode. ValueError naming the
  reason where "pallas" cannot apply (sliding windows, MLA's latent cache)."""
  from model import splash as splash_lib  # pylint: disable=g-import-not-at-top
  if attention not in ("auto", "xla", "pallas"):
    raise ValueError(f"Engine: attention={attention!r} must be 'auto', 'xla' or 'pallas'")
  on_tpu = splash_lib.target_platform() == "tpu"
  windowed, latent = any(config_lib.layer_windows(cfg)), cfg.attention_type == "mla"
  if attention == "pallas" and (windowed or latent):
    raise ValueError("Engine: attention='pallas' (the paged decode kernel) has no sliding window and reads per-head "
                     f"keys and values, and this model has {'windowed layers' if windowed else 'latent attention'}; "
                     "use attention='xla' or 'auto'")
  if attention == "pallas":
    return "pallas" if on_tpu else "interpret"
  return "pallas" if attention == "auto" and on_tpu and not (windowed or latent) else "xla"


def ngram_drafts(sequence: Sequence[int], n: int, k: int) -> list[int]:
  """Prompt-lookup drafts: the up to k tokens that followed the latest earlier occurrence of the sequence's last n
  tokens ([] when they never occurred before)."""
  if k < 1 or len(sequence) <= n:
    return []
  tail = list(sequence[-n:])
  for start in range(len(sequence) - n - 1, -1, -1):
    if list(sequence[start:start + n]) == tail:
      return list(sequence[start + n:start + n + k])
  return []


class Engine:
  """Continuous batching over a paged KV cache for one `model.Transformer` (module docstring)."""

  def __init__(self, model, *, max_seqs: int = 8, page_size: int = 16, num_pages: int | None = None,
               chunk: int = 64, max_len: int | None = None, prefix_caching: bool = True, speculative: int = 0,
               ngram: int = 2, draft=None, prefill_seqs: int = 4, attention: str = "auto"):
    cfg = model.cfg
    self.max_len = int(max_len or cfg.max_seq_len)
    self._len_name = f"the engine's max_len={self.max_len}" if max_len else f"model.max_seq_len={self.max_len}"
    if min(max_seqs, page_size, chunk, self.max_len) < 1:
      raise ValueError(f"Engine: max_seqs={max_seqs}, page_size={page_size}, chunk={chunk} and max_len="
                       f"{self.max_len} must all be >= 1")
    self.max_seqs, self.page_size, self.chunk = max_seqs, page_size, chunk
    if prefill_seqs < 1:
      raise ValueError(f"Engine: prefill_seqs={prefill_seqs} (sequences prefilling per step) must be >= 1")
    self.prefill_seqs = min(prefill_seqs, max_seqs)
    self.mtp = None  # the multi-token head's one-layer pools when it drafts (draft="mtp")
    if isinstance(draft, str):
      if draft != "mtp" or not cfg.mtp_depth or speculative != 1:
        raise ValueError(f"Engine: draft={draft!r}: a draft is a smaller model or 'mtp', the model's first "
                         "multi-token head proposing one token per step, which needs model.mtp_depth >= 1 (this "
                         f"model: {cfg.mtp_depth}) and speculative=1 (got {speculative})")
      draft, self.mtp = None, ()
    if speculative < 0 or (speculative and (ngram < 1 or speculative >= chunk)):
      raise ValueError(f"Engine: speculative={speculative} draft tokens need 1 <= speculative < chunk={chunk} and "
                       f"ngram={ngram} >= 1 (0 = no speculative decoding)")
    self.speculative, self.ngram = speculative, ngram
    self.vocab_size = cfg.vocab_size
    if draft is not None and (not speculative or draft.cfg.vocab_size != cfg.vocab_size or
                              draft.cfg.max_seq_len < self.max_len):
      raise ValueError(f"Engine: a draft model needs speculative >= 1 (got {speculative}), the target's vocabulary "
                       f"({cfg.vocab_size}; the draft has {draft.cfg.vocab_size}) and max_seq_len >= max_len="
                       f"{self.max_len} (the draft's: {draft.cfg.max_seq_len})")
    # The calls' (rows, width): decode steps and verification of speculative drafts over every sequence slot, and
    # prompt chunks of up to prefill_seqs sequences (so a prompt chunk costs its own tokens, not a chunk per slot).
    # Prompt chunks come in widths chunk / 4, chunk / 2 and chunk, the narrowest that holds the step's longest.
    self.prefill_widths = sorted({max(1, chunk // 4), max(1, chunk // 2), chunk})
    # Decode calls take as many rows as sequences decode, rounded up to a power of two (at most max_seqs): the
    # long tail of a few long completions does not pay for every slot.
    self.decode_rows = sorted({min(1 << i, max_seqs) for i in range(max(max_seqs - 1, 0).bit_length() + 1)})
    self.shapes = sorted({(r, w) for r in self.decode_rows for w in ({1, speculative + 1} if speculative else {1})}
                         | {(self.prefill_seqs, w) for w in self.prefill_widths})
    self.pages_per_seq = math.ceil(self.max_len / page_size)
    windows = config_lib.layer_windows(cfg)
    # Every layer windowed: pages wholly before the window of a sequence's next query are freed as it advances.
    self.window = max(windows) if windows and all(w > 0 for w in windows) else 0
    held = self.pages_per_seq  # the most pages one sequence holds at once
    if self.window:
      held = min(held, math.ceil((self.window - 1 + chunk) / page_size) + 1)
    num_pages = num_pages or max_seqs * self.pages_per_seq + 1
    if num_pages - 1 < held:
      raise ValueError(f"Engine: num_pages={num_pages} holds fewer than one sequence of max_len={self.max_len} "
                       f"({held} pages of {page_size} and the scratch page); raise num_pages")
    self.graphdef, self.state = nnx.split(model)
    self.kernel = decode_kernel(cfg, attention)
    self.num_pages = num_pages
    self.k, self.v = paged.pools(cfg, num_pages, page_size)
    # A draft model keeps its own pools under the same page tables: every call feeds it the target's tokens.
    self.draft = None if draft is None else (*nnx.split(draft), *paged.pools(draft.cfg, num_pages, page_size))
    if self.mtp is not None:  # its entry at position j needs the token at j + 1: a page is shared (prefix cache)
      # only between prompts that also agree on the token after it
      self.mtp = paged.pools(cfg, num_pages, page_size, layers=1)
    self._lookahead = int(self.mtp is not None)
    self.free = list(range(num_pages - 1, paged.SCRATCH, -1))  # a stack: page 1 first
    self.prefix_caching = prefix_caching
    self.refs: collections.Counter[int] = collections.Counter()  # page -> sequences holding it
    self.by_hash: dict[int, int] = {}  # prefix hash -> the page holding that full page of prompt
    self.page_hash: dict[int, int] = {}
    self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld: LRU first
    self.slots: list[Request | None] = [None] * max_seqs
    self.waiting: collections.deque[Request] = collections.deque()
    self.live: dict[int, Request] = {}  # rid -> its request, from `add` until it finishes or is cancelled
    self._next_id = 0
    self.stats = {"steps": 0, "preemptions": 0, "tokens_fed": 0, "prefix_hit_tokens": 0, "drafted": 0,
                  "accepted": 0, "window_freed_pages": 0, "calls": 0}

  # ---- requests ----------------------------------------------------------------------------------------
  def add(self, prompt: Sequence[int], max_new_tokens: int, *, stop_ids: Sequence[int] = (),
          temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
          repetition_penalty: float = 1.0, seed: int = 0, row: int = 0) -> int:
    """Queues a request; returns its id (its progress: `live[id]` until it finishes). The sampling settings are
    model.generate.sample's. ValueError (`check`) when it cannot fit max_len, asks for nothing or a setting is out
    of range."""
    self.check(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
               repetition_penalty=repetition_penalty)
    request = Request(self._next_id, [int(t) for t in prompt], int(max_new_tokens), tuple(stop_ids),
                      float(temperature), int(top_k), float(top_p), float(min_p), float(repetition_penalty),
                      int(seed), int(row))
    self._next_id += 1
    self.waiting.append(request)
    self.live[request.rid] = request
    return request.rid

  def check(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0) -> None:
    """ValueError naming the problem when `add` would refuse the request (reads nothing that steps change, so
    another thread may call it while the engine runs)."""
    if not len(prompt) or max_new_tokens < 1:
      raise ValueError(f"a request needs a non-empty prompt and max_new_tokens >= 1 (got {len(prompt)} prompt "
                       f"tokens, max_new_tokens={max_new_tokens})")
    if len(prompt) + max_new_tokens > self.max_len:
      raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                       f"{self._len_name}; shorten the prompt or lower max_new_tokens")
    if not temperature >= 0:
      raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if top_k < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1 or not 0 < repetition_penalty < float("inf"):
      raise ValueError(f"top_k={top_k} must be >= 0, top_p={top_p} in (0, 1], min_p={min_p} in [0, 1] and "
                       f"repetition_penalty={repetition_penalty} > 0")
    if any(not 0 <= int(t) < self.vocab_size for t in prompt):
      raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size}) (the model's vocabulary)")

  def cancel(self, rid: int) -> None:
    """Drops request rid (waiting or running; its pages go back); nothing when it already finished."""
    request = self.live.pop(rid, None)
    if request is None:
      return
    request.done = True
    if request in self.waiting:
      self.waiting.remove(request)
    for s, r in enumerate(self.slots):
      if r is request:
        self._release(s)

  def busy(self) -> bool:
    return bool(self.waiting) or any(r is not None for r in self.slots)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """Every prompt's continuation (as `model.generate`): all queued at once, stepped until done."""
    ids = [self.add(p, max_new_tokens, **kwargs) for p in prompts]
    out = {}
    while self.busy():
      out.update({r.rid: r.tokens for r in self.step()})
    return [out[i] for i in ids]

  # ---- one iteration -----------------------------------------------------------------------------------
  def step(self) -> list[Request]:
    """Admits waiting requests, feeds every running sequence its next tokens (module docstring), picks the next
    token where a sequence is fully cached; returns the requests that finished."""
    self._admit()
    feed = self._plan()
    if not feed:
      return []
    decode = {s: n for s, n in feed.items() if not self._prefilling_tokens(self.slots[s])}
    prefill = {s: n for s, n in feed.items() if s not in decode}
    finished = []
    if decode:
      width = 1 if max(decode.values()) == 1 else self.speculative + 1
      rows = min(r for r in self.decode_rows if r >= len(decode))
      finished += self._call(decode, {s: i for i, s in enumerate(sorted(decode))}, rows, width)
    if prefill:
      width = min(w for w in self.prefill_widths if w >= max(prefill.values()))
      finished += self._call(prefill, {s: i for i, s in enumerate(sorted(prefill))}, self.prefill_seqs, width)
    self.stats["steps"] += 1
    self.stats["tokens_fed"] += sum(feed.values())
    return finished

  @staticmethod
  def _prefilling_tokens(r: Request) -> bool:
    """Whether r has more than one uncached token (a prompt, or a preempted sequence's recomputation)."""
    return len(r.sequence) - r.cached > 1

  def _call(self, feed: dict[int, int], rows: dict[int, int], capacity: int, width: int) -> list[Request]:
    """One forward over the fed sequences, slot s in call row rows[s] of `capacity` rows; returns the finished."""
    warps = self._warps(feed)
    if self.draft is not None and any(self.slots[s].drafts for s in feed):
      self._propose(feed)
    arrays = self._arrays(feed, rows, capacity, width) + self._sampling(feed, rows, capacity)
    before = {s: self.slots[s].cached for s in feed}
    logits, picks, self.k, self.v, h_STD = _jitted_forward(
        self.speculative + 1, warps, self.kernel, self.mtp is not None)(self.graphdef, self.state, self.k, self.v,
                                                                         *arrays)
    if self.draft is not None:  # the draft's pools take the same tokens (its next proposals attend to them)
      self._draft_call(arrays)
    self.stats["calls"] += 1
    finished = self._advance(feed, rows, logits, picks, warps)
    if self.mtp is not None:
      self._mtp_call(feed, rows, arrays, before, h_STD)
    return finished

  def _draft_call(self, arrays) -> tuple[jax.Array, jax.Array]:
    """The draft model over one call's arrays into its pools; returns its greedy picks and their log-probs [S]."""
    graphdef, state, k, v = self.draft
    _, picks, k, v, _ = _jitted_forward(1, (0, 1.0, 0.0), "xla")(graphdef, state, k, v, *arrays)
    self.draft = (graphdef, state, k, v)
    return picks[:2]

  def _mtp_call(self, feed: dict[int, int], rows: dict[int, int], arrays, before: dict[int, int], h_STD) -> None:
    """The multi-token head after a call: the entries of the positions whose keys now stand (from `before[s]`, the
    tokens cached before the call, to r.cached - 1; the token after each is known, the last one's being the token
    just picked), and each running sequence's guess at the token after its newest (`mtp_next`)."""
    tokens, segments, positions, table, length, _ = arrays[:6]
    ahead, real = np.zeros_like(tokens), np.zeros_like(segments)
    last = np.zeros((tokens.shape[0],), np.int32)
    running = [s for s in feed if self.slots[s] is not None]  # finished ones gave their pages back
    for s in running:
      r, i, c = self.slots[s], rows[s], before[s]
      n = r.cached - c
      ahead[i, :n] = r.sequence[c + 1:c + 1 + n]
      real[i, :n], last[i] = 1, n - 1
    guess_S, *self.mtp = _mtp_forward(self.graphdef, self.state, *self.mtp, h_STD, ahead, real, positions, table,
                                      length, last)
    guess_S = np.asarray(guess_S)
    for s in running:  # a guess only where the newest token is the one after the last cached (not mid-prompt)
      r = self.slots[s]
      r.mtp_next = int(guess_S[rows[s]]) if r.cached == len(r.sequence) - 1 else None

  def _propose(self, feed: dict[int, int]) -> None:
    """Fills the drafts of the sequences that verify this step: the draft model's greedy tokens, one [S, 1] call
    per draft position (the last token, then each draft in turn, at their positions)."""
    rows = [s for s in feed if self.slots[s].drafts]
    for i in range(max((len(self.slots[s].drafts) for s in rows), default=0)):
      S = self.max_seqs
      tokens, segments, positions = (np.zeros((S, 1), np.int32) for _ in range(3))
      length, zeros = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
      table = np.zeros((S, self.table_width(max(len(self.slots[s].pages) for s in feed))), np.int32)
      for s in rows:
        r = self.slots[s]
        if i < len(r.drafts):
          tokens[s, 0] = r.sequence[-1] if i == 0 else r.drafts[i - 1]
          segments[s, 0], positions[s, 0], length[s] = 1, r.cached + i, r.cached + i
          table[s, :len(r.pages)] = r.pages
      token_S, _ = self._draft_call((tokens, segments, positions, table, length, zeros, zeros, zeros, zeros,
                                     np.zeros((S,), np.float32)))
      token_S = np.asarray(token_S)
      for s in rows:
        if i < len(self.slots[s].drafts):
          self.slots[s].drafts[i] = int(token_S[s])

  def _warps(self, feed: dict[int, int]) -> tuple[int, float, float]:
    """The (top_k, top_p, min_p) the call's on-device pick applies: the most common among the sampled rows (rows
    with others pick on the host, `_on_device`)."""
    counts = collections.Counter((r.top_k, r.top_p, r.min_p) for r in (self.slots[s] for s in feed)
                                 if r.temperature > 0)
    return counts.most_common(1)[0][0] if counts else (0, 1.0, 0.0)

  def _sampling(self, feed: dict[int, int], rows: dict[int, int], capacity: int) -> tuple[np.ndarray, ...]:
    """(seed, row, index of the next token, temperature) per call row [capacity], for the on-device pick."""
    seed, row, index = (np.zeros((capacity,), np.int32) for _ in range(3))
    temperature = np.zeros((capacity,), np.float32)
    for s in feed:
      r, i = self.slots[s], rows[s]
      seed[i], row[i], index[i], temperature[i] = r.seed, r.row, len(r.tokens), r.temperature
    return seed, row, index, temperature

  def _admit(self) -> None:
    """Fills free sequence slots from the queue in order. With prefix caching, a request whose first prompt page
    is being prefilled right now by a running request (GRPO's samples of one prompt, one system prompt) waits
    for it and then shares its pages instead of computing them again."""
    free = [s for s in range(self.max_seqs) if self.slots[s] is None]
    if not free or not self.waiting:
      return
    busy = {self._hash(r, 0) for r in self.slots if r is not None and self._prefilling(r)}
    skipped: list[Request] = []
    while free and self.waiting:
      r = self.waiting.popleft()
      first = self._hash(r, 0) if self.prefix_caching and len(r.prompt) > self.page_size else None
      if first in busy and first not in self.by_hash:
        skipped.append(r)
        continue
      self.slots[free.pop(0)] = r
      if self.prefix_caching:
        self._reuse_prefix(r)
        if self._prefilling(r):
          busy.add(first)
    self.waiting.extendleft(reversed(skipped))

  def _prefilling(self, r: Request) -> bool:
    """Whether r computes a first full prompt page that the prefix cache does not know yet."""
    return self.prefix_caching and len(r.prompt) > self.page_size and not r.hashes and r.cached < len(r.prompt)

  # ---- pages: the free list, reference counts and the prefix cache -------------------------------------
  def _hash(self, r: Request, j: int) -> int:
    """The chained hash of request r's j-th full prompt page (its tokens, with MTP drafts the token after it, and
    every page before it)."""
    previous = r.hashes[j - 1] if j else 0
    return hash((previous, tuple(r.prompt[j * self.page_size:(j + 1) * self.page_size + self._lookahead])))

  def _reuse_prefix(self, r: Request) -> None:
    """Pages already holding r's leading full prompt pages, shared by reference (the last prompt token is always
    computed: its logits give the first new token)."""
    while r.cached == len(r.pages) * self.page_size and (len(r.pages) + 1) * self.page_size < len(r.prompt):
      h = self._hash(r, len(r.pages))
      page = self.by_hash.get(h)
      if page is None:
        return
      self.evictable.pop(page, None)
      self.refs[page] += 1
      r.pages.append(page)
      r.hashes.append(h)
      r.cached += self.page_size
      self.stats["prefix_hit_tokens"] += self.page_size

  def _register(self, r: Request) -> None:
    """Makes r's newly completed full prompt pages findable by later requests with the same prefix."""
    while (len(r.hashes) + 1) * self.page_size <= min(r.cached, len(r.prompt) - self._lookahead):
      h, page = self._hash(r, len(r.hashes)), r.pages[len(r.hashes)]
      if page == paged.SCRATCH:  # freed by the window before it was complete: the chain ends here
        return
      r.hashes.append(h)
      if h not in self.by_hash:
        self.by_hash[h], self.page_hash[page] = page, h

  def _available(self) -> int:
    return len(self.free) + len(self.evictable)

  def _take_page(self) -> int:
    """A free page, else the least recently released cached one (forgotten by the prefix cache)."""
    if self.free:
      page = self.free.pop()
    else:
      page, _ = self.evictable.popitem(last=False)
      del self.by_hash[self.page_hash.pop(page)]
    self.refs[page] += 1
    return page

  def _plan(self) -> dict[int, int]:
    """slot -> tokens to feed this step, every running sequence holding the pages they need (preempting the most
    recently admitted sequences while the pool is short)."""
    while True:
      running = [s for s, r in enumerate(self.slots) if r is not None]
      feed = {s: self._feed(self.slots[s]) for s in running}
      prefilling = sorted((s for s in running if self._prefilling_tokens(self.slots[s])),
                          key=lambda s: self.slots[s].rid)
      for s in prefilling[self.prefill_seqs:]:  # the earliest prefill_seqs prompts take this step's chunks
        del feed[s]
      need = {s: math.ceil((self.slots[s].cached + n) / self.page_size) - len(self.slots[s].pages)
              for s, n in feed.items()}
      if sum(max(n, 0) for n in need.values()) <= self._available():
        for s, n in need.items():
          self.slots[s].pages += [self._take_page() for _ in range(max(n, 0))]
        return feed
      self._preempt(max(running, key=lambda s: self.slots[s].rid))

  def _feed(self, r: Request) -> int:
    """Tokens r feeds this step: up to `chunk` of its uncached prompt, or its last token and (speculative > 0)
    the n-gram drafts after it (`ngram_drafts`), no more than its remaining new tokens allow."""
    n = min(len(r.sequence) - r.cached, self.chunk)
    room = min(self.speculative, r.max_new_tokens - len(r.tokens) - 1)
    drafting = n == 1 and r.tokens and room > 0 and r.plain
    if self.draft is not None:
      r.drafts = [-1] * room if drafting else []  # the draft model fills them in (`_propose`)
    elif self.mtp is not None:
      r.drafts = [r.mtp_next] if drafting and r.mtp_next is not None else []
    else:
      r.drafts = ngram_drafts(r.sequence, self.ngram, room) if drafting else []
    return n + len(r.drafts)

  def _preempt(self, s: int) -> None:
    """Slot s gives its pages back and waits first in line; it recomputes its prompt and tokens when readmitted."""
    request = self.slots[s]
    self._release(s)
    request.cached, request.preemptions, request.hashes = 0, request.preemptions + 1, []
    request.mtp_next = None
    self.stats["preemptions"] += 1
    self.waiting.appendleft(request)

  def _release(self, s: int) -> None:
    """Slot s gives back every page it holds and leaves its slot."""
    for page in reversed(self.slots[s].pages):
      self._drop(page)
    self.slots[s].pages = []
    self.slots[s] = None

  def _drop(self, page: int) -> None:
    """A page loses a holder: unheld, it goes back to the free list, or stays cached (evictable) while the prefix
    cache knows it."""
    if page == paged.SCRATCH:
      return
    self.refs[page] -= 1
    if self.refs[page] == 0:
      del self.refs[page]
      if page in self.page_hash:
        self.evictable[page] = None
      else:
        self.free.append(page)

  def _forget_old(self, r: Request) -> None:
    """With every layer windowed: r's pages wholly before the window of its next query (position r.cached sees
    keys from r.cached - window + 1 on) go back; their table entries become the scratch page, which the window
    masks."""
    first_visible = r.cached - self.window + 1
    for j in range(min(len(r.pages), max(first_visible, 0) // self.page_size)):
      if r.pages[j] != paged.SCRATCH:
        self._drop(r.pages[j])
        r.pages[j] = paged.SCRATCH
        self.stats["window_freed_pages"] += 1

  def table_width(self, pages: int) -> int:
    """The page-table width a call over sequences of up to `pages` pages uses: the next power of two, at most
    pages_per_seq. Attention gathers [sequences, width x page_size] slots, so short sequences pay for short
    tables; the widths are a fixed set of log2(pages_per_seq) + 1, compiled once each (`warmup`)."""
    return min(1 << max(pages - 1, 0).bit_length(), self.pages_per_seq)

  def warmup(self) -> None:
    """Compiles every program the engine can call (each call shape with each page-table width) with a call that
    writes only the scratch page, so no request waits for a compilation."""
    widths = sorted({self.table_width(p) for p in range(1, self.pages_per_seq + 1)})
    for capacity, width in self.shapes:
      for P in widths:
        zeros, vector = np.zeros((capacity, width), np.int32), np.zeros((capacity,), np.int32)
        arrays = (zeros, zeros, zeros, np.zeros((capacity, P), np.int32), vector, vector, vector, vector, vector,
                  np.zeros((capacity,), np.float32))
        _, _, self.k, self.v, h_STD = _jitted_forward(self.speculative + 1, (0, 1.0, 0.0), self.kernel,
                                                    self.mtp is not None)(self.graphdef, self.state, self.k, self.v,
                                                                          *arrays)
        if self.draft is not None:
          self._draft_call(arrays)
        if self.mtp is not None:
          self._mtp_call({}, {}, arrays, {}, h_STD)

  def _arrays(self, feed: dict[int, int], rows: dict[int, int], capacity: int,
              width: int) -> tuple[np.ndarray, ...]:
    """(tokens, segment ids, positions [R, width], page table [R, P], cached lengths [R], last index [R]) of the
    fed sequences, slot s in row rows[s] of R = capacity rows."""
    P = self.table_width(max(len(self.slots[s].pages) for s in feed))
    tokens, segments, positions = (np.zeros((capacity, width), np.int32) for _ in range(3))
    table = np.zeros((capacity, P), np.int32)
    length, last = np.zeros((capacity,), np.int32), np.zeros((capacity,), np.int32)
    for s, n in feed.items():
      r, i = self.slots[s], rows[s]
      fed = (r.sequence + r.drafts)[r.cached:r.cached + n]
      assert len(fed) == n, (len(fed), n)  # never broadcast: every fed slot is a real token
      tokens[i, :n] = fed
      segments[i, :n] = 1
      positions[i, :n] = np.arange(r.cached, r.cached + n)
      table[i, :len(r.pages)] = r.pages
      length[i], last[i] = r.cached, n - 1
    return tokens, segments, positions, table, length, last

  def _advance(self, feed: dict[int, int], rows: dict[int, int], logits_SWV: jax.Array, picks,
               warps: tuple[int, float, float]) -> list[Request]:
    """Counts the fed tokens as cached (of drafts, the accepted ones); a sequence now fully cached takes its next
    tokens (the device's pick; greedy drafts against the device's argmaxes; `verify` on the host for sampled
    drafts, repetition penalties and other warps); finished ones leave."""
    ready = [s for s, n in feed.items() if self.slots[s].cached + n == len(self.slots[s].sequence) +
             len(self.slots[s].drafts)]
    host = [s for s in ready if not self._on_device(self.slots[s], warps)]
    logits = np.asarray(jax.device_get(logits_SWV), np.float64) if host else None
    token_S, logp_S, best_SW, best_logp_SW = jax.device_get(picks) if len(host) < len(ready) else (None,) * 4
    finished = []
    for s, n in feed.items():
      r = self.slots[s]
      if s not in ready:
        r.cached += n
        if self.window:
          self._forget_old(r)
        continue
      m, i = len(r.drafts), rows[s]
      if s in host:
        new, logps = verify(logits[i, logits.shape[1] - 1 - m:], r)
      elif m:
        tail = slice(best_SW.shape[1] - 1 - m, None)
        new, logps = greedy_accept(best_SW[i, tail], best_logp_SW[i, tail], r.drafts)
      else:
        new, logps = [int(token_S[i])], [float(logp_S[i])]
      r.cached += n - m + len(new) - 1  # the fed tokens whose keys stand: the last one and the accepted drafts
      self.stats["drafted"] += m
      self.stats["accepted"] += len(new) - 1 if m else 0
      if self.prefix_caching:
        self._register(r)
      for token, logp in zip(new, logps):
        r.tokens.append(token)
        r.logprobs.append(logp)
        if token in r.stop_ids or len(r.tokens) >= r.max_new_tokens:
          r.done = True
          break
      if r.done:
        finished.append(r)
        self.live.pop(r.rid, None)
        self._release(s)
      elif self.window:
        self._forget_old(r)
    return finished


  @staticmethod
  def _on_device(r: Request, warps: tuple[int, float, float]) -> bool:
    """Whether the device's picks give r's next tokens: no repetition penalty, and either greedy (drafts checked
    against the argmaxes) or sampled without drafts and with the call's warps."""
    if r.repetition_penalty != 1.0:
      return False
    return not r.temperature or (not r.drafts and (r.top_k, r.top_p, r.min_p) == warps)


def greedy_accept(best_M: np.ndarray, best_logp_M: np.ndarray, drafts: list[int]) -> tuple[list[int], list[float]]:
  """(new tokens, their log-probabilities) of a greedy request from the argmax [m + 1] (and its log-probability)
  at its last token and its m drafts: the drafts while each equals the argmax, then the argmax where one differs
  (or after the last), as `verify` decides from the logits."""
  new = []
  for i, d in enumerate(drafts + [None]):
    new.append(int(best_M[i]))
    if new[-1] != d:
      break
  return new, [float(best_logp_M[i]) for i in range(len(new))]


def _log_softmax(z: np.ndarray) -> np.ndarray:
  return z - (z.max(-1, keepdims=True) + np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)))


def verify(logits_MV: np.ndarray, r: Request) -> tuple[list[int], list[float]]:
  """(new tokens, their log-probabilities) of request r from float64 logits [m + 1, V] at its last token and its
  m drafts (`r.drafts`): no drafts, `_choose`. Greedy: the drafts while each equals the argmax, then the argmax
  where one differs (or after the last): plain greedy decoding's tokens. Sampled (Leviathan et al. 2023, Chen et
  al. 2023, with the deterministic proposal q = the draft): draft d_i kept with probability p_i(d_i), else a token
  from p_i without d_i (renormalised) ends the step; all kept, one more from p_m. Each emitted token is then
  distributed as p: the output's distribution is the target's."""
  if not r.drafts:
    token, logp = _choose(logits_MV[0], r)
    return [token], [logp]
  temperature = r.temperature or 1.0
  logp_MV = _log_softmax(logits_MV / temperature)
  new = []
  for i, d in enumerate(r.drafts + [None]):
    if not r.temperature:
      token = int(np.argmax(logits_MV[i]))
    else:
      rng = np.random.default_rng([r.seed, len(r.tokens) + i, 1])
      p_V = np.exp(logp_MV[i])
      if d is not None and rng.random() < p_V[d]:
        token = d
      else:
        if d is not None:
          p_V[d] = 0.0
        token = int(rng.choice(len(p_V), p=p_V / p_V.sum()))
    new.append(token)
    if token != d:
      break
  return new, [float(logp_MV[i, t]) for i, t in enumerate(new)]


def _choose(logits_V: np.ndarray, r: Request) -> tuple[int, float]:
  """(next token, its log-probability) of request r as model.generate.choose picks it for row r.row of seed r.seed
  at its i-th token: the repetition penalty over the ids in its prompt and output, then the argmax, or a draw from
  softmax(warp_logits) with model.generate's key (the same key and warps of the float32 logits, so the same token
  where the logits agree). The log-probability is of the unpenalised logits / temperature (1 when greedy)."""
  temperature = r.temperature or 1.0
  logp_V = _log_softmax(logits_V / temperature)
  penalized_V = logits_V
  if r.repetition_penalty != 1.0:  # model.generate's penalty over the ids in the prompt and output
    seen_V = np.zeros(logits_V.shape, bool)
    seen_V[np.asarray(r.sequence)] = True
    penalized_V = np.asarray(generate_lib.penalize_repeats(jnp.asarray(logits_V[None], jnp.float32),
                                                           jnp.asarray(seen_V[None]), r.repetition_penalty))[0]
  if not r.temperature:
    token = int(np.argmax(penalized_V))
  else:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(r.seed), r.row), len(r.tokens))
    warped = generate_lib.warp_logits(jnp.asarray(penalized_V[None], jnp.float32), r.temperature, r.top_k, r.top_p,
                                      r.min_p)[0]
    token = int(jax.random.categorical(key, warped))
  return token, float(logp_V[token])


def sample(model, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
           stop_ids: Sequence[int] = (), seed: int | Sequence[int] = 0, rows: Sequence[int] | None = None,
           on_tokens: Callable[[int, list[int]], None] | None = None, **engine_kwargs) -> generate_lib.Generation:
  """`model.generate.sample`'s result through the engine: every prompt queued at once and stepped until done
  (engine_kwargs: Engine's; max_seqs defaults to min(len(prompts), 64)). Greedy tokens equal the static
  sampler's, and so do sampled ones where the two programs' float32 logits agree (row i draws with model.generate's
  keys for row i). max_new_tokens and seed: one for all, or one per prompt; rows: each prompt's row in its keys
  (default 0, 1, ...: prompt i draws as row i of a static batch). on_tokens(i, new_ids) is called after every engine step in which prompt i got tokens.
  stats: prompt_tokens, new_tokens, batch (max_seqs), prefill_seconds (0: prefill and decode interleave),
  decode_seconds (compilation excluded), compile_seconds, compiles, engine_steps, preemptions."""
  engine_kwargs.setdefault("max_seqs", min(len(prompts), 64))
  engine = Engine(model, **engine_kwargs)
  with generate_lib._count_compiles() as compiled:  # pylint: disable=protected-access
    t0 = time.perf_counter()
    each = lambda x: [x] * len(prompts) if isinstance(x, int) else list(x)  # noqa: E731
    ids = [engine.add(p, bound, stop_ids=stop_ids, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, repetition_penalty=repetition_penalty, seed=key_seed, row=row)
           for p, bound, key_seed, row in zip(prompts, each(max_new_tokens), each(seed),
                                              rows if rows is not None else range(len(prompts)))]
    requests = [engine.live[i] for i in ids]
    shown = [0] * len(prompts)
    while engine.busy():
      engine.step()
      for i, r in enumerate(requests if on_tokens else ()):
        if len(r.tokens) > shown[i]:
          on_tokens(i, r.tokens[shown[i]:])
          shown[i] = len(r.tokens)
    seconds = max(0.0, time.perf_counter() - t0 - compiled["compile_seconds"])
  tokens, logprobs = [r.tokens for r in requests], [r.logprobs for r in requests]
  stats = {"prompt_tokens": sum(len(p) for p in prompts), "new_tokens": sum(len(t) for t in tokens),
           "batch": engine.max_seqs, "prefill_seconds": 0.0, "decode_seconds": seconds, **compiled,
           "engine_steps": engine.stats["steps"], "preemptions": engine.stats["preemptions"]}
  return generate_lib.Generation(tokens, logprobs, stats)
