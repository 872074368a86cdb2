"""The MoE layer against independent references: a per-expert loop over all tokens (values and gradients, dropless
and with capacity), capacity masks derived by hand, routing written out in NumPy, the balance loss at uniform
routing, Mixtral's published parameter counts, and the grouped layer scan against the unrolled layers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model
from model import experts as experts_lib
from model import moe

T, D, F, E, K = 40, 16, 24, 6, 2


def _loop_reference(x_TD, experts_TK, weights_TK, keep_TK, gate_EDF, up_EDF, down_EFD, first=0):
  """Every expert (ids first .. first + E - 1: one device's share under expert parallelism) on every token, then
  each token's output is the weighted sum of its kept choices."""
  out_TD = jnp.zeros_like(x_TD)
  for e in range(gate_EDF.shape[0]):
    y_TD = (jax.nn.silu(x_TD @ gate_EDF[e]) * (x_TD @ up_EDF[e])) @ down_EFD[e]
    coef_T = jnp.sum(weights_TK * (experts_TK == first + e) * keep_TK, axis=1)
    out_TD = out_TD + coef_T[:, None] * y_TD
  return out_TD


@pytest.fixture(scope="module")
def case():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  experts = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, size=(T, K)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in ((E, D, F), (E, D, F), (E, F, D))]
  cot = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  keep_all = jnp.ones((T, K), bool)
  keep_some = jnp.asarray(rng.uniform(size=(T, K)) < 0.6)
  return x, experts, weights, w, cot, keep_all, keep_some


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
@pytest.mark.parametrize("dropless", [True, False])
def test_grouped_matmul_equals_per_expert_loop(case, impl, dropless):
  x, experts, weights, (gate, up, down), cot, keep_all, keep_some = case
  keep = keep_all if dropless else keep_some

  def sparse(x, weights, gate, up, down):
    return jnp.sum(experts_lib.expert_ffn(x, experts, weights, keep, gate, up, down, 0, jax.nn.silu, impl) * cot)

  def loop(x, weights, gate, up, down):
    return jnp.sum(_loop_reference(x, experts, weights, keep, gate, up, down) * cot)

  args = (x, weights, gate, up, down)
  got = experts_lib.expert_ffn(x, experts, weights, keep, gate, up, down, 0, jax.nn.silu, impl)
  np.testing.assert_allclose(got, _loop_reference(x, experts, weights, keep, gate, up, down), atol=1e-5, rtol=0)
  for g_sparse, g_loop in zip(jax.grad(sparse, argnums=range(5))(*args), jax.grad(loop, argnums=range(5))(*args)):
    np.testing.assert_allclose(g_sparse, g_loop, atol=1e-5, rtol=0)


def test_local_experts_sum_to_all_experts(case):
  """Expert parallelism's arithmetic: devices holding experts [0, 3) and [3, 6) add up to all six."""
  x, experts, weights, (gate, up, down), _, keep_all, _ = case
  full = experts_lib.expert_ffn(x, experts, weights, keep_all, gate, up, down, 0, jax.nn.silu)
  parts = [experts_lib.expert_ffn(x, experts, weights, keep_all, gate[s:s + 3], up[s:s + 3], down[s:s + 3], s, jax.nn.silu)
           for s in (0, 3)]
  np.testing.assert_allclose(parts[0] + parts[1], full, atol=1e-5, rtol=0)


def test_capacity_drop_mask_by_hand():
  # One sequence of 4 tokens, 2 experts, top-2; capacity ceil(0.5 * 2 * 4 / 2) = 2 places per expert.
  # First choices in token order: t0->e0 (e0 1), t1->e0 (e0 2), t2->e1 (e1 1), t3->e0 (e0 full: dropped).
  # Second choices: t0->e1 (e1 2), t1->e1 (full: dropped), t2->e0 (dropped), t3->e1 (dropped).
  experts = jnp.asarray([[[0, 1], [0, 1], [1, 0], [0, 1]]], jnp.int32)
  cap = moe.capacity(0.5, 2, 4, 2)
  assert cap == 2
  keep = moe.keep_mask(experts, jnp.ones((1, 4), bool), 2, cap)
  np.testing.assert_array_equal(keep[0], [[1, 1], [1, 0], [1, 0], [0, 0]])
  # Token 1 is padding: it takes no place, so t3's first choice fits (e0: t0, t3) and t2's second choice is
  # third in e0's queue (t0, t3 first choices come first): dropped; t0 and t3 second choices take e1 with t2.
  keep = moe.keep_mask(experts, jnp.asarray([[1, 0, 1, 1]], bool), 2, cap)
  np.testing.assert_array_equal(keep[0], [[1, 1], [0, 0], [1, 0], [1, 0]])
  # Two sequences have their own capacity: the second row's choices do not queue behind the first row's.
  keep = moe.keep_mask(jnp.concatenate([experts, experts]), jnp.ones((2, 4), bool), 2, cap)
  np.testing.assert_array_equal(keep[1], keep[0])


