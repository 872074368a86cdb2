"""UL2 mixture of denoisers: span statistics against the configured values, mixture proportions, round trips of
the corrupted input + targets to the original document, the pipeline's packed layout and attention mask against a
brute-force construction, a loss over target positions only, exact resume, and refused settings."""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from configs import tiny
from data import denoise
from data import pipeline
from model import attention
from train import objectives

import word_corpus

SENTINELS = list(range(10, 14))  # stand-in sentinel ids for the token-level tests (documents use ids >= 100)
MIXTURE = "R:0.3,X:0.3,S:0.2,LM:0.2"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return word_corpus.make(tmp_path_factory.mktemp("ul2"), max_words=90)


def _spans_of(targets):
  """(noise tokens, spans) of a targets sequence: sentinels start spans, everything else is noise."""
  spans = sum(1 for t in targets if t in SENTINELS)
  return len(targets) - spans, spans


@pytest.mark.parametrize("mean_span,rate", [(3.0, 0.15), (32.0, 0.5), (8.0, 0.5)])
def test_span_corruption_statistics_match_the_configured_values(mean_span, rate):
  rng, draws = np.random.default_rng(1), np.random.default_rng(2)
  n_total = noise_total = spans_total = 0
  for _ in range(600):
    ids = draws.integers(100, 1000, size=int(draws.integers(200, 800))).tolist()
    (inputs, targets), = denoise.examples(ids, "R", rng, 2048, denoise.Spans(mean_span, rate), SENTINELS)
    noise, spans = _spans_of(targets)
    assert sum(1 for t in inputs if t in SENTINELS) == spans >= 1  # one sentinel per span in the input
    assert denoise.restore(inputs, targets, SENTINELS) == ids
    n_total, noise_total, spans_total = n_total + len(ids), noise_total + noise, spans_total + spans
  assert abs(noise_total / n_total - rate) / rate < 0.02
  assert abs(noise_total / spans_total - mean_span) / mean_span < 0.02


def test_spans_follow_t5_layout_and_lengths_are_spread():
  rng = np.random.default_rng(3)
  lengths = []
  for _ in range(300):
    mask = denoise.noise_mask(rng, 120, denoise.Spans(3.0, 0.15))
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]]))))[::2]  # noise runs
    assert not mask[0] and mask[-1]  # T5: kept, noise, ..., kept, noise
    lengths += runs.tolist()
  # Noise runs are a uniform composition: lengths 1..c-m+1 occur, not a constant span of 3.
  assert min(lengths) == 1 and max(lengths) >= 8 and abs(np.mean(lengths) - 3.0) < 0.3


def test_mixture_proportions_within_one_percent():
  weights = denoise.parse_mixture("R:4,X:4,S:1.5,LM:0.5")
  assert weights == {"R": 0.4, "X": 0.4, "S": 0.15, "LM": 0.05}
  drawn = [denoise.choose(11, i, weights) for i in range(40_000)]
  for name, w in weights.items():
    assert abs(drawn.count(name) / len(drawn) - w) < 0.01, name
  assert drawn[:50] == [denoise.choose(11, i, weights) for i in range(50)]  # a function of (seed, index)
  assert drawn[:50] != [denoise.choose(12, i, weights) for i in range(50)]


def test_long_documents_are_cut_into_examples_that_fit_and_round_trip():
  ids = np.random.default_rng(4).integers(100, 1000, size=1000).tolist()
  for name, spans in (("R", denoise.Spans(3.0, 0.15)), ("X", denoise.Spans(32.0, 0.5)), ("S", None)):
    out = denoise.examples(ids, name, np.random.default_rng(5), 128, spans, SENTINELS)
    assert len(out) > 1 and all(len(i) + len(t) + 2 <= 128 for i, t in out)  # BOS, mode, input, targets
    restored = [x for i, t in out for x in (i + t if name == "S" else denoise.restore(i, t, SENTINELS))]
    assert restored == ids


