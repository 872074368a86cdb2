"""model.generate's repetition penalty and min-p against transformers: the processors on the same logits, the
whole chain in the order transformers' generate builds it, greedy decoding with a penalty against
transformers' generate on the same weights, a chi-square test of the draws, and bad values."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import transformers
from flax import nnx

import model
import parallel
from configs import base
from model import generate as gen
from model import hf
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
from test_generate_hf import _random_hf_model

V = 50


def _logits_and_ids(seed, rows=4, length=12):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal((rows, V)) * 3).astype(np.float32)  # both signs: penalty divides or multiplies
  ids = rng.integers(0, V, size=(rows, length))
  ids[:, :3] = ids[:, 3:6]  # repeats: the penalty applies once per id, however often it occurs
  return logits, ids


def _seen(ids):
  return gen.seen_tokens(jnp.asarray(ids), jnp.ones(ids.shape, bool), V)


def _settings(**kw):
  base_kw = dict(rules=(), new_bucket=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                 stop_ids=(), stream=False)
  return gen._Settings(**{**base_kw, **kw})  # pylint: disable=protected-access


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
def test_repetition_penalty_equals_transformers(penalty):
  logits, ids = _logits_and_ids(0)
  want = transformers.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(ids), torch.tensor(logits)).numpy()
  got = np.asarray(gen.penalize_repeats(jnp.asarray(logits), _seen(ids), penalty))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)  # XLA may divide as a multiply by 1/p: 1 ulp
  assert (np.abs(got - logits) > 1e-3).sum() >= 5


def test_seen_tokens_ignores_padding():
  ids = np.array([[0, 0, 5, 7], [3, 3, 3, 9]])
  real = np.array([[False, False, True, True], [True, True, True, True]])
  seen = np.asarray(gen.seen_tokens(jnp.asarray(ids), jnp.asarray(real), 10))
  assert seen[0].nonzero()[0].tolist() == [5, 7] and seen[1].nonzero()[0].tolist() == [3, 9]


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.1), (0.7, 0.05), (1.5, 0.3), (1.0, 1.0), (0.5, 0.0)])
def test_min_p_equals_transformers(temperature, min_p):
  logits, _ = _logits_and_ids(1)
  procs = transformers.LogitsProcessorList([transformers.TemperatureLogitsWarper(temperature),
                                            transformers.MinPLogitsWarper(min_p)])
  want = procs(None, torch.tensor(logits)).numpy()
  got = np.asarray(gen.warp_logits(jnp.asarray(logits), temperature, min_p=min_p))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  kept = ~np.isinf(want)
  np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)
  assert kept.sum(-1).min() >= 1  # the most likely token always stays


def _hf_chain(logits, ids, **kw):
  """The processors transformers' generate builds for these settings (its own order), applied to the logits."""
  ref = _random_hf_model("llama", vocab_size=V)
  config = transformers.GenerationConfig(do_sample=True, **kw)
  build = ref._get_logits_processor  # pylint: disable=protected-access
  procs = build(config, input_ids_seq_length=ids.shape[1], device="cpu",
                model_kwargs={"attention_mask": torch.ones(ids.shape, dtype=torch.long)})
  return procs(torch.tensor(ids), torch.tensor(logits)).numpy(), [type(p).__name__ for p in procs]


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3, temperature=0.7, top_k=10, top_p=0.9, min_p=0.05),
    dict(repetition_penalty=1.8, temperature=1.2, top_k=0, top_p=0.6, min_p=0.2),
    dict(repetition_penalty=0.8, temperature=1.0, top_k=5, top_p=1.0, min_p=0.1),
])
def test_whole_chain_equals_transformers_generate_order(kw):
  logits, ids = _logits_and_ids(2)
  want, names = _hf_chain(logits, ids, **kw)
  # transformers' order: the penalty (a processor) first, then temperature, top-k, top-p, min-p (the warpers).
  order = ["RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
           "MinPLogitsWarper"]
  assert names == [n for n in order if n in names]
  s = _settings(**kw)
  got = np.asarray(gen.warp_logits(gen.penalize_repeats(jnp.asarray(logits), _seen(ids), s.repetition_penalty),
                                   s.temperature, s.top_k, s.top_p, s.min_p))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  kept = ~np.isinf(want)
  np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5)
  assert 0 < kept.sum() < kept.size


