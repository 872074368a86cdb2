"""Chunked prefill: a prompt fed through the KV cache in several calls, then decoded, gives the logits of one
full forward pass (dense, GQA, sliding window, MoE dropless); unsupported configurations raise ValueError."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model
from configs import base
from model import generate as gen
from model import kv_cache

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=48,
            max_seq_len=64, init_std=0.1)
PROMPTS = [[5, 9, 2, 17, 33], [7, 1, 8, 3, 3, 4, 10, 11, 12, 13, 40, 41, 2], [40, 6, 6, 6, 1, 2, 3]]
P, N = 16, 6  # prompt slots (left-padded), decode steps


def make_model(**overrides):
  cfg = base.get_config().model
  cfg.update(**{**TINY, **overrides})
  return model.Transformer(cfg, rngs=nnx.Rngs(0))


def _chunked_logits(m, tokens_BP, start_B, feed_BN, edges):
  """Logits [B, P + N, V] of every prompt slot and every fed token: the prompt through the cache in chunks
  [edges[i], edges[i+1]) (default segment ids and positions, as kv_cache's slots define them), then one decode
  step per fed token."""
  graphdef, state = nnx.split(m)

  @jax.jit
  def run(state, tokens_BP, start_B, feed_BN):
    m = nnx.merge(graphdef, state)
    cache = kv_cache.zeros(m.cfg, start_B, P + N)
    out = []
    for a, e in zip(edges[:-1], edges[1:]):
      x_BLD, cache = m.features(tokens_BP[:, a:e], cache=cache)
      out.append(m.logits(x_BLD))

    def step(cache, token_B):
      x_B1D, cache = m.features(token_B[:, None], positions_BL=(cache.index - cache.start)[:, None], cache=cache)
      return cache, m.logits(x_B1D)[:, 0]

    _, logits_NBV = jax.lax.scan(step, cache, feed_BN.T)
    return jnp.concatenate(out + [logits_NBV.transpose(1, 0, 2)], axis=1)

  return np.asarray(run(state, tokens_BP, start_B, feed_BN))


def _inputs():
  feed = np.random.default_rng(1).integers(0, 64, size=(len(PROMPTS), N)).astype(np.int32)
  tokens = np.zeros((len(PROMPTS), P), np.int32)
  start = np.array([P - len(p) for p in PROMPTS], np.int32)
  for b, p in enumerate(PROMPTS):
    tokens[b, P - len(p):] = p
  return tokens, start, feed


def _full_logits(m, rows):
  """Each row's whole sequence in one plain forward pass (no cache, right-padded): [rows, max_len, V]."""
  tokens = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
  for b, r in enumerate(rows):
    tokens[b, :len(r)] = r
  return np.asarray(jax.jit(lambda t: m(t))(tokens))


CASES = {
    "dense": dict(),
    "gqa": dict(num_kv_heads=2),
    "mqa_unrolled": dict(num_kv_heads=1, scan_layers=False),
    # window 4, shorter than the chunks and the prompts; layer 2 global: both layer kinds in one cache.
    "window": dict(sliding_window=4, global_every=2),
    "window_blockwise": dict(sliding_window=4, attention_impl="blockwise", attention_block_size=4),
    "moe_dropless": dict(num_layers=2, num_experts=4, experts_per_token=2, moe_every=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("edges", [(0, 7, 16), (0, 5, 11, 16)])
def test_chunked_prefill_then_decode_equals_one_full_forward_pass(case, edges):
  m = make_model(**CASES[case])
  tokens, start, feed = _inputs()
  got = _chunked_logits(m, tokens, start, feed, edges)
  full = _full_logits(m, [list(p) + feed[b].tolist() for b, p in enumerate(PROMPTS)])
  for b, p in enumerate(PROMPTS):
    # Slot s >= start holds prompt token s - start; the fed tokens follow at slots P, P + 1, ...
    want = np.concatenate([full[b, :len(p)], full[b, len(p):len(p) + N - 1]])
    have = np.concatenate([got[b, P - len(p):P], got[b, P:P + N - 1]])
    np.testing.assert_allclose(have, want, atol=1e-5, rtol=0, err_msg=f"{case} row {b}")


def test_a_chunk_of_one_token_and_a_whole_prompt_agree():
  """Chunks of 1 (every prompt token a decode step) equal the one-call prefill used by `generate`."""
  m = make_model(num_kv_heads=2, sliding_window=4, global_every=2)
  tokens, start, feed = _inputs()
  whole = _chunked_logits(m, tokens, start, feed, (0, P))
  ones = _chunked_logits(m, tokens, start, feed, tuple(range(P + 1)))
  real = np.arange(P)[None, :] >= start[:, None]
  np.testing.assert_allclose(ones[:, :P][real], whole[:, :P][real], atol=1e-5, rtol=0)
  np.testing.assert_allclose(ones[:, P:], whole[:, P:], atol=1e-5, rtol=0)


def test_generation_is_unchanged_by_the_chunked_path():
  """generate's one-call prefill into an empty cache still takes the attention_impl path and agrees with the
  argmax of full forward passes."""
  m = make_model(num_kv_heads=2)
  got = gen.generate(m, PROMPTS, N)
  full = _full_logits(m, [p + t for p, t in zip(PROMPTS, got)])
  for b, (p, t) in enumerate(zip(PROMPTS, got)):
    assert t == np.argmax(full[b, len(p) - 1:len(p) + N - 1], axis=-1).tolist()


def test_is_empty_is_static_only_for_a_fresh_cache():
  m = make_model()
  cache = kv_cache.zeros(m.cfg, jnp.zeros((2,), jnp.int32), 8)
  assert kv_cache.is_empty(cache)
  _, after = m.features(jnp.ones((2, 3), jnp.int32), cache=cache)
  assert not kv_cache.is_empty(after) and int(after.index) == 3
  assert not kv_cache.is_empty(cache._replace(index=jnp.int32(0)))  # an array: not known to be 0 when traced


def test_unsupported_cached_calls_raise():
  cf = make_model(num_experts=4, experts_per_token=2, capacity_factor=1.0)
  cache = kv_cache.zeros(cf.cfg, jnp.zeros((1,), jnp.int32), 16)
  _, cache = cf.features(jnp.ones((1, 4), jnp.int32), cache=cache)  # one whole prompt: fine
  with pytest.raises(ValueError, match="capacity_factor > 0"):
    cf.features(jnp.ones((1, 4), jnp.int32), cache=cache)
  cf.features(jnp.ones((1, 1), jnp.int32), cache=cache)  # a decode step: fine
  m = make_model()
  cache = kv_cache.zeros(m.cfg, jnp.zeros((1,), jnp.int32), 8)
  _, cache = m.features(jnp.ones((1, 6), jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="do not fit the cache's 8 slots"):
    m.features(jnp.ones((1, 3), jnp.int32), cache=cache)
  with pytest.raises(ValueError, match="cannot be used with a KV cache"):
    m.features(jnp.ones((1, 1), jnp.int32), cache=cache, prefix_BL=jnp.ones((1, 1), jnp.int32))
  encoder = make_model(causal=False)
  with pytest.raises(ValueError, match="causal=False"):
    encoder.features(jnp.ones((1, 2), jnp.int32), cache=kv_cache.zeros(encoder.cfg, jnp.zeros((1,), jnp.int32), 4))
