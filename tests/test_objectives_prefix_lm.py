"""Prefix-LM: attention masks on packed rows equal a brute-force construction (every implementation, forward and
the blockwise backward), the per-document split, and a loss over target positions only."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from model import attention
from train.core import step as step_lib
from train.objectives import prefix_lm

from attention_testing import brute_force_attention

B, T, H, G, K = 2, 21, 4, 2, 8
SEG = np.array([[1] * T, [1] * 6 + [2] * 9 + [3] * 3 + [0] * 3], np.int32)
PREFIX = np.zeros((B, T), np.int32)
PREFIX[0, :5] = 1
PREFIX[1, :2] = 1  # document 1: 2 prefix tokens
PREFIX[1, 6:13] = 1  # document 2: 7 of its 9 tokens
PREFIX[1, 15:18] = 1  # document 3: all of it


def brute_force_mask(seg, prefix):
  """visible[b, i, j]: same segment and (j <= i, or both in the prefix), as loops."""
  m = np.zeros((seg.shape[0], seg.shape[1], seg.shape[1]), bool)
  for b in range(seg.shape[0]):
    for i in range(seg.shape[1]):
      for j in range(seg.shape[1]):
        m[b, i, j] = seg[b, i] == seg[b, j] and (j <= i or (prefix[b, i] == 1 and prefix[b, j] == 1))
  return m


def test_prefix_mask_equals_brute_force_on_packed_rows():
  want = brute_force_mask(SEG, PREFIX)
  got = attention.mask_fn(jnp.arange(T), jnp.arange(T), SEG, SEG, 0, True, PREFIX, PREFIX)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert want[1, 7, 12] and not want[1, 7, 13] and not want[1, 13, 14] and not want[1, 5, 6]


@pytest.mark.parametrize("impl", ["xla", "dot_product", "blockwise"])
def test_prefix_attention_matches_brute_force(impl):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k, v = (rng.normal(size=(B, T, G, K)).astype(np.float32) for _ in range(2))
  fn = {"xla": attention.xla_attention, "dot_product": attention.dot_product_attention,
        "blockwise": functools.partial(attention.blockwise_attention, block_size=8)}[impl]
  got = jax.jit(functools.partial(fn, prefix_BT=PREFIX))(q, k, v, SEG, 0)
  np.testing.assert_allclose(np.asarray(got), brute_force_attention(q, k, v, brute_force_mask(SEG, PREFIX)),
                             atol=2e-5)
  if impl == "blockwise":
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, SEG, 0, prefix_BT=PREFIX))))
    want = jax.grad(loss(attention.xla_attention), argnums=(0, 1, 2))(q, k, v)
    have = jax.grad(loss(functools.partial(attention.blockwise_attention, block_size=8)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(have, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def _config():
  c = configs.load("tiny")
  c.model.update(vocab_size=128, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                 max_seq_len=32, init_std=0.2)
  c.train.update(batch_size=8, seq_len=32, objective="prefix_lm", z_loss=0.0)
  return c


def test_split_is_per_document_and_the_loss_mask_keeps_only_targets():
  c = _config()
  batch = step_lib.synthetic_batch(c, 0)
  objective = prefix_lm.PrefixLanguageModel(c)
  got = jax.device_get(objective.prepare({k: jnp.asarray(v) for k, v in batch.items()}, jax.random.PRNGKey(3)))
  splits = []
  for b in range(c.train.batch_size):
    for s in set(batch["segment_ids"][b].tolist()) - {0}:
      idx = np.flatnonzero(batch["segment_ids"][b] == s)
      prefix = got["prefix"][b, idx]
      k = int(prefix.sum())
      assert 1 <= k <= len(idx) - 1 and (prefix[:k] == 1).all() and (prefix[k:] == 0).all()  # a leading run
      want_mask = batch["loss_mask"][b, idx] * (np.arange(len(idx)) >= k - 1)
      np.testing.assert_array_equal(got["loss_mask"][b, idx], want_mask)
      if len(idx) > 2:
        splits.append((k - 1) / (len(idx) - 2))
  assert (got["prefix"][batch["segment_ids"] == 0] == 0).all()
  assert 0.3 < np.mean(splits) < 0.7  # uniform split points: mean near 1/2 over 24 documents


def test_prefix_tokens_see_later_prefix_tokens_and_targets_stay_causal():
  c = _config()
  m = model_lib.Transformer(c.model, rngs=nnx.Rngs(0))
  tokens = np.random.default_rng(1).integers(30, 128, size=(1, 16)).astype(np.int32)
  seg = np.ones((1, 16), np.int32)
  prefix = (np.arange(16) < 6).astype(np.int32)[None]
  forward = nnx.jit(lambda m, x: m(x, jnp.asarray(seg), prefix_BL=jnp.asarray(prefix)))
  base = np.asarray(forward(m, jnp.asarray(tokens)))
  for t, moved_before in ((4, True), (10, False)):
    changed = tokens.copy()
    changed[0, t] = (tokens[0, t] + 1) % 128
    moved = np.abs(np.asarray(forward(m, jnp.asarray(changed))) - base).max(-1)[0]
    assert (moved[:t] > 1e-6).all() if moved_before else moved[:t].max() == 0.0
