"""model.generate: the KV cache against full forward passes, sampling against Hugging Face's logits processors and
a chi-square test, seeds, sharded meshes against one device, and bad input."""
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
from model import kv_cache
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48,
            max_seq_len=64, init_std=0.1)
PROMPTS = [[5, 9, 2], [7, 1, 8, 3, 3, 4, 10, 11, 12], [40]]  # three lengths, one batch


def make_model(**overrides):
  cfg = base.get_config().model
  cfg.update(**{**TINY, **overrides})
  return model.Transformer(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tiny():
  return make_model()


# ---- the cache: every decode step's logits equal a full forward pass ---------------------------------------
@jax.jit
def _cached_steps(state, graphdef, tokens_BP, start_B, feed_BN):
  """Logits of the prompts' last tokens, then of each fed token, through the cache: [N + 1, B, V]."""
  m = nnx.merge(graphdef, state)
  P = tokens_BP.shape[1]
  slots_BP = jnp.broadcast_to(jnp.arange(P), tokens_BP.shape)
  cache = kv_cache.zeros(m.cfg, start_B, P + feed_BN.shape[1])
  x, cache = m.features(tokens_BP, (slots_BP >= start_B[:, None]).astype(jnp.int32),
                        jnp.maximum(slots_BP - start_B[:, None], 0), cache=cache)

  def step(cache, token_B):
    x, cache = m.features(token_B[:, None], positions_BL=(cache.index - cache.start)[:, None], cache=cache)
    return cache, m.logits(x)[:, 0]

  _, logits_NBV = jax.lax.scan(step, cache, feed_BN.T)
  return jnp.concatenate([m.logits(x[:, -1:])[:, 0][None], logits_NBV])


@jax.jit
def _forward(state, graphdef, tokens_BL):
  return nnx.merge(graphdef, state)(tokens_BL)


def full_logits(m, rows):
  """Logits of each row alone by one plain forward pass ([rows, max_len, V]); rows are right-padded, which
  causal attention never lets the real positions see."""
  tokens = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  graphdef, state = nnx.split(m)
  return np.asarray(_forward(state, graphdef, tokens))


CACHE_CASES = {
    "gqa_xla": (dict(num_kv_heads=2), 1e-5),
    "mqa_xla_unrolled": (dict(num_kv_heads=1, scan_layers=False), 1e-5),
    # window 4 < prompt + continuation; layer 2 global: both layer kinds in one cache.
    "window_xla": (dict(sliding_window=4, global_every=2), 1e-5),
    "window_blockwise": (dict(sliding_window=4, attention_impl="blockwise", attention_block_size=4), 1e-4),
    "gqa_blockwise": (dict(attention_impl="blockwise", attention_block_size=4), 1e-4),
}


@pytest.mark.parametrize("case", sorted(CACHE_CASES))
def test_cached_logits_equal_full_forward_every_step(case):
  overrides, tol = CACHE_CASES[case]
  m = make_model(**overrides)
  N, P = 7, 16
  feed = np.random.default_rng(1).integers(0, 64, size=(len(PROMPTS), N)).astype(np.int32)
  tokens = np.zeros((len(PROMPTS), P), np.int32)
  start = np.array([P - len(p) for p in PROMPTS], np.int32)
  for b, p in enumerate(PROMPTS):
    tokens[b, P - len(p):] = p
  graphdef, state = nnx.split(m)
  got = np.asarray(_cached_steps(state, graphdef, tokens, start, feed))
  # Reference: each row without left padding, the whole sequence so far in one forward pass.
  full = full_logits(m, [list(p) + feed[b].tolist() for b, p in enumerate(PROMPTS)])
  for b, p in enumerate(PROMPTS):
    want = full[b, len(p) - 1:len(p) + N]
    np.testing.assert_allclose(got[:, b], want, atol=tol, rtol=0, err_msg=f"row {b}")


def test_generate_greedy_equals_argmax_of_full_forward_and_cache_bytes(tiny):
  got = gen.generate(tiny, PROMPTS, 6)
  # Greedy means: each generated token is the argmax of a full forward pass over everything before it.
  full = full_logits(tiny, [p + t for p, t in zip(PROMPTS, got)])
  for b, (p, tokens) in enumerate(zip(PROMPTS, got)):
    assert len(tokens) == 6
    assert tokens == np.argmax(full[b, len(p) - 1:len(p) + 5], axis=-1).tolist()
  assert kv_cache.bytes_per_token(tiny.cfg) == 2 * 2 * 8 * 4


def test_stop_ids_end_rows_and_keep_the_stop_token(tiny):
  free = gen.generate(tiny, PROMPTS, 8)
  stop = free[1][3]  # a token row 1 produces at step 3
  got = gen.generate(tiny, PROMPTS, 8, stop_ids=(stop,))
  for row, tokens in zip(free, got):
    cut = row.index(stop) + 1 if stop in row else len(row)
    assert tokens == row[:cut]
  assert got[1][-1] == stop and len(got[1]) <= 4


def test_prompt_lengths_within_a_bucket_share_one_compilation(tiny):
  gen.sample(tiny, [[1, 2, 3]], 4)
  again = gen.sample(tiny, [[4, 5, 6, 7, 8, 9, 10]], 4)  # 3 and 7 tokens: both in the 16-token bucket
  assert again.stats["compiles"] == 0 and again.stats["prompt_bucket"] == 16
  longer = gen.sample(tiny, [list(range(1, 20))], 4)  # 19 tokens: the next bucket compiles once more
  assert longer.stats["prompt_bucket"] == 32 and longer.stats["compiles"] >= 1


# ---- sampling ------------------------------------------------------------------------------------------------
def _hf_warp(logits, temperature, top_k, top_p):
  procs = transformers.LogitsProcessorList()
  if temperature != 1.0:
    procs.append(transformers.TemperatureLogitsWarper(temperature))
  if top_k:
    procs.append(transformers.TopKLogitsWarper(top_k))
  if top_p < 1.0:
    procs.append(transformers.TopPLogitsWarper(top_p))
  return procs(None, torch.tensor(logits)).numpy()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 10, 0.5), (0.5, 3, 0.3),
                                                     (1.0, 0, 0.05)])
