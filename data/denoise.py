"""UL2's mixture of denoisers (Tay et al. 2022, "UL2: Unifying Language Learning Paradigms", sec. 3.1) for the
decoder, applied per document after tokenization and before packing.

`data.objective_mixture` ("R:0.4,X:0.4,S:0.2"; "" = off) picks one denoiser per training document:

  R  regular span corruption (T5, Raffel et al. 2020, sec. 3.1.4): mean span data.ul2_r_mean_span (3) tokens,
     data.ul2_r_rate (0.15) of the tokens corrupted;
  X  extreme span corruption: mean span data.ul2_x_mean_span (32), rate data.ul2_x_rate (0.5);
  S  sequential (prefix-LM): the document cut at k uniform in [1, n-1]; the first k tokens are the input;
  LM the plain causal document (BOS d_1..d_n EOS, no mode token), as without a mixture.

Span corruption is T5's `random_spans_noise_mask`: of n tokens, c = round(n r) are noise, split into
m = round(c / mu) spans; the noise and the n - c kept tokens are each cut into m non-empty runs at uniformly random
points and interleaved kept, noise, kept, noise, ... Each noise span becomes one sentinel in the input; the targets
are sentinel + span for every span, in order (T5's layout). meshlm rounds stochastically (floor(x + u), u ~ U[0,1))
where T5 rounds to nearest, so the expected noise count is n r and the expected span count c / mu for every n (T5
trains on equal-length chunks; meshlm's documents vary).

A denoised example is one packed segment, trained as a prefix LM (bidirectional over the input, causal over the
targets; model/attention.py `prefix_BT`):

  tokens  BOS [mode] input... target... EOS          prefix = BOS, [mode] and the input
  loss    on the next-token predictions of target... EOS (from the input's last token on)

Sentinels and mode tokens are the tokenizer's reserved pieces (data/tokenizer.py RESERVED): mode R, X, S =
<|reserved_1|>, <|reserved_2|>, <|reserved_3|> (UL2's [NLU], [NLG], [S2S]); sentinels <|reserved_4..7|>, span i
taking sentinel i mod 4 (T5 has 100 distinct ones; the spans' order tells them apart). A document whose example
would not fit data.seq_len is cut into equal chunks of at most `chunk_length` tokens, each its own example.

Determinism: the denoiser of document `index` is drawn from PCG64(salt, seed, index) and its spans from
PCG64(salt, seed, index, 1), so a resumed run (or any process layout) denoises every document as before.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

DENOISERS = ("R", "X", "S", "LM")
MODE_PIECES = {"R": "<|reserved_1|>", "X": "<|reserved_2|>", "S": "<|reserved_3|>"}
SENTINEL_PIECES = tuple(f"<|reserved_{i}|>" for i in range(4, 8))
# Folded into the generators' seeds so the draws are independent of other uses of the shuffle seed (FIM's).
_SALT = 0x554C32


class Plan(NamedTuple):
  """A document's denoiser (one of DENOISERS) and its index in the mixture (which seeds its spans)."""
  denoiser: str
  index: int


class Spans(NamedTuple):
  """Span-corruption setting: mean span length mu (tokens) and corruption rate r (fraction of tokens)."""
  mean_span: float
  rate: float


def parse_mixture(spec: str) -> dict[str, float]:
  """'R:0.4,X:0.4,S:0.2' -> {denoiser: weight / total}; ValueError naming data.objective_mixture otherwise."""
  weights = {}
  for item in (s.strip() for s in spec.split(",")):
    name, _, weight = item.partition(":")
    name = name.strip()
    try:
      w = float(weight)
    except ValueError:
      w = float("nan")
    if name not in DENOISERS or not (math.isfinite(w) and w > 0) or name in weights:
      raise ValueError(f"config.data.objective_mixture={spec!r}: item {item!r} is not NAME:WEIGHT with NAME one of "
                       f"{', '.join(DENOISERS)} (each once) and WEIGHT > 0; e.g. R:0.4,X:0.4,S:0.2")
    weights[name] = w
  total = sum(weights.values())
  return {k: v / total for k, v in weights.items()}


