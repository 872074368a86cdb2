"""Autoregressive generation with a KV cache: batched prompts, greedy or sampled, on the active mesh.

    generate(model, prompts, max_new_tokens, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
             repetition_penalty=1.0, stop_ids=(), seed=0)
        -> list[list[int]]   (the continuation of each prompt, ending with the stop id when one was produced)
    sample(...same...) -> Generation(tokens, logprobs, stats)   (per-token log-probabilities, timings)

How it runs (docs/generate.md): prompts are left-padded to a bucketed length P (a power of two >= 16, so prompt
lengths inside one bucket share one compilation); row b's real tokens start at slot start[b] and sit at RoPE
positions 0, 1, ... exactly as if decoded alone. One jitted prefill runs the prompts through the model, filling
a `model.kv_cache.KVCache` of P + N slots (N = max_new_tokens rounded up to a power of two) and sampling the
first token; one jitted decode loop (`lax.while_loop`) feeds one token per step and stops once every row has
produced a stop id or max_new_tokens tokens. The batch is padded to a power of two, then to a multiple of the
devices the `batch` axis is sharded over; padded rows start finished (a row's draws do not depend on the others).

Sampling follows the order of Hugging Face's `generate` (`GenerationMixin._get_logits_processor`): the
repetition penalty (a logits processor: the logit of every id already in the row's prompt or continuation is
divided by the penalty when >= 0, multiplied when < 0), then the warpers logits / temperature, top-k (keeps every
token tied with the k-th), top-p (keeps the smallest set of most likely tokens whose probability reaches top_p,
the token crossing it included), min-p (keeps the tokens whose probability is >= min_p x the largest), then a
draw. Temperature 0 is greedy: the argmax of the penalised logits (the warpers do not apply, as with
do_sample=False). Each row draws with its own key fold_in(fold_in(PRNGKey(seed), row), step), so its tokens do
not depend on the batch around it or the mesh.

Sharding: call under `parallel.activate(mesh, rules)` (the model created there too) and the prompts' rows are
split over the `batch` mesh axes, the cache's kv heads over `kv_heads`, as in training.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import axes
from model import kv_cache
from model.axes import BATCH, LENGTH, VOCAB
from parallel import sharding as sharding_lib

MIN_BUCKET = 16
PAD_ID = 0  # token id written into padding slots (never attended to, so any id would do)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Tracing and lowering happen on the first call too; their seconds count as compilation, not generation.
_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")


class Generation(NamedTuple):
  """The result of `sample`.

  tokens:   per prompt, the generated ids (continuation only), ending with the stop id when one was produced.
  logprobs: per prompt, log p(token) of each generated token under softmax(logits / temperature) (temperature 1
            when greedy): the model's full distribution at the sampling temperature, before the repetition
            penalty and top-k/top-p/min-p, as a policy gradient (PPO) recomputes it from a forward pass.
  stats:    {"prompt_tokens", "new_tokens", "batch" (padded rows), "prompt_bucket", "cache_length",
             "prefill_seconds", "decode_seconds" (wall time, compilation excluded), "compile_seconds",
             "compiles" (XLA compilations during the call)}.
  """
  tokens: list[list[int]]
  logprobs: list[list[float]]
  stats: dict


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
  """The smallest power of two >= max(n, minimum): lengths that share one compiled program."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def penalize_repeats(logits_BV: jax.Array, seen_BV: jax.Array, penalty: float) -> jax.Array:
  """The repetition penalty of CTRL (Keskar et al. 2019) as `transformers.RepetitionPenaltyLogitsProcessor`:
  where seen_BV (bool: the id occurs in the row's prompt or continuation, once or more), a logit < 0 is
  multiplied by `penalty` and one >= 0 divided by it; > 1 discourages repeats, 1.0 = off. float32 [B, V]."""
  x_BV = logits_BV.astype(jnp.float32)
  if penalty == 1.0:
    return x_BV
  p = jnp.float32(penalty)
  return jnp.where(seen_BV, jnp.where(x_BV < 0, x_BV * p, x_BV / p), x_BV)