def _config(corpus, **data):
  root, _, tok = corpus
  c = tiny.get_config()
  c.model.update(vocab_size=384, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  c.train.update(batch_size=4, seq_len=128, z_loss=0.0)
  c.data.update(sources=f"jsonl:{root}/docs.jsonl", tokenizer=tok.path, eval_fraction=0.05, prefetch=0,
                objective_mixture=MIXTURE)
  c.data.update(data)
  return c


def _segments(batch, tok, config):
  """(row, token indices, kind, n_prefix) per packed segment, the layout derived from the tokens alone: BOS then a
  mode token; R/X: the input ends before the (m+1)-th of its 2m sentinels; S: from the prefix flags; LM: none."""
  d = denoise.Denoiser(tok, config.data, config.train.seq_len)
  kinds = {v: k for k, v in d.mode_ids.items()}
  out = []
  for r in range(batch["inputs"].shape[0]):
    for s in set(batch["segment_ids"][r].tolist()) - {0}:
      idx = np.flatnonzero(batch["segment_ids"][r] == s)
      tokens = batch["inputs"][r, idx]
      assert tokens[0] == tok.bos_id
      kind = kinds.get(int(tokens[1]), "LM") if len(tokens) > 1 else "LM"
      if kind in ("R", "X"):
        at = np.flatnonzero(np.isin(tokens, d.sentinel_ids))
        assert len(at) % 2 == 0
        n_prefix = int(at[len(at) // 2])
      elif kind == "S":
        n_prefix = int(batch["prefix"][r, idx].sum())
        assert 3 <= n_prefix < len(idx)
      else:
        n_prefix = 0
      out.append((r, idx, kind, n_prefix))
  return out, d


@pytest.fixture(scope="module")
def batches(corpus):
  _, _, tok = corpus
  it = pipeline.make_iterator(_config(corpus), tok, process_index=0, process_count=1)
  return [next(it) for _ in range(8)]


def test_pipeline_examples_layout_round_trip_and_brute_force_mask(corpus, batches):
  _, docs, tok = corpus
  encoded = "|" + "|".join(",".join(map(str, tok.encode(t))) for t in docs) + "|"
  seen, texts, whole = {}, set(docs), 0
  for batch in batches:
    segments, d = _segments(batch, tok, _config(corpus))
    n_prefix_at = np.zeros(batch["inputs"].shape, int)
    for r, idx, kind, n_prefix in segments:
      seen[kind] = seen.get(kind, 0) + 1
      t = np.arange(len(idx))
      want_prefix = t < n_prefix
      np.testing.assert_array_equal(batch["prefix"][r, idx], want_prefix)
      if kind == "LM":
        np.testing.assert_array_equal(batch["loss_mask"][r, idx], 1.0)
        continue
      np.testing.assert_array_equal(batch["loss_mask"][r, idx], t >= n_prefix - 1)
      assert batch["targets"][r, idx[-1]] == tok.eos_id
      seq = batch["inputs"][r, idx].tolist() + [tok.eos_id]
      inputs, targets = seq[2:n_prefix], seq[n_prefix:-1]
      ids = inputs + targets if kind == "S" else denoise.restore(inputs, targets, d.sentinel_ids)
      # The corrupted input + targets decode back to the original document (or a chunk of a long one).
      assert "," + ",".join(map(str, ids)) + "," in encoded.replace("|", ",")
      whole += tok.decode(ids) in texts
      n_prefix_at[r, idx] = n_prefix
    # The model's attention mask equals a loop over (query, key) pairs from the token-derived layout.
    seg, B, L = batch["segment_ids"], *batch["inputs"].shape
    got = np.asarray(attention.mask_fn(jnp.arange(L), jnp.arange(L), seg, seg, 0, True, batch["prefix"],
                                       batch["prefix"]))
    pos = batch["positions"]
    want = np.zeros((B, L, L), bool)
    for b in range(B):
      for i in range(L):
        for j in range(L):
          in_prefix = pos[b, i] < n_prefix_at[b, i] and pos[b, j] < n_prefix_at[b, j]
          want[b, i, j] = seg[b, i] == seg[b, j] > 0 and (j <= i or in_prefix)
    np.testing.assert_array_equal(got[seg > 0], want[seg > 0])
  assert all(seen.get(k, 0) >= 2 for k in ("R", "X", "S", "LM")), seen
  assert whole >= 20  # unchunked documents restore to their exact text


def test_loss_counts_only_target_positions(corpus, batches):
  _, _, tok = corpus
  c = _config(corpus)
  objective = objectives.make(c)
  assert "prefix" in objective.batch_keys
  m = model_lib.Transformer(c.model, rngs=nnx.Rngs(0))
  batch = {k: jnp.asarray(v) for k, v in batches[0].items() if k in objective.batch_keys}
  sums = nnx.jit(lambda m, b: objective.sums(m, b, {}, {}))(m, batch)
  segments, _ = _segments(batches[0], tok, c)
  target = np.zeros(batch["inputs"].shape, bool)
  for r, idx, kind, n_prefix in segments:
    target[r, idx] = np.arange(len(idx)) >= max(n_prefix - 1, 0)
  assert 0 < target.sum() < (batches[0]["segment_ids"] > 0).sum()

  forward = nnx.jit(lambda m, b, prefix: m(b["inputs"], b["segment_ids"], b["positions"], prefix_BL=prefix))

  def numpy_loss(prefix):
    logits = np.asarray(forward(m, batch, prefix), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    return nll[target].mean()

  assert float(sums["tokens"]) == target.sum()
  np.testing.assert_allclose(float(sums["ce"] / sums["tokens"]), numpy_loss(batch["prefix"]), rtol=1e-5)
  # The prefix reaches the model: without it (all zeros = causal) the loss differs.
  assert abs(numpy_loss(jnp.zeros_like(batch["prefix"])) - numpy_loss(batch["prefix"])) > 1e-4


def test_resume_is_exact_and_lm_only_mixture_equals_plain_batches(corpus):
  _, _, tok = corpus
  config = _config(corpus)
  it = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  for _ in range(3):
    next(it)
  state = it.get_state()
  after = [next(it) for _ in range(2)]
  resumed = pipeline.make_iterator(config, tok, process_index=0, process_count=1)
  resumed.set_state(state)
  for a, b in zip(after, [next(resumed) for _ in range(2)]):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  with pytest.raises(ValueError, match="objective_mixture"):  # a state saved without the mixture is refused
    plain = pipeline.make_iterator(_config(corpus, objective_mixture=""), tok, process_index=0, process_count=1)
    next(plain)
    resumed.set_state(plain.get_state())
  lm_only = pipeline.make_iterator(_config(corpus, objective_mixture="LM:1"), tok, process_index=0, process_count=1)
  plain = pipeline.make_iterator(_config(corpus, objective_mixture=""), tok, process_index=0, process_count=1)
  a, b = next(lm_only), next(plain)
  assert (a.pop("prefix") == 0).all() and a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  evaluation = pipeline.make_iterator(config, tok, split="eval", process_index=0, process_count=1)
  assert (next(evaluation)["prefix"] == 0).all()  # held-out batches stay left-to-right


@pytest.mark.parametrize("override,match", [
    ("--config.data.objective_mixture=R:0.5,Q:0.5", "objective_mixture"),
    ("--config.data.objective_mixture=R:0.5,R:0.5", "objective_mixture"),
    ("--config.data.objective_mixture=R:-1", "objective_mixture"),
    ("--config.train.objective=prefix_lm", "train.objective=lm"),
    ("--config.data.packing=concat", "first_fit"),
    ("--config.data.fim_rate=0.5", "fim_rate"),
    ("--config.data.ul2_x_rate=1.0", "ul2_x_rate"),
])
def test_bad_settings_are_refused_naming_the_key(override, match):
  argv = ["--config=tiny", "--config.data.objective_mixture=R:0.5,X:0.5", override]
  with pytest.raises(configs.ConfigError, match=match):
    configs.parse(argv, argparse.ArgumentParser())