def check_config(config) -> None:
  """ValueError naming the key if data.objective_mixture cannot run with the rest of `config`."""
  d = config.data
  if not d.objective_mixture:
    return
  parse_mixture(d.objective_mixture)
  if config.train.objective != "lm":
    raise ValueError(f"config.data.objective_mixture needs config.train.objective=lm (the denoisers set the prefix "
                     f"and loss mask in the data); got {config.train.objective!r}")
  if d.packing != "first_fit":
    raise ValueError("config.data.objective_mixture needs config.data.packing=first_fit (concat would cut a denoised "
                     "example across rows)")
  if d.fim_rate > 0:
    raise ValueError("config.data.objective_mixture and config.data.fim_rate > 0 are exclusive; set one of them")
  if chunk_length(config.train.seq_len, span_setting(d, "X")) < 2 or \
      chunk_length(config.train.seq_len, span_setting(d, "R")) < 2:
    raise ValueError(f"config.train.seq_len={config.train.seq_len} is too short for span corruption; use >= 16")


def span_setting(data_config, name: str) -> Spans:
  """The (mean span, rate) of denoiser R or X from config.data."""
  key = name.lower()
  return Spans(float(data_config[f"ul2_{key}_mean_span"]), float(data_config[f"ul2_{key}_rate"]))


def choose(seed: int, index: int, weights: dict[str, float]) -> str:
  """The denoiser of document `index`, drawn from PCG64(salt, seed, index) with probabilities `weights`."""
  u = np.random.default_rng([_SALT, seed, index]).random()
  names = list(weights)
  cumulative = np.cumsum([weights[n] for n in names])
  return names[min(int(np.searchsorted(cumulative, u, side="right")), len(names) - 1)]


def _stochastic_round(rng: np.random.Generator, x: float) -> int:
  """floor(x + u), u ~ U[0, 1): an integer whose expectation is x."""
  return int(math.floor(x + rng.random()))


def _random_composition(rng: np.random.Generator, total: int, parts: int) -> np.ndarray:
  """`parts` positive run lengths summing to `total`, uniform over all such compositions (T5's segmentation)."""
  cuts = np.sort(rng.choice(total - 1, parts - 1, replace=False)) + 1 if parts > 1 else np.zeros(0, int)
  return np.diff(np.concatenate([[0], cuts, [total]]))


def noise_mask(rng: np.random.Generator, n: int, spans: Spans) -> np.ndarray:
  """bool [n], True = corrupted: T5's random_spans_noise_mask (module docstring) for n >= 2 tokens."""
  noise = min(max(_stochastic_round(rng, n * spans.rate), 1), n - 1)
  m = min(max(_stochastic_round(rng, noise / spans.mean_span), 1), noise, n - noise)
  noise_runs, kept_runs = _random_composition(rng, noise, m), _random_composition(rng, n - noise, m)
  runs = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)  # kept_0, noise_0, kept_1, noise_1, ...
  return np.repeat(np.tile([False, True], m), runs)


def corrupt(ids: Sequence[int], mask: np.ndarray, sentinel_ids: Sequence[int]) -> tuple[list[int], list[int]]:
  """(input, targets): each noise span of `ids` replaced by sentinel i mod len(sentinel_ids) in the input; the
  targets are sentinel + span for every span, in order."""
  inputs, targets, span = [], [], -1
  for t, (token, noisy) in enumerate(zip(ids, mask)):
    if not noisy:
      inputs.append(int(token))
      continue
    if t == 0 or not mask[t - 1]:
      span += 1
      sentinel = int(sentinel_ids[span % len(sentinel_ids)])
      inputs.append(sentinel)
      targets.append(sentinel)
    targets.append(int(token))
  return inputs, targets


def restore(inputs: Sequence[int], targets: Sequence[int], sentinel_ids: Sequence[int]) -> list[int]:
  """The original ids of a span-corrupted (input, targets) pair (inverse of `corrupt`)."""
  sentinels = set(int(s) for s in sentinel_ids)
  spans = []
  for token in targets:
    if int(token) in sentinels:
      spans.append([])
    else:
      spans[-1].append(int(token))
  out, i = [], 0
  for token in inputs:
    if int(token) in sentinels:
      out += spans[i]
      i += 1
    else:
      out.append(int(token))
  return out


def _max_spans(n: int, spans: Spans) -> int:
  """The largest span count `noise_mask` can draw for n tokens (noise count rounded down or up)."""
  most = 0
  for noise in (math.floor(n * spans.rate), math.ceil(n * spans.rate)):
    noise = min(max(noise, 1), n - 1)
    most = max(most, min(max(math.ceil(noise / spans.mean_span), 1), noise, n - noise))
  return most