PROMPTS = [[5, 17, 30, 5, 17], [7, 1, 8, 3, 3, 4, 10, 11, 12, 60, 61], [40, 2, 9, 90, 33, 12]]
NEW = 12


@pytest.mark.parametrize("model_type,overrides,penalty", [
    ("llama", dict(), 1.5),
    ("mistral", dict(sliding_window=6, num_key_value_heads=1), 1.2),
])
def test_greedy_with_repetition_penalty_equals_transformers_generate(model_type, overrides, penalty, tmp_path):
  ref = _random_hf_model(model_type, **overrides)
  ref.save_pretrained(tmp_path)
  m = hf.load(str(tmp_path))
  ours = gen.generate(m, PROMPTS, NEW, repetition_penalty=penalty, stop_ids=(2,))
  assert ours != gen.generate(m, PROMPTS, NEW, stop_ids=(2,))  # the penalty changes the greedy continuations
  for prompt, got in zip(PROMPTS, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, repetition_penalty=penalty, eos_token_id=2,
                         pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert got == (want[:want.index(2) + 1] if 2 in want else want)
  assert sum(len(t) for t in ours) > 2 * NEW  # long continuations, not just early stops


TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
            max_seq_len=64, init_std=0.1)


@pytest.fixture(scope="module")
def tiny():
  cfg = base.get_config().model
  cfg.update(**TINY)
  return model.Transformer(cfg, rngs=nnx.Rngs(0))


def test_sampled_frequencies_with_penalty_and_min_p_pass_a_chi_square_test(tiny):
  kw = dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.2, repetition_penalty=3.0)
  prompt, n = [63, 62, 61, 8, 21, 5], 3000  # ids among the most likely next ones: the penalty matters
  out = gen.sample(tiny, [prompt] * n, 1, seed=11, **kw)
  counts = np.bincount([t[0] for t in out.tokens], minlength=TINY["vocab_size"])
  logits = np.asarray(tiny(jnp.asarray([prompt])))[:, -1]
  warped, _ = _hf_chain(logits, np.asarray([prompt]), **kw)
  probs = np.exp(warped[0].astype(np.float64) - warped[0][~np.isinf(warped[0])].max())
  probs /= probs.sum()
  kept = probs > 0
  assert counts[~kept].sum() == 0 and 4 <= kept.sum() < kept.size  # min-p removed some, never drawn
  unpenalized, _ = _hf_chain(logits, np.asarray([prompt]), **{**kw, "repetition_penalty": 1.0})
  assert [t for t in prompt if kept[t]] != [t for t in prompt if not np.isinf(unpenalized[0, t])]
  assert scipy.stats.chisquare(counts[kept], n * probs[kept]).pvalue > 1e-3
  # The log-probabilities stay those of the model: log softmax(logits / T), before the penalty and the warpers.
  logp = np.asarray(jax.nn.log_softmax(logits[0] / kw["temperature"]))
  np.testing.assert_allclose([lp[0] for lp in out.logprobs[:50]], logp[[t[0] for t in out.tokens[:50]]], atol=1e-5)


def test_sharded_generation_with_penalty_and_min_p_equals_one_device(tiny):
  mesh_cfg = base.get_config().mesh
  mesh_cfg.update(data=2, tensor=4)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(mesh_cfg), tiny.cfg, mesh)
  prompts, kw = [[5, 9, 2, 5], [7, 1, 8, 3, 3, 4], [40]], dict(min_p=0.1, repetition_penalty=1.5)
  with parallel.activate(mesh, rules):
    sharded = model.Transformer(tiny.cfg, rngs=nnx.Rngs(0))
    greedy = gen.generate(sharded, prompts, 8, **kw)
    sampled = gen.generate(sharded, prompts, 8, temperature=1.0, seed=5, **kw)
  assert greedy == gen.generate(tiny, prompts, 8, **kw)
  assert sampled == gen.generate(tiny, prompts, 8, temperature=1.0, seed=5, **kw)


@pytest.mark.parametrize("kwargs,message", [
    ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 must be a finite number > 0"),
    ({"repetition_penalty": -1.0}, r"repetition_penalty=-1.0 must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty=inf must be a finite number > 0"),
    ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\]"),
    ({"min_p": 1.5}, r"min_p=1.5 must be in \[0, 1\]"),
])
def test_bad_values_fail_with_a_clear_message(tiny, kwargs, message):
  with pytest.raises(ValueError, match=message):
    gen.generate(tiny, [[1, 2]], 4, **kwargs)