def seen_tokens(tokens_BL: jax.Array, real_BL: jax.Array, vocab_size: int) -> jax.Array:
  """bool [B, V]: which ids occur among the real (real_BL true, not padding) tokens of each row."""
  B, L = tokens_BL.shape
  rows_BL = jnp.broadcast_to(jnp.arange(B)[:, None], (B, L))
  ids_BL = jnp.where(real_BL.astype(bool), tokens_BL, vocab_size)  # padding -> out of range, dropped
  seen_BV = jnp.zeros((B, vocab_size), bool).at[rows_BL, ids_BL].set(True, mode="drop")
  return axes.constrain(seen_BV, (BATCH, VOCAB))


def warp_logits(logits_BV: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> jax.Array:
  """Hugging Face's warpers in their order: logits / temperature, top-k, top-p, min-p; removed tokens become -inf.

  top-k keeps the tokens whose scaled logit is >= the k-th largest (ties kept), 0 = off. top-p sorts ascending,
  removes the tokens whose cumulative probability is <= 1 - top_p and always keeps the most likely one (so the
  token that crosses top_p stays); 1.0 = off. min-p (`transformers.MinPLogitsWarper`) removes the tokens whose
  probability after the steps before is < min_p x the largest one, which always stays; 0.0 = off.
  float32 [B, V] -> float32 [B, V].
  """
  x_BV = logits_BV.astype(jnp.float32) / jnp.float32(temperature)
  if top_k > 0:
    kth_B1 = jax.lax.top_k(x_BV, min(top_k, x_BV.shape[-1]))[0][:, -1:]
    x_BV = jnp.where(x_BV < kth_B1, -jnp.inf, x_BV)
  if top_p < 1.0:
    sorted_BV = jnp.sort(x_BV, axis=-1)
    cum_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
    removed_BV = (cum_BV <= 1.0 - top_p).at[:, -1].set(False)
    # The kept tokens are a suffix of the ascending order: keep everything >= its smallest logit.
    cutoff_B1 = jnp.min(jnp.where(removed_BV, jnp.inf, sorted_BV), axis=-1, keepdims=True)
    x_BV = jnp.where(x_BV < cutoff_B1, -jnp.inf, x_BV)
  if min_p > 0.0:
    # As transformers computes it (probabilities, not log space), so the same tokens sit on either side of the
    # threshold; the most likely token has p = max >= min_p * max and is never removed.
    probs_BV = jax.nn.softmax(x_BV, axis=-1)
    x_BV = jnp.where(probs_BV < jnp.float32(min_p) * jnp.max(probs_BV, axis=-1, keepdims=True), -jnp.inf, x_BV)
  return x_BV


def choose(logits_BV: jax.Array, keys_B: jax.Array, settings: _Settings,
           seen_BV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """One token per row from float32 logits [B, V]: the repetition penalty (seen_BV: bool [B, V], the ids already
  in each row; None when the penalty is off), then the argmax at temperature 0, else a draw from
  softmax(warp_logits) with each row's key (keys_B [B, 2]).

  Returns (int32 tokens [B], float32 log p(token) under softmax(logits / T) of the unpenalised logits [B], T = 1
  when greedy).
  """
  penalized_BV = logits_BV if seen_BV is None else penalize_repeats(logits_BV, seen_BV,
                                                                    settings.repetition_penalty)
  temperature = settings.temperature
  if temperature == 0.0:
    token_B = jnp.argmax(penalized_BV, axis=-1).astype(jnp.int32)
    scaled_BV = logits_BV
  else:
    warped_BV = warp_logits(penalized_BV, temperature, settings.top_k, settings.top_p, settings.min_p)
    token_B = jax.vmap(jax.random.categorical)(keys_B, warped_BV).astype(jnp.int32)
    scaled_BV = logits_BV / jnp.float32(temperature)
  logp_B = jnp.take_along_axis(jax.nn.log_softmax(scaled_BV, axis=-1), token_B[:, None], axis=-1)[:, 0]
  return token_B, logp_B


def _step_keys(seed_2, rows: int, step):
  """uint32 [rows, 2]: fold_in(fold_in(PRNGKey(seed), row), step) for rows first_row, first_row + 1, ... (seed_2 =
  [seed, first_row]), so a row's draws ignore the other rows."""
  base = jax.random.PRNGKey(seed_2[0])
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(seed_2[1] + jnp.arange(rows))


class _Settings(NamedTuple):
  """Everything static about one compiled program (part of the jit cache key)."""
  rules: tuple
  new_bucket: int  # N: slots for generated tokens (the cache holds P + N)
  temperature: float
  top_k: int
  top_p: float
  min_p: float
  repetition_penalty: float
  stop_ids: tuple[int, ...]
  stream: bool  # call the host listener after every step (`sample(on_tokens=...)`)


_listener: list[Callable | None] = [None]  # the host function the decode loop streams to (set by `sample`)


def _emit(step, token_B, done_B):
  if _listener[0] is not None:
    _listener[0](int(step), np.asarray(token_B), np.asarray(done_B))


def prefill(model, tokens_BP: jax.Array, start_B: jax.Array, free_slots: int) -> tuple[jax.Array, kv_cache.KVCache]:
  """Left-padded prompts (row b's tokens in slots [start_B[b], P)) through `model` into a new cache of
  P + free_slots slots: -> (features x_BPD, the cache with index P). Traced inside a jitted caller."""
  P = tokens_BP.shape[1]
  slots_BP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), tokens_BP.shape)
  segment_ids_BP = (slots_BP >= start_B[:, None]).astype(jnp.int32)  # 0 = left padding
  positions_BP = jnp.maximum(slots_BP - start_B[:, None], 0)
  tokens_BP = axes.constrain(tokens_BP, (BATCH, LENGTH))
  cache = kv_cache.zeros(model.cfg, start_B, P + free_slots)
  return model.features(tokens_BP, segment_ids_BP, positions_BP, cache=cache)