def chunk_length(seq_len: int, spans: Spans | None) -> int:
  """The most document tokens one example can hold so that its model input (BOS, mode, input, targets: n + 2m + 2
  tokens for m spans; n + 2 for S) fits `seq_len`; `spans` None = S."""
  if spans is None:
    return seq_len - 2
  n = seq_len - 2
  while n >= 2 and n + 2 * _max_spans(n, spans) + 2 > seq_len:
    n -= 1
  return n


def examples(ids: Sequence[int], denoiser: str, rng: np.random.Generator, seq_len: int, spans: Spans | None,
             sentinel_ids: Sequence[int]) -> list[tuple[list[int], list[int]]]:
  """[(input, targets)] of one document's ids under denoiser R, X (span corruption with `spans`) or S (prefix
  split); the document is cut into ceil(n / chunk_length) near-equal chunks, each one example. Chunks of fewer
  than 2 tokens give none (nothing to split)."""
  ids = list(ids)
  pieces = math.ceil(len(ids) / chunk_length(seq_len, spans)) if ids else 0
  bounds = [i * len(ids) // pieces for i in range(pieces + 1)]
  out = []
  for chunk in (ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])):
    if len(chunk) < 2:
      continue
    if denoiser == "S":
      k = 1 + int(rng.integers(0, len(chunk) - 1))
      out.append((chunk[:k], chunk[k:]))
    else:
      out.append(corrupt(chunk, noise_mask(rng, len(chunk), spans), sentinel_ids))
  return out


def example_arrays(bos_id: int, eos_id: int, mode_id: int, inputs: Sequence[int],
                   targets: Sequence[int]) -> dict[str, np.ndarray]:
  """One example as the pipeline's per-document arrays: tokens BOS [mode] input targets EOS shifted into
  `inputs` / `targets` ([n]), `prefix` 1 on BOS, the mode token and the input, `loss_mask` 1 from the input's
  last token on (each position predicting a target token or EOS)."""
  seq = np.asarray([bos_id, mode_id, *inputs, *targets, eos_id], np.int32)
  t = np.arange(len(seq) - 1)
  n_prefix = 2 + len(inputs)
  return {"inputs": seq[:-1], "targets": seq[1:], "prefix": (t < n_prefix).astype(np.int32),
          "loss_mask": (t >= n_prefix - 1).astype(np.float32)}


class Denoiser:
  """Turns a tokenized document with its Plan into the pipeline's per-example arrays (module docstring)."""

  def __init__(self, tokenizer, data_config, seq_len: int):
    try:
      self.mode_ids = {k: tokenizer.special_id(p) for k, p in MODE_PIECES.items()}
      self.sentinel_ids = [tokenizer.special_id(p) for p in SENTINEL_PIECES]
    except (KeyError, AttributeError):
      raise ValueError("config.data.objective_mixture needs the tokenizer's reserved pieces "
                       f"{', '.join([*MODE_PIECES.values(), *SENTINEL_PIECES])}; use a meshlm tokenizer "
                       "(config.data.tokenizer='' trains one) or set config.data.objective_mixture=''") from None
    self.bos_id, self.eos_id, self.seed, self.seq_len = tokenizer.bos_id, tokenizer.eos_id, \
        data_config.shuffle_seed, seq_len
    self.spans = {"R": span_setting(data_config, "R"), "X": span_setting(data_config, "X"), "S": None}

  def __call__(self, ids: Sequence[int], plan: Plan) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng([_SALT, self.seed, plan.index, 1])
    return [example_arrays(self.bos_id, self.eos_id, self.mode_ids[plan.denoiser], inputs, targets)
            for inputs, targets in examples(ids, plan.denoiser, rng, self.seq_len, self.spans[plan.denoiser],
                                            self.sentinel_ids)]


class MixtureTransform:
  """grain `map_with_index` transform: (index, (source_id, text)) -> (source_id, text, Plan | None); chat sources
  (`skip_sources`) and plain-LM documents get None (left as they are)."""

  def __init__(self, seed: int, weights: dict[str, float], skip_sources: Sequence[int] = ()):
    self.seed, self.weights, self.skip = seed, weights, frozenset(skip_sources)

  def __call__(self, index: int, element):
    source_id, text = element
    if source_id in self.skip:
      return source_id, text, None
    name = choose(self.seed, index, self.weights)
    return source_id, text, None if name == "LM" else Plan(name, index)