def test_warp_logits_equals_hugging_face_processors(temperature, top_k, top_p):
  logits = np.random.default_rng(top_k).normal(0, 2, size=(6, 50)).astype(np.float32)
  logits[0, :4] = logits[0, 10]  # ties at the top-k boundary: Hugging Face keeps all of them
  want = _hf_warp(logits, temperature, top_k, top_p)
  got = np.asarray(gen.warp_logits(jnp.asarray(logits), temperature, top_k, top_p))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  kept = ~np.isinf(want)
  np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)
  assert 0 < kept.sum() < kept.size


def test_sampled_frequencies_pass_a_chi_square_test(tiny):
  temperature, top_k, top_p, n = 0.8, 12, 0.9, 3000
  prompt = [3, 14, 15]
  out = gen.sample(tiny, [prompt] * n, 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
  counts = np.bincount([t[0] for t in out.tokens], minlength=TINY["vocab_size"])
  logits = full_logits(tiny, [prompt])[0, -1:]
  warped = _hf_warp(logits, temperature, top_k, top_p)[0]
  probs = np.exp(warped.astype(np.float64) - warped[~np.isinf(warped)].max())
  probs /= probs.sum()
  kept = probs > 0
  assert counts[~kept].sum() == 0  # masked tokens are never drawn
  assert kept.sum() >= 4
  assert scipy.stats.chisquare(counts[kept], n * probs[kept]).pvalue > 1e-3
  # The returned log-probabilities are log softmax(logits / T) of the drawn token (before the masks).
  logp = jax.nn.log_softmax(logits[0] / temperature)
  np.testing.assert_allclose([lp[0] for lp in out.logprobs[:50]], np.asarray(logp)[[t[0] for t in out.tokens[:50]]],
                             atol=1e-5)


def test_seed_determines_the_tokens_and_rows_are_independent_of_the_batch(tiny):
  kw = dict(temperature=1.0, top_k=20)
  a = gen.generate(tiny, PROMPTS, 8, seed=3, **kw)
  assert gen.generate(tiny, PROMPTS, 8, seed=3, **kw) == a
  assert gen.generate(tiny, PROMPTS, 8, seed=4, **kw) != a
  # Row 0's draws use its own key: alone or beside other prompts, the same tokens.
  assert gen.generate(tiny, PROMPTS[:1], 8, seed=3, **kw) == a[:1]


# ---- the mesh ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axes", [dict(data=2, tensor=4), dict(data=8)])
def test_sharded_generation_equals_one_device(tiny, axes):
  mesh_cfg = base.get_config().mesh
  mesh_cfg.update(**axes)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(mesh_cfg), tiny.cfg, mesh)
  with parallel.activate(mesh, rules):
    sharded = model.Transformer(tiny.cfg, rngs=nnx.Rngs(0))
    spec = sharded.layers.attn.q.get_value().sharding.spec
    greedy = gen.generate(sharded, PROMPTS, 6)
    sampled = gen.sample(sharded, PROMPTS, 6, temperature=1.0, top_k=20, seed=5)
  for a, b in zip(jax.tree.leaves(nnx.state(sharded)), jax.tree.leaves(nnx.state(tiny))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert ("tensor" in spec) == ("tensor" in axes)
  assert sampled.stats["batch"] == -(-4 // axes["data"]) * axes["data"]  # 3 rows: a power of two, then the shards
  assert greedy == gen.generate(tiny, PROMPTS, 6)
  single = gen.sample(tiny, PROMPTS, 6, temperature=1.0, top_k=20, seed=5)
  assert sampled.tokens == single.tokens
  np.testing.assert_allclose(np.concatenate(sampled.logprobs), np.concatenate(single.logprobs), atol=1e-5)


# ---- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts,kwargs,message", [
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([list(range(1, 61)) + [1] * 10], {}, "more than model.max_seq_len=64"),
    ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
    ([[1, 2]], {"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
    ([[1, 2]], {"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ([[1, 2]], {"temperature": -1.0}, "temperature=-1.0 must be >= 0"),
    ([[1, 200]], {}, "token id 200 outside the vocabulary"),
    ([[1] * 60], {"max_new_tokens": 10}, "lower max_new_tokens"),
    ([], {}, "non-empty list"),
])
def test_bad_input_fails_with_a_clear_message(tiny, prompts, kwargs, message):
  kwargs = {"max_new_tokens": 4, **kwargs}
  with pytest.raises(ValueError, match=message):
    gen.generate(tiny, prompts, kwargs.pop("max_new_tokens"), **kwargs)