def _add_seen(seen_BV, token_B):
  """seen_BV with each row's new token marked (None when the repetition penalty is off)."""
  if seen_BV is None:
    return None
  return seen_BV.at[jnp.arange(token_B.shape[0]), token_B].set(True)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _prefill(graphdef, state, tokens_BP, start_B, seed_2, *, settings: _Settings):
  """Prompts -> (filled cache, first tokens [B], their log-probs [B], the ids seen per row [B, V] or None)."""
  with axes.axis_rules(settings.rules):
    model = nnx.merge(graphdef, state)
    x_BPD, cache = prefill(model, tokens_BP, start_B, settings.new_bucket)
    logits_BV = model.logits(x_BPD[:, -1:])[:, 0]  # left padding: every row's last prompt token is at slot P-1
    seen_BV = None
    if settings.repetition_penalty != 1.0:  # the prompt's ids count (HF: the left padding does not)
      real_BP = jnp.arange(tokens_BP.shape[1])[None, :] >= start_B[:, None]
      seen_BV = seen_tokens(tokens_BP, real_BP, logits_BV.shape[-1])
    token_B, logp_B = choose(logits_BV, _step_keys(seed_2, tokens_BP.shape[0], 0), settings, seen_BV)
    return cache, token_B, logp_B, _add_seen(seen_BV, token_B)


