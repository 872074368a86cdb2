"""Attention implementations against a brute-force loop reference: forward and gradients, all mask kinds."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention

B, T, H, G, K = 2, 21, 4, 2, 8  # T not a multiple of the block size: exercises padding


def brute_force(q, k, v, seg, window):
  """Per (batch, head, query) softmax over the keys it may see, written as loops (float64)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros_like(q)
  rep = q.shape[2] // k.shape[2]
  for b in range(q.shape[0]):
    for h in range(q.shape[2]):
      g = h // rep  # Hugging Face repeat_kv: query head h reads kv head h // rep
      for t in range(q.shape[1]):
        keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t] and (window == 0 or t - s < window)]
        scores = np.array([q[b, t, h] @ k[b, s, g] for s in keys]) / np.sqrt(q.shape[-1])
        p = np.exp(scores - scores.max())
        p /= p.sum()
        out[b, t, h] = sum(pi * v[b, s, g] for pi, s in zip(p, keys))
  return out


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  k = rng.normal(size=(B, T, G, K)).astype(np.float32)
  v = rng.normal(size=(B, T, G, K)).astype(np.float32)
  # Row 0: one document. Row 1: three packed documents and trailing padding (segment 0).
  seg = np.array([[1] * T, [1] * 6 + [2] * 9 + [3] * 3 + [0] * 3], np.int32)
  return q, k, v, seg


MASKS = {"causal": 0, "window": 4}
IMPLS = {
    "xla": attention.xla_attention,
    "dot_product": attention.dot_product_attention,
    "blockwise": functools.partial(attention.blockwise_attention, block_size=8),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_forward_matches_brute_force(impl, mask, inputs):
  q, k, v, seg = inputs
  got = jax.jit(IMPLS[impl], static_argnums=4)(q, k, v, seg, MASKS[mask])
  np.testing.assert_allclose(np.asarray(got), brute_force(q, k, v, seg, MASKS[mask]), atol=2e-5)


@pytest.mark.parametrize("impl", ["dot_product", "blockwise"])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_gradients_match_reference(impl, mask, inputs):
  q, k, v, seg = inputs
  w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, K)), jnp.float32)
  # Reference gradients: autodiff through the plain XLA attention, checked against brute force above.
  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v, seg, MASKS[mask]) * w)
  want = jax.jit(jax.grad(loss(attention.xla_attention), argnums=(0, 1, 2)))(q, k, v)
  got = jax.jit(jax.grad(loss(IMPLS[impl]), argnums=(0, 1, 2)))(q, k, v)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5)


def test_gradients_of_reference_match_finite_differences(inputs):
  q, k, v, seg = (a[:1, :6] for a in inputs)
  f = lambda q: jnp.sum(jnp.sin(attention.xla_attention(q, k, v, seg, 3)))
  g = np.asarray(jax.grad(f)(jnp.asarray(q, jnp.float32)))
  q64 = q.astype(np.float64)
  idx = (0, 4, 1, 3)
  eps = 1e-3
  def f64(qq):
    return np.sin(brute_force(qq, k, v, seg, 3)).sum()
  qp, qm = q64.copy(), q64.copy()
  qp[idx] += eps
  qm[idx] -= eps
  assert abs((f64(qp) - f64(qm)) / (2 * eps) - g[idx]) < 1e-3


def test_traced_window_equals_static(inputs):
  q, k, v, seg = inputs
  for impl in IMPLS.values():
    traced = jax.jit(impl)(q, k, v, seg, jnp.int32(4))
    np.testing.assert_allclose(np.asarray(traced), brute_force(q, k, v, seg, 4), atol=2e-5)


def test_gqa_with_all_kv_heads_is_mha(inputs):
  q, _, _, seg = inputs
  rng = np.random.default_rng(2)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  v = rng.normal(size=(B, T, H, K)).astype(np.float32)
  # Plain multi-head attention, one head at a time, no grouping anywhere.
  mha = np.stack([brute_force(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1], seg, 0)[:, :, 0]
                  for h in range(H)], axis=2)
  for impl in IMPLS.values():
    np.testing.assert_allclose(np.asarray(impl(q, k, v, seg, 0)), mha, atol=2e-5)


def test_blockwise_memory_is_linear_in_length():
  def temp_bytes(fn, t):
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    loss = lambda q, k, v, s: jnp.sum(fn(q, k, v, s, 0))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes
  blockwise = functools.partial(attention.blockwise_attention, block_size=128)
  small, large = temp_bytes(blockwise, 1024), temp_bytes(blockwise, 4096)
  assert large < 6 * small, (small, large)  # 4x the length: ~4x the memory, not 16x
  ref_small, ref_large = temp_bytes(attention.xla_attention, 1024), temp_bytes(attention.xla_attention, 4096)
  assert ref_large > 8 * ref_small, (ref_small, ref_large)  # the reference is quadratic
