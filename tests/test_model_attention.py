"""Attention implementations against a brute-force loop reference: forward and gradients, all mask kinds."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import attention
from attention_testing import brute_force_attention

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
    # Query blocks of 6, 5, 5, 5 rows (T = 21), each against the keys up to its end only.
    "xla_query_blocks": functools.partial(attention.xla_attention, query_block=6),
}


@pytest.fixture(scope="module")
def expected(inputs):
  return {name: brute_force(*inputs, w) for name, w in MASKS.items()}


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_forward_matches_brute_force(impl, inputs, expected):
  # The window is traced, as inside the scanned layer stack (one compilation serves every mask).
  fn = jax.jit(IMPLS[impl])
  for mask, window in MASKS.items():
    got = fn(*inputs, jnp.int32(window))
    np.testing.assert_allclose(np.asarray(got), expected[mask], atol=2e-5, err_msg=mask)
  # A static Python window (the unrolled-layer path) gives the same numbers.
  got = jax.jit(IMPLS[impl], static_argnums=4)(*inputs, MASKS["window"])
  np.testing.assert_allclose(np.asarray(got), expected["window"], atol=2e-5)


def _grad_fn(impl, w):
  loss = lambda q, k, v, seg, window: jnp.sum(impl(q, k, v, seg, window) * w)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("impl", ["dot_product", "blockwise", "xla_query_blocks"])
def test_gradients_match_reference(impl, inputs):
  w = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, K)), jnp.float32)
  # Reference gradients: autodiff through the plain XLA attention (itself checked against finite differences).
  ref, fn = _grad_fn(attention.xla_attention, w), _grad_fn(IMPLS[impl], w)
  for mask, window in MASKS.items():
    want, got = ref(*inputs, jnp.int32(window)), fn(*inputs, jnp.int32(window))
    for g, r in zip(got, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, err_msg=mask)


def test_reference_gradient_matches_finite_differences(inputs):
  q, k, v, seg = (a[:1, :6] for a in inputs)
  g = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(attention.xla_attention(q, k, v, seg, 3)))))(q)
  idx, eps = (0, 4, 1, 3), 1e-3
  qp, qm = q.astype(np.float64), q.astype(np.float64)
  qp[idx] += eps
  qm[idx] -= eps
  fd = (np.sin(brute_force(qp, k, v, seg, 3)).sum() - np.sin(brute_force(qm, k, v, seg, 3)).sum()) / (2 * eps)
  assert abs(fd - float(g[idx])) < 1e-3


def test_gqa_with_all_kv_heads_is_mha(inputs):
  q, _, _, seg = inputs
  rng = np.random.default_rng(2)
  k = rng.normal(size=(B, T, H, K)).astype(np.float32)
  v = rng.normal(size=(B, T, H, K)).astype(np.float32)
  # Plain multi-head attention, one head at a time, no grouping anywhere.
  mha = np.stack([brute_force(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1], seg, 0)[:, :, 0]
                  for h in range(H)], axis=2)
  for name in ("xla", "blockwise"):
    np.testing.assert_allclose(np.asarray(jax.jit(IMPLS[name])(q, k, v, seg, 0)), mha, atol=2e-5, err_msg=name)


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
  # The reference materialises [T, T] scores: far more at 4096 tokens.
  assert temp_bytes(attention.xla_attention, 4096) > 8 * large


def _tree_mask(seg, branch):
  """Loops: query t sees key s <= t of its segment when s is on the trunk (branch 0) or on t's own branch."""
  Bn, Tn = seg.shape
  mask = np.zeros((Bn, Tn, Tn), bool)
  for b in range(Bn):
    for t in range(Tn):
      for s in range(t + 1):
        mask[b, t, s] = seg[b, s] == seg[b, t] and branch[b, s] in (0, branch[b, t])
  return mask


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_tree_attention_branches_see_trunk_and_themselves(impl, inputs):
  q, k, v, seg = inputs
  # Row 0: a trunk of 5 then branches 1, 2, 3; row 1: two segments, each a trunk and two branches, padding.
  branch = np.array([[0] * 5 + [1] * 4 + [2] * 7 + [3] * 5,
                     [0] * 3 + [1] * 2 + [2] * 1 + [0] * 4 + [1] * 3 + [2] * 5 + [0] * 3], np.int32)
  mask = _tree_mask(seg, branch)
  want = brute_force_attention(q, k, v, mask)
  fn = jax.jit(lambda q, k, v, seg, w, br: IMPLS[impl](q, k, v, seg, w, branch_BT=br))
  got = fn(q, k, v, seg, jnp.int32(0), branch)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
  if impl == "blockwise":  # the custom VJP carries the branch codes too
    w = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, H, K)), jnp.float32)
    grads = [jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, seg, 0, branch_BT=branch) * w),
                              argnums=(0, 1, 2)))(q, k, v) for f in (attention.xla_attention, IMPLS[impl])]
    for g, r in zip(grads[1], grads[0]):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5)


def test_query_blocks_stay_whole_when_the_mesh_splits_the_length(inputs, expected):
  """Under sequence parallelism the queries' length is split over devices: slicing it into blocks would move
  queries between them, so the square is computed whole (one pair of products instead of one per block)."""
  import parallel
  from model import axes
  dots = lambda: sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(IMPLS["xla_query_blocks"])(
      *inputs, 0).eqns)
  assert dots() == 2 * 4  # T = 21 in blocks of at most 6 rows: 4 blocks
  mesh = jax.make_mesh((2, 4), ("sequence", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = tuple((name, "sequence" if name == axes.LENGTH else None) for name in axes.LOGICAL_NAMES)
  with parallel.activate(mesh, rules):
    assert dots() == 2
    got = jax.jit(IMPLS["xla_query_blocks"])(*inputs, jnp.int32(0))
  np.testing.assert_allclose(np.asarray(got), expected["causal"], atol=2e-5)