def _is_stop(token_B, stop_ids):
  return jnp.isin(token_B, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros(token_B.shape, bool)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def _decode(graphdef, state, cache, token_B, logp_B, seen_BV, done_B, seed_2, max_new_tokens, *,
            settings: _Settings):
  """The decode loop from the first token: -> (tokens [B, N], log-probs [B, N], steps run); seen_BV (bool [B, V]
  or None) the ids of each row so far, for the repetition penalty.

  Step i (1 <= i < max_new_tokens) feeds token i-1 at cache slot P+i-1 and samples token i. The loop ends when
  every row is done (its stop id was produced; padded rows start done) or after max_new_tokens tokens.
  """
  with axes.axis_rules(settings.rules):
    model = nnx.merge(graphdef, state)
    B, N = token_B.shape[0], settings.new_bucket
    out_BN = jnp.zeros((B, N), jnp.int32).at[:, 0].set(token_B)
    logps_BN = jnp.zeros((B, N), jnp.float32).at[:, 0].set(logp_B)
    done_B = done_B | _is_stop(token_B, settings.stop_ids)

    def cond(carry):
      i, _, _, done_B, _, _, _ = carry
      return (i < max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
      i, cache, token_B, done_B, out_BN, logps_BN, seen_BV = carry
      positions_B1 = (cache.index - cache.start)[:, None]
      x_B1D, cache = model.features(token_B[:, None], positions_BL=positions_B1, cache=cache)
      logits_BV = model.logits(x_B1D)[:, 0]
      token_B, logp_B = choose(logits_BV, _step_keys(seed_2, B, i), settings, seen_BV)
      seen_BV = _add_seen(seen_BV, token_B)
      token_B = jnp.where(done_B, PAD_ID, token_B)  # finished rows keep computing (fixed shapes) but emit padding
      out_BN = jax.lax.dynamic_update_slice(out_BN, token_B[:, None], (0, i))
      logps_BN = jax.lax.dynamic_update_slice(logps_BN, logp_B[:, None], (0, i))
      if settings.stream:
        jax.debug.callback(_emit, i, token_B, done_B)
      done_B = done_B | _is_stop(token_B, settings.stop_ids)
      return i + 1, cache, token_B, done_B, out_BN, logps_BN, seen_BV

    carry = (jnp.int32(1), cache, token_B, done_B, out_BN, logps_BN, seen_BV)
    steps, _, _, _, out_BN, logps_BN, _ = jax.lax.while_loop(cond, body, carry)
    return out_BN, logps_BN, steps


@contextlib.contextmanager
def _count_compiles():
  """Counts this thread's XLA compilations while the block runs: {"compiles", "compile_seconds" (tracing +
  lowering + XLA)}. Other threads' (e.g. a learner beside an RL rollout worker) are not this sampler's time."""
  counts = {"compiles": 0, "compile_seconds": 0.0}
  owner = threading.get_ident()

  def listener(event, duration, **_):
    if threading.get_ident() != owner:  # JAX reports a compile on the thread that asked for it
      return
    if event == _COMPILE_EVENT:
      counts["compiles"] += 1
    if event == _COMPILE_EVENT or event in _TRACE_EVENTS:
      counts["compile_seconds"] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _check(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
           stop_ids) -> list[list[int]]:
  """Validates the arguments (ValueError naming the argument and the fix); returns the prompts as int lists."""
  cfg = model.cfg
  if not cfg.causal:
    raise ValueError("model.causal=False is a bidirectional encoder: it cannot generate left to right (score it "
                     "with masked-token accuracy instead)")
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
    raise ValueError("prompts must be a non-empty list of token-id lists (encode text with the tokenizer first)")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  if not temperature >= 0.0:
    raise ValueError(f"temperature={temperature!r} must be >= 0 (0 = greedy)")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 = off)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p!r} must be in (0, 1] (1 = off)")
  if not 0.0 <= min_p <= 1.0:
    raise ValueError(f"min_p={min_p!r} must be in [0, 1] (0 = off)")
  if not 0.0 < repetition_penalty < float("inf"):
    raise ValueError(f"repetition_penalty={repetition_penalty!r} must be a finite number > 0 (1 = off; > 1 "
                     "discourages repeated tokens)")
  for s in stop_ids:
    if not 0 <= int(s) < cfg.vocab_size:
      raise ValueError(f"stop id {s} is outside the vocabulary [0, {cfg.vocab_size})")
  out = []
  for i, p in enumerate(prompts):
    p = [int(t) for t in np.asarray(p).reshape(-1)]
    if not p:
      raise ValueError(f"prompt {i} is empty: give at least one token (e.g. the tokenizer's BOS id)")
    bad = [t for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    if len(p) > cfg.max_seq_len:
      raise ValueError(f"prompt {i} has {len(p)} tokens, more than model.max_seq_len={cfg.max_seq_len}; "
                       "shorten it (e.g. keep its last tokens)")
    if len(p) + max_new_tokens > cfg.max_seq_len:
      raise ValueError(f"prompt {i} ({len(p)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                       f"model.max_seq_len={cfg.max_seq_len}; lower max_new_tokens or shorten the prompt")
    out.append(p)
  return out


def sample(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
           stop_ids: Sequence[int] = (), seed: int = 0, first_row: int = 0,
           on_tokens: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> Generation:
  """Generates up to `max_new_tokens` tokens after each prompt; returns tokens, log-probs and timings.

  Args:
    model: a meshlm `Transformer` (for a sharded run, created and called under `parallel.activate`).
    prompts: token-id lists, any lengths in [1, model.max_seq_len - max_new_tokens].
    max_new_tokens: the most tokens generated per prompt (>= 1).
    temperature, top_k, top_p, min_p: sampling warpers (module docstring); temperature 0 = greedy.
    repetition_penalty: > 0; each id already in the row's prompt or continuation has its logit divided by it
      (multiplied when negative) before sampling or the argmax; 1.0 = off.
    stop_ids: ids that end a row (kept as its last token); () = run to max_new_tokens.
    seed: the sampling seed (same seed, same prompts -> same tokens, on any mesh).
    first_row: the row of prompts[0] in a larger batch (row keys module docstring): a batch split into parts
      sampled apart (e.g. by process) draws what the whole batch draws.
    on_tokens: optional host function called after each step with (step, tokens [rows], done [rows]) for
      streaming (rows in prompt order, padding rows dropped; `done` = the row had finished before this step).
  Returns:
    Generation (see its docstring). Raises ValueError for bad arguments (the message names the fix).
  """
  prompts = _check(model, prompts, max_new_tokens, temperature, top_k, top_p, min_p, repetition_penalty, stop_ids)
  n = len(prompts)
  # Power-of-two row counts share compiled programs as the prompt buckets do (callers whose batch shrinks, e.g.
  # multi-turn episodes' later turns, would otherwise compile once per count); padded rows start finished.
  rows = -(-bucket(n, 1) // axes.mesh_size(BATCH)) * axes.mesh_size(BATCH)
  P = min(bucket(max(len(p) for p in prompts)), max(model.cfg.max_seq_len, MIN_BUCKET))
  tokens_BP = np.full((rows, P), PAD_ID, np.int32)
  start_B = np.full((rows,), P - 1, np.int32)
  for b, p in enumerate(prompts):
    tokens_BP[b, P - len(p):] = p
    start_B[b] = P - len(p)
  done_B = np.arange(rows) >= n
  settings = _Settings(rules=axes.current_rules(), new_bucket=bucket(max_new_tokens),
                       temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                       min_p=float(min_p), repetition_penalty=float(repetition_penalty),
                       stop_ids=tuple(sorted({int(s) for s in stop_ids})), stream=on_tokens is not None)
  graphdef, state = nnx.split(model)
  seed_2 = np.array([seed, first_row], np.int32)

  def listener(step, token_B, was_done_B):
    on_tokens(step, token_B[:n], was_done_B[:n])

  with _count_compiles() as compiled:
    t0, c0 = time.perf_counter(), compiled["compile_seconds"]
    cache, token_B, logp_B, seen_BV = jax.block_until_ready(
        _prefill(graphdef, state, tokens_BP, start_B, seed_2, settings=settings))
    # (nested jits' trace times overlap their caller's on a first call: clamp the tiny overcount)
    prefill_s = max(0.0, time.perf_counter() - t0 - (compiled["compile_seconds"] - c0))
    if on_tokens is not None:
      listener(0, np.asarray(token_B), done_B)
    _listener[0] = listener if on_tokens is not None else None
    try:
      t0, c0 = time.perf_counter(), compiled["compile_seconds"]
      out_BN, logps_BN, steps = jax.block_until_ready(
          _decode(graphdef, state, cache, token_B, logp_B, seen_BV, done_B, seed_2,
                  np.int32(max_new_tokens), settings=settings))
      decode_s = max(0.0, time.perf_counter() - t0 - (compiled["compile_seconds"] - c0))
    finally:
      _listener[0] = None
  out_BN, logps_BN, steps = sharding_lib.to_host((out_BN, logps_BN, steps))  # every process: all rows
  steps = int(steps)
  tokens, logprobs = [], []
  for b in range(n):
    row = out_BN[b, :steps]
    stops = np.flatnonzero(np.isin(row, settings.stop_ids)) if settings.stop_ids else []
    end = int(stops[0]) + 1 if len(stops) else steps
    tokens.append(row[:end].tolist())
    logprobs.append(logps_BN[b, :end].tolist())
  stats = {"prompt_tokens": sum(len(p) for p in prompts), "new_tokens": sum(len(t) for t in tokens),
           "batch": rows, "prompt_bucket": P, "cache_length": P + settings.new_bucket,
           "prefill_seconds": prefill_s, "decode_seconds": decode_s, **compiled}
  return Generation(tokens, logprobs, stats)


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             stop_ids: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
  """The continuation of each prompt (token ids; ends with the stop id when one was produced). See `sample`."""
  return sample(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                repetition_penalty=repetition_penalty, stop_ids=stop_ids, seed=seed).tokens