def test_routing_variants_match_numpy():
  logits = np.random.default_rng(2).normal(size=(2, 5, E)).astype(np.float32)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-logits, -1)[..., :K]
  chosen = np.take_along_axis(probs, top, -1)
  w, idx = moe.route(jnp.asarray(logits), K, "topk_softmax")
  np.testing.assert_array_equal(idx, top)
  np.testing.assert_allclose(w, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)  # Mixtral renormalises
  w, idx = moe.route(jnp.asarray(logits), K, "softmax_topk")
  np.testing.assert_array_equal(idx, top)
  np.testing.assert_allclose(w, chosen, rtol=1e-6)


def test_balance_loss_is_k_at_uniform_routing():
  logits = jnp.zeros((2, 8, E))  # every expert equally probable
  _, experts = moe.route(logits, K, "topk_softmax")
  valid = jnp.ones((2, 8), bool)
  stats = moe.router_stats(logits, experts, moe.keep_mask(experts, valid, E, 0), valid)
  np.testing.assert_allclose(stats["moe_aux_loss"], K, rtol=1e-6)
  np.testing.assert_allclose(stats["router_z_loss"], np.log(E) ** 2, rtol=1e-6)
  # Ties all choose experts 0 and 1: E/K times the mean load, nothing dropped without a capacity.
  np.testing.assert_allclose(stats["moe_load_max_mean"], E / K, rtol=1e-6)
  np.testing.assert_allclose(stats["moe_expert_load"], [0.5, 0.5] + [0.0] * (E - 2), atol=1e-7)
  assert float(stats["moe_dropped_frac"]) == 0.0


def test_mixtral_parameter_counts():
  counts = model.count_params(configs.load("mixtral_8x7b").model)
  assert (counts["total"], counts["active"]) == (46_702_792_704, 12_879_925_248)
  # FLOPs count active parameters: 6 * (active - embedding table) + attention, output projection included.
  c = configs.load("mixtral_8x7b").model
  want = 6 * (12_879_925_248 - 32000 * 4096) + 12 * 32 * 128 * 32 * 1024 / 2
  np.testing.assert_allclose(model.flops_per_token(c, 1024), want, rtol=1e-12)


def _moe_config(**overrides):
  c = configs.load("tiny_moe").model
  c.update(vocab_size=64, d_model=32, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=48,
           expert_mlp_dim=24, num_experts=4, moe_every=2, num_shared_experts=1, capacity_factor=1.0)
  c.update(**overrides)
  return c


def test_grouped_scan_equals_unrolled_layers():
  """moe_every=2: the scan over (dense, MoE) groups gives the unrolled model's logits and statistics."""
  scanned = model.Transformer(_moe_config(), rngs=nnx.Rngs(0))
  unrolled = model.Transformer(_moe_config(scan_layers=False), rngs=nnx.Rngs(1))
  for i, block in enumerate(unrolled.layers):  # copy layer i of the stacked groups into block i
    group_block = scanned.layers.blocks[i % 2]
    for path, var in nnx.to_flat_state(nnx.state(block, nnx.Param)):
      src = group_block
      for part in path:
        src = getattr(src, part) if isinstance(part, str) else src[part]
      var.set_value(src[...][i // 2])
  for name in ("embed", "final_norm"):
    nnx.update(getattr(unrolled, name), nnx.state(getattr(scanned, name)))
  unrolled.unembed.set_value(scanned.unembed[...])
  assert isinstance(scanned.layers.blocks[0].mlp, nnx.Module) and hasattr(scanned.layers.blocks[1], "moe")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 16)), jnp.int32)
  forward = nnx.jit(lambda m, t: m(t, return_aux=True))  # one compile each instead of op-by-op dispatch
  want, want_aux = forward(unrolled, tokens)
  got, got_aux = forward(scanned, tokens)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for k in moe.STATS:
    np.testing.assert_allclose(got_aux[k], want_aux[k], atol=1e-6, rtol=0)
  assert got_aux["moe_expert_load"].shape == (4,) and abs(float(got_aux["moe_expert_load"].sum()) - 1) < 1e-6
  assert 0 < float(got_aux["moe_dropped_frac"]) < 1  # capacity 1.0 with random routing drops some


def test_moe_config_errors():
  with pytest.raises(ValueError, match="moe_every"):
    model.Transformer(_moe_config(moe_every=3), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="experts_per_token"):
    model.Transformer(_moe_config(experts_per_token=5), rngs=nnx.Rngs(0))


def test_generation_through_layer_groups_equals_full_forward():
  """The KV cache scanned as [groups, moe_every, ...]: greedy decoding equals the argmax of full forward passes."""
  from model import generate
  m = model.Transformer(_moe_config(capacity_factor=0.0, init_std=0.3), rngs=nnx.Rngs(2))
  prompt = [5, 9, 2, 33, 17]
  got = generate.generate(m, [prompt], max_new_tokens=4)[0]
  tokens = list(prompt)
  forward = nnx.jit(lambda m, t: m(t))
  for _ in range(4):  # right padding to one length: one compile, same causal logits at the last real position
    row = jnp.asarray([tokens + [0] * (len(prompt) + 4 - len(tokens))], jnp.int32)
    tokens.append(int(jnp.argmax(forward(m, row)[0, len(tokens) - 1])))
  assert got == tokens[len(prompt):]
