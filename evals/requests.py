"""lm-evaluation-harness's three request types on a meshlm model, tokenized exactly as lm-eval's `hf` backend.

- `loglikelihood([(context, continuation)])` -> [(logprob, is_greedy)]: the continuation's summed log-probability
  given the context, and whether greedy decoding would have produced it.
- `loglikelihood_rolling([text])` -> [logprob]: the whole text's log-probability in disjoint rolling windows of
  the model's length.
- `generate_until([(context, until, max_tokens)])` -> [text]: greedy continuations cut at the first stop string.

Tokenization (lm-eval 0.4 `HFLM` with a tokenizer that adds BOS, such as Llama's and meshlm's exported one):
`tok_encode(s) = [BOS] + encode(s)`. A non-empty context's trailing whitespace moves to the continuation; the
pair is split by encoding context + continuation and the context alone, the continuation being the whole
encoding past the context's length. An empty context scores the continuation (encoded without BOS) from BOS.
Inputs longer than the model are left-truncated: `(context + continuation)[-(max_len + 1):][:-1]`, with
`max_len = model.cfg.max_seq_len` (lm-eval's `max_position_embeddings`). Rolling windows follow
`lm_eval.utils.get_rolling_token_windows` (prefix BOS, context length 1) on `tok_encode(text)` (so the first
scored token is BOS itself, as lm-eval does with BOS-adding tokenizers).

Batching: requests whose model inputs begin with the same tokens share them. A group of requests is one segment
of a row: the tokens all its inputs begin with (the trunk) once, then each input's remaining tokens (its
branch), under tree attention (a branch sees the trunk and itself; positions continue the trunk's), so shared
tokens are computed once and every scored token sees what it would in a pass of its own. The choices of a
multiple-choice question share their context (and the words they begin with); sentences one word apart share
every token before it; equal inputs share all. The groups are the runs of the sorted inputs with the fewest
tokens in all, each at most `max_len` (`_share_groups`). Groups are packed first-fit-decreasing into batches of
`batch_size` rows, several short groups per row as separate segments, each row at most a bucketed length (four
sizes per octave, so a handful of shapes compile), and each batch runs in one forward pass; only the scored
positions go through the output projection. Rows are sharded over the data axes; padding is masked, so scores do
not depend on the batch. A model with sliding windows gives every input its own segment (the window test counts
row indices), and an MoE with a capacity limit every input its own row (expert capacity is counted per row; over
the padded row length, so its scores still depend on the batch's padded length, as in any padded batch).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import parallel
from model import config as config_lib
from model import generate as generate_lib
from model import logprobs

_MIN_BUCKET = 16  # shortest padded input length
_MIN_SCORED = 64  # fewest scored positions per batch


class TokenizerLike(Protocol):
  bos_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...  # no BOS/EOS

  def decode(self, ids) -> str: ...


def rolling_windows(tokens: Sequence[int], prefix: int, max_len: int) -> list[tuple[list[int], list[int]]]:
  """Disjoint (context, continuation) windows covering `tokens`, each scoring at most `max_len` tokens with the
  longest context that fits (lm-eval's get_rolling_token_windows with context_len=1 + make_disjoint_window)."""
  tokens = list(tokens)
  windows = []
  if not tokens:
    return windows
  first = min(max_len, len(tokens))
  windows.append(([prefix] + tokens[:first - 1], tokens[:first]))
  predicted = first
  while predicted < len(tokens):
    n = min(len(tokens) - predicted, max_len)
    end = predicted + n
    windows.append((tokens[max(end - max_len - 1, 0):end - 1], tokens[end - n:end]))
    predicted = end
  return [(ctx[:len(ctx) - (len(cont) - 1)], cont) for ctx, cont in windows]


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def _bucket(length: int, max_len: int, minimum: int = _MIN_BUCKET) -> int:
  """Padded size for `length`: the next multiple of a quarter of the power of two below it, at least `minimum`
  (16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...: four sizes per octave, so a batch's longest row gets at most 25%
  padding, 10% on average, and a few shapes compile), capped at max(max_len, length)."""
  if length <= minimum:
    return minimum
  step = max(1, (1 << (length.bit_length() - 1)) // 4)
  return min(-(-length // step) * step, max(max_len, length))


class LM:
  """A meshlm model + tokenizer + mesh answering lm-eval requests (see the module docstring).

  Args:
    model: a `model.Transformer` whose parameters live on `mesh` (sharded by `rules`).
    tokenizer: encode (no BOS) / decode / bos_id / eos_id (data.tokenizer.Tokenizer or data.hf_tokenizer).
    mesh, rules: the device mesh and logical-axis rules the model was placed with.
    batch_size: rows per forward pass (rounded up to a multiple of the batch-sharding size, times the pipeline's
      microbatches for a pipelined model).
    max_len: the model length lm-eval would use; default `model.cfg.max_seq_len`.
    progress: show a progress bar over batches.
    specials: literal strings encoded as one id each wherever they occur in a text (e.g. the chat markers
      {"<|user|>": 4, ...}), as a Hugging Face tokenizer.json does with its special tokens; default none.
  """

  def __init__(self, model, tokenizer: TokenizerLike, mesh: jax.sharding.Mesh, rules, *, batch_size: int = 16,
               max_len: int | None = None, progress: bool = False, specials: Mapping[str, int] | None = None,
               sampler: str = "engine"):
    if batch_size < 1:
      raise ValueError(f"batch_size={batch_size} must be >= 1")
    if sampler not in ("engine", "static"):
      raise ValueError(f"sampler={sampler!r} must be 'engine' (model/engine.py) or 'static' (model.generate)")
    self.sampler = sampler
    self.model, self.tokenizer, self.mesh, self.rules = model, tokenizer, mesh, tuple(rules)
    self.max_len = int(max_len or model.cfg.max_seq_len)
    self.progress = progress
    self.specials = dict(specials or {})
    self._special_re = (re.compile("|".join(re.escape(p) for p in sorted(self.specials, key=len, reverse=True)))
                        if self.specials else None)
    self._graphdef, self._state = nnx.split(model)
    self._sharding = parallel.sharding.logical_sharding(mesh, self.rules, ("batch", "length"))
    def shards(dim):  # devices the logical axis of `dim` is split over
      spec = self._sharding.spec
      axes = spec[dim] if len(spec) > dim else None
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    self._length_shards = shards(1)  # padded lengths are multiples of it (sequence parallelism)
    self._row_sharding = parallel.sharding.logical_sharding(mesh, self.rules, ("batch",))
    self._row_shards = shards(0)
    # Tree attention's sliding-window test counts row indices, which differ from positions inside branches: a
    # windowed model gives every request its own segment. An MoE with a capacity limit counts expert capacity
    # per row, so a request's score would depend on its row-mates: every request gets a row of its own.
    self._own_rows = model.cfg.num_experts > 0 and model.cfg.capacity_factor > 0
    self._share_prefixes = not any(config_lib.layer_windows(model.cfg)) and not self._own_rows
    # Rows split over the batch shards, and a pipelined stack splits them into microbatches of whole shards.
    pipeline = getattr(model, "pipeline", None)
    self._row_multiple = shards(0) * (pipeline.microbatches if pipeline is not None else 1)
    self.batch_size = _round_up(batch_size, self._row_multiple)
    self._score_fn = jax.jit(self._score, static_argnames="num_requests")
    self._token_fn = jax.jit(self._token_logprobs)

  def update(self, model) -> None:
    """Scores with `model`'s current parameters from now on (same architecture: nothing recompiles)."""
    self.model = model
    self._state = nnx.split(model)[1]

  # ---- tokenization as lm-eval's HFLM ---------------------------------------------------------------------
  def encode(self, text: str) -> list[int]:
    """Token ids of `text` without BOS; `specials` strings map to their ids."""
    if self._special_re is None:
      return list(self.tokenizer.encode(text))
    ids, pos = [], 0
    for m in self._special_re.finditer(text):
      ids += self.tokenizer.encode(text[pos:m.start()]) if m.start() > pos else []
      ids.append(self.specials[m.group()])
      pos = m.end()
    return ids + (list(self.tokenizer.encode(text[pos:])) if pos < len(text) else [])

  def tok_encode(self, text: str) -> list[int]:
    """[BOS] + ids: what a BOS-adding Hugging Face tokenizer returns with default special tokens."""
    return [self.tokenizer.bos_id] + self.encode(text)

  def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval splits them (module docstring)."""
    if context == "":
      cont = self.encode(continuation)
      bos = self.tokenizer.bos_id
      return ([bos], cont) if not cont or cont[0] != bos else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
      context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = self.tok_encode(context + continuation)
    ctx = self.tok_encode(context)
    return ctx, whole[len(ctx):]

  # ---- requests -------------------------------------------------------------------------------------------
  def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    """[(sum of log p(continuation tokens | context), greedy?)] per (context, continuation) pair."""
    pairs = []
    for i, (context, continuation) in enumerate(requests):
      ctx, cont = self.encode_pair(context, continuation)
      if not cont:
        raise ValueError(f"request {i}: the continuation {continuation!r} encodes to no tokens after the "
                         f"context {context[-40:]!r}; nothing to score")
      pairs.append((ctx, cont))
    return self.loglikelihood_tokens(pairs)

  def loglikelihood_rolling(self, texts: Sequence[str]) -> list[float]:
    """Sum of log p over every token of each text (rolling windows of `max_len`), nats."""
    windows, owner = [], []
    for i, text in enumerate(texts):
      for w in rolling_windows(self.tok_encode(text), self.tokenizer.bos_id, self.max_len):
        windows.append(w)
        owner.append(i)
    scores = self.loglikelihood_tokens(windows)
    out = [0.0] * len(texts)
    for i, (logprob, _) in zip(owner, scores):
      out[i] += logprob
    return out

  def token_logprobs(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Per document, float32 [n - 1]: log p(token j | tokens < j) for j = 1 .. n - 1 of its first n = max_len
    tokens ([BOS] + text), one forward pass over the whole window (perplexity by position: evals/long_context.py)."""
    docs = [self.tok_encode(t)[:self.max_len] for t in texts]
    out: list[np.ndarray] = []
    for start in range(0, len(docs), self.batch_size):
      chunk = docs[start:start + self.batch_size]
      B = _round_up(len(chunk), self._row_multiple)
      L = _round_up(_bucket(max(len(d) for d in chunk), self.max_len), self._length_shards)
      tokens_BL, segment_ids_BL = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
      for b, d in enumerate(chunk):
        tokens_BL[b, :len(d)], segment_ids_BL[b, :len(d)] = d, 1
      put = lambda a: jax.device_put(a, self._sharding)
      logprob_BL = np.asarray(jax.device_get(self._token_fn(self._state, put(tokens_BL), put(segment_ids_BL))))
      out.extend(logprob_BL[b, :len(d) - 1] for b, d in enumerate(chunk))
    return out

  def _token_logprobs(self, state, tokens_BL, segment_ids_BL):
    """[B, L] log p(token l + 1 | tokens <= l) (the last column is padding). The output projection runs on
    TOKEN_CHUNK positions at a time, so no [B, L, V] logits exist at long lengths."""
    B, L = tokens_BL.shape
    targets_BL = jnp.pad(tokens_BL[:, 1:], ((0, 0), (0, 1)))
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      model = nnx.merge(self._graphdef, state)
      x_BLD = model.features(tokens_BL, segment_ids_BL)
      c = min(TOKEN_CHUNK, L)
      n = -(-L // c)
      x_nBcD = jnp.moveaxis(jnp.pad(x_BLD, ((0, 0), (0, n * c - L), (0, 0))).reshape(B, n, c, -1), 1, 0)
      t_nBc = jnp.moveaxis(jnp.pad(targets_BL, ((0, 0), (0, n * c - L))).reshape(B, n, c), 1, 0)

      def chunk(xs):
        target_Bc, logz_Bc = logprobs.target_logits(model.logits(xs[0]), xs[1])
        return target_Bc - logz_Bc
      return jnp.moveaxis(jax.lax.map(chunk, (x_nBcD, t_nBc)), 0, 1).reshape(B, n * c)[:, :L]

  def generate_until(self, requests: Sequence[tuple[str, Sequence[str], int]], *, temperature: float = 0.0,
                     top_p: float = 1.0, seed: int = 0) -> list[str]:
    """Continuations of each context, cut before the first of its stop strings (lm-eval's post-processing).

    requests: (context, until, max_tokens). The context is `tok_encode`d and left-truncated to
    `max_len - max_tokens` tokens; generation stops at EOS or after max_tokens. Greedy unless temperature > 0.
    The `sampler` given at construction decodes: the engine (every request at once, batch_size sequences at a
    time, each to its own max_tokens) or model.generate (batches of equal max_tokens); greedy output is the same.
    """
    return self._generate_with(requests, temperature=temperature, top_p=top_p, seed=seed)

  def _generate_with(self, requests, *, temperature: float, top_p: float, seed: int, sampler: Callable = None):
    """`generate_until` by `self.sampler`, or by `sampler` (of `model.generate.generate`'s signature) when given.

    Requests are batched as model.generate takes them: equal max_tokens, batch_size at a time, the batch at
    `start` of its group drawing with seed + start, each request as its row in it. The engine takes every
    request at once with those seeds and rows, so its sampled tokens are model.generate's too wherever the two
    programs' logits agree."""
    groups: dict[int, list[int]] = {}
    for i, (_, _, max_tokens) in enumerate(requests):
      if max_tokens < 1 or max_tokens >= self.max_len:
        raise ValueError(f"request {i}: max_tokens={max_tokens} must be in [1, {self.max_len - 1}]")
      groups.setdefault(int(max_tokens), []).append(i)
    prompt = lambda i: self.tok_encode(requests[i][0])[-(self.max_len - requests[i][2]):]  # noqa: E731
    batches = [(idx[start:start + self.batch_size], max_tokens, seed + start) for max_tokens, idx in groups.items()
               for start in range(0, len(idx), self.batch_size)]
    # A stop string that is a special piece (a chat marker such as <|end_of_turn|>) decodes to no text, so it is
    # matched by id: generation is cut at its first occurrence, and stops there when every request lists it.
    special_stops = [{self.specials[u] for u in until if u in self.specials} for _, until, _ in requests]
    common = set.intersection(*special_stops) if special_stops else set()
    stop_ids = (self.tokenizer.eos_id, *sorted(common))
    conts = {}
    with parallel.activate(self.mesh, self.rules):
      if sampler is None and self.sampler == "engine" and requests:
        from model import engine as engine_lib  # pylint: disable=g-import-not-at-top
        order = [(i, max_tokens, batch_seed, row) for chunk, max_tokens, batch_seed in batches
                 for row, i in enumerate(chunk)]
        tokens = engine_lib.sample(self.model, [prompt(i) for i, *_ in order], [b for _, b, _, _ in order],
                                   temperature=temperature, top_p=top_p, stop_ids=stop_ids,
                                   seed=[s for *_, s, _ in order], rows=[r for *_, r in order],
                                   max_seqs=min(self.batch_size, len(order)), max_len=self.max_len).tokens
        conts = {i: t for (i, *_), t in zip(order, tokens)}
      else:
        for chunk, max_tokens, batch_seed in batches:
          outs = (sampler or generate_lib.generate)(self.model, [prompt(i) for i in chunk], max_tokens,
                                                    temperature=temperature, top_p=top_p, stop_ids=stop_ids,
                                                    seed=batch_seed)
          conts.update(zip(chunk, outs))
    return [cut_at_stops(self.tokenizer.decode(_cut_at_ids(conts[i], special_stops[i])), requests[i][1])
            for i in range(len(requests))]

  # ---- token-level scoring --------------------------------------------------------------------------------
  def loglikelihood_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
    """Scores (context ids, continuation ids) pairs: [(sum log p(continuation), greedy?)], in input order.

    Each request's model input x (context + continuation, left-truncated, minus its last token) is scored at its
    last n = len(continuation) positions, which lie in its group's trunk, its own branch or both (batching and
    prefix sharing: the module docstring).
    """
    inputs, conts = [], []  # x_i, continuation_i
    for i, (ctx, cont) in enumerate(pairs):
      if not ctx or not cont:
        raise ValueError(f"request {i}: context and continuation must both hold tokens")
      if len(cont) > self.max_len:  # lm-eval asserts here; meshlm scores the last max_len tokens instead
        ctx, cont = list(ctx) + list(cont[:-self.max_len]), cont[-self.max_len:]
      whole = (list(ctx) + list(cont))[-(self.max_len + 1):]
      inputs.append(tuple(whole[:-1]))
      conts.append(list(cont))
    owners: dict[tuple, list[int]] = {}  # requests with equal inputs (one-token choices) share every token
    for i, x in enumerate(inputs):
      owners.setdefault(x, []).append(i)
    unique = list(owners)
    if self._share_prefixes:
      pieces = _share_groups(unique, self.max_len)
    else:  # every input a segment of its own: all of it is the trunk
      pieces = [(len(x), [u], len(x)) for u, x in enumerate(unique)]
    results: list[Any] = [None] * len(inputs)
    pending = []
    for batch in _pack_rows(pieces, self.batch_size, self.max_len, self._length_shards, self.progress,
                            one_per_row=self._own_rows):
      B = min(_round_up(_bucket(len(batch), self.batch_size, 1), self._row_multiple), self.batch_size)  # last batch
      L = _round_up(_bucket(max(sum(piece[2] for piece in row) for row in batch), self.max_len), self._length_shards)
      members = [(b, i) for b, row in enumerate(batch) for _, us, _ in row for u in us for i in owners[unique[u]]]
      M = _round_up(_pow2(max(len(members), B)), self._row_shards)
      # Scored positions, flat: each request's n positions, so the output projection sees no padding per request.
      N = _round_up(_bucket(sum(len(conts[i]) for _, i in members), 1 << 30, _MIN_SCORED), self._row_shards)
      tokens_BL, segment_ids_BL, positions_BL, branch_BL = (np.zeros((B, L), np.int32) for _ in range(4))
      row_N, col_N, targets_N = (np.zeros((N,), np.int32) for _ in range(3))
      member_N = np.full((N,), M - 1, np.int32)  # padding positions count for the last request slot, masked
      mask_N = np.zeros((N,), np.float32)
      m = k = 0
      for b, row in enumerate(batch):
        at = 0
        for segment, (t, us, used) in enumerate(row, start=1):
          tokens_BL[b, at:at + t], positions_BL[b, at:at + t] = unique[us[0]][:t], np.arange(t)
          segment_ids_BL[b, at:at + used] = segment
          branch_at = at + t
          for branch, u in enumerate(us, start=1):
            x = unique[u]
            tokens_BL[b, branch_at:branch_at + len(x) - t] = x[t:]
            positions_BL[b, branch_at:branch_at + len(x) - t] = np.arange(t, len(x))
            branch_BL[b, branch_at:branch_at + len(x) - t] = branch
            for i in owners[x]:
              n = len(conts[i])
              j = np.arange(len(x) - n, len(x))  # input positions predicting the continuation
              row_N[k:k + n], col_N[k:k + n] = b, np.where(j < t, at + j, branch_at + j - t)
              targets_N[k:k + n], member_N[k:k + n], mask_N[k:k + n] = conts[i], m, 1.0
              k += n
              m += 1
            branch_at += len(x) - t
          at += used
      put = lambda a, sharding: jax.device_put(a, sharding)
      args = [put(a, self._sharding) for a in (tokens_BL, segment_ids_BL, positions_BL, branch_BL)] + [
          put(a, self._row_sharding) for a in (row_N, col_N, targets_N, member_N, mask_N)]
      pending.append(([i for _, i in members], self._score_fn(self._state, *args, num_requests=M)))
      if len(pending) > 2:  # dispatched; fetched a little later so the host prepares the next batch meanwhile
        self._collect(pending.pop(0), results)
    for item in pending:
      self._collect(item, results)
    return results

  @staticmethod
  def _collect(item, results):
    idx, (logprob_M, greedy_M) = item
    logprob_M, greedy_M = jax.device_get((logprob_M, greedy_M))
    for m, i in enumerate(idx):
      results[i] = (float(logprob_M[m]), bool(greedy_M[m]))

  def _score(self, state, tokens_BL, segment_ids_BL, positions_BL, branch_BL, row_N, col_N, targets_N, member_N,
             mask_N, *, num_requests: int):
    """(sum over its positions of log p(target), every target is the argmax) per request slot [num_requests].

    Scored position p is column col_N[p] of row row_N[p], predicting targets_N[p] for request member_N[p]
    (mask_N[p] = 0: padding).
    """
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      model = nnx.merge(self._graphdef, state)
      x_BLD = model.features(tokens_BL, segment_ids_BL, positions_BL,
                             branch_BL=branch_BL if self._share_prefixes else None)
      logits_N1V = model.logits(x_BLD[row_N, col_N][:, None])
    target_N1, logz_N1 = logprobs.target_logits(logits_N1V, targets_N[:, None])
    logprob_M = jax.ops.segment_sum((target_N1 - logz_N1)[:, 0] * mask_N, member_N, num_segments=num_requests)
    greedy_N = logprobs.is_argmax(logits_N1V[:, 0].astype(jnp.float32), targets_N, target_N1[:, 0])
    wrong_N = ~greedy_N & (mask_N > 0)
    greedy_M = jax.ops.segment_sum(wrong_N.astype(jnp.int32), member_N, num_segments=num_requests) == 0
    return logprob_M, greedy_M


TOKEN_CHUNK = 1024  # positions per output projection in LM.token_logprobs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  for i in range(n):
    if a[i] != b[i]:
      return i
  return n


_MAX_GROUP = 32  # most distinct inputs per group the grouping considers (multiple choice: 2-12)


def _share_groups(inputs: Sequence[tuple[int, ...]], max_len: int) -> list[tuple[int, list[int], int]]:
  """Groups distinct inputs by common token prefixes: [(trunk length t, input ids, segment length)].

  A group's trunk is the longest prefix all its inputs share; its segment holds the trunk once and each input's
  remaining tokens: t + sum_i (len(x_i) - t) tokens. In sorted order inputs sharing a prefix are neighbours, so
  groups are runs of the sorted inputs; the runs minimising the total length (each at most `max_len`, at most
  `_MAX_GROUP` inputs) are found by dynamic programming: O(R log R + R * _MAX_GROUP + total tokens).
  """
  order = sorted(range(len(inputs)), key=inputs.__getitem__)
  xs = [inputs[i] for i in order]
  lcp = [0] + [_common_prefix(xs[k - 1], xs[k]) for k in range(1, len(xs))]
  best = [0] * (len(xs) + 1)  # best[i]: fewest tokens for xs[:i]
  last = [(0, 0, 0)] * (len(xs) + 1)  # last[i]: (start j, trunk, length) of the last run of that best
  for i in range(1, len(xs) + 1):
    t = total = len(xs[i - 1])
    best[i], last[i] = best[i - 1] + t, (i - 1, t, t)  # xs[i - 1] alone
    for j in range(i - 2, max(-1, i - 1 - _MAX_GROUP), -1):  # the run xs[j:i]
      t = min(t, lcp[j + 1])
      if t == 0:
        break  # nothing shared with any longer run
      total += len(xs[j])
      used = total - (i - j - 1) * t
      if used <= max_len and best[j] + used < best[i]:
        best[i], last[i] = best[j] + used, (j, t, used)
  groups, i = [], len(xs)
  while i > 0:
    j, t, used = last[i]
    groups.append((t, order[j:i], used))
    i = j
  return groups[::-1]


def _pack_rows(pieces, batch_size: int, max_len: int, length_shards: int, progress: bool = False,
               one_per_row: bool = False):
  """Yields batches of at most `batch_size` rows, each row a list of pieces (trunk length, input ids, length).

  First-fit decreasing into rows of the bucketed length of the longest piece: several short pieces share a row as
  separate segments, so little of a forward pass is padding. A piece is tried against the 64 most recently opened
  rows only (the older ones are nearly full), which keeps packing linear in the number of requests.
  """
  left = sorted(pieces, key=lambda p: (-p[2], p[1][0]))
  if not left:
    return
  R = _round_up(_bucket(left[0][2], max_len), length_shards)
  recent = 0 if one_per_row else 64  # open rows a piece may join
  rows, free = [], []
  for piece in left:
    for r in range(max(0, len(rows) - recent), len(rows)):
      if piece[2] <= free[r]:
        rows[r].append(piece)
        free[r] -= piece[2]
        break
    else:
      rows.append([piece])
      free.append(R - piece[2])
  batches = [rows[s:s + batch_size] for s in range(0, len(rows), batch_size)]
  if progress and len(batches) > 1:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    batches = tqdm(batches, desc="scoring", unit="batch", leave=False)
  yield from batches

def _cut_at_ids(tokens: Sequence[int], stops: set[int]) -> list[int]:
  """`tokens` up to (not including) the first id in `stops`."""
  tokens = list(tokens)
  return next((tokens[:j] for j, t in enumerate(tokens) if t in stops), tokens)


def cut_at_stops(text: str, until: Sequence[str]) -> str:
  """`text` up to (not including) the first occurrence of any stop string, as lm-eval's generate_until does
  (it splits at each stop in turn: text.split(stop)[0])."""
  for stop in until:
    if stop:
      text = text.split(stop)[0]
  return text
