"""Expert parallelism's all-to-all exchange on 8 CPU devices: the routed experts' output and its gradients (tokens,
routing weights, expert weights) equal one device's `expert_ffn` on meshes data 2 x expert 4, expert 8 and
data 2 x tensor 2 x expert 2, with skewed routing (one device receives far more than its share), with the dense
all_to_all (what CPUs run) and with the ragged_all_to_all exchange (what TPUs run), the latter through an emulation
of ragged_all_to_all's documented semantics built from all_to_all (XLA:CPU does not run the primitive)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
import parallel
from model import experts as experts_lib
from model import moe
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib

T, D, F, E, K = 64, 16, 8, 8, 2  # tokens, width, expert width, experts, top-k
MESHES = {"data2_expert4": dict(data=2, expert=4), "expert8": dict(expert=8),
          "data2_tensor2_expert2": dict(data=2, tensor=2, expert=2)}


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
  """ragged_all_to_all as documented: operand[input_offsets[g]:+send_sizes[g]] goes to device g and is written
  there at output_offsets[g]; the rest of `output` is kept. Built from all_to_all over [G, N] padded blocks."""
  G, N = input_offsets.shape[0], operand.shape[0]
  rows_GN = input_offsets[:, None] + jnp.arange(N)[None]
  sent_GN = jnp.arange(N)[None] < send_sizes[:, None]
  blocks = jnp.take(operand, jnp.where(sent_GN, rows_GN, N), axis=0, mode="fill", fill_value=0)
  got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [G senders, N, ...]
  at_S = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each sender writes here
  dest_GN = jnp.where(jnp.arange(N)[None] < recv_sizes[:, None], at_S[:, None] + jnp.arange(N)[None],
                      output.shape[0])
  return output.at[dest_GN.reshape(-1)].set(got.reshape(G * N, *got.shape[2:]), mode="drop")


def _inputs():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, T // 8, D)).astype(np.float32)
  logits = rng.normal(size=(8, T // 8, E)).astype(np.float32)
  logits[..., 0] += 2.5  # most tokens pick expert 0: its device receives several times its share
  weights, experts = moe.route(jnp.asarray(logits), K, "topk_softmax")
  keep = jnp.asarray(rng.random(size=experts.shape) > 0.1)  # some assignments dropped (a capacity limit)
  w = [rng.normal(size=s).astype(np.float32) * 0.3 for s in ((E, D, F), (E, D, F), (E, F, D))]
  return jnp.asarray(x), experts, weights, keep, [jnp.asarray(a) for a in w]


def _loss(x, weights, gate, up, down, experts, keep, cot):
  y = experts_lib.dispatch(x, experts, weights, keep, gate, up, down, jax.nn.silu, "tiled")
  return jnp.sum(y * cot)


def _value_and_grads(mesh_shape=None):
  x, experts, weights, keep, w = _inputs()
  cot = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
  fn = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1, 2, 3, 4)))
  if mesh_shape is None:
    return jax.device_get(fn(x, weights, *w, experts, keep, cot))
  c = configs.load("tiny_moe")
  c.mesh.update(**mesh_shape)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh)
  with parallel.activate(mesh, rules):
    return jax.device_get(fn(x, weights, *w, experts, keep, cot))


@pytest.fixture(scope="module")
def reference():
  return _value_and_grads()


@pytest.mark.parametrize("exchange", ["all_to_all", "ragged_all_to_all"])
@pytest.mark.parametrize("mesh", MESHES)
def test_exchange_equals_one_device(reference, mesh, exchange, monkeypatch):
  if exchange == "ragged_all_to_all":
    monkeypatch.setitem(experts_lib.RAGGED_EXCHANGE, "cpu", True)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  value, grads = _value_and_grads(MESHES[mesh])
  want_value, want_grads = reference
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for name, got, want in zip(("x", "routing weights", "gate", "up", "down"), grads, want_grads):
    assert np.max(np.abs(want)) > 0, name
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)), err_msg=name)


def test_skewed_routing_overloads_one_device():
  """The test's routing is what it claims: the device holding experts 0-1 of data2_expert4 receives more than twice
  the mean load (worst-case buffers matter)."""
  _, experts, _, keep, _ = _inputs()
  load = np.bincount(np.asarray(experts)[np.asarray(keep)] // 2, minlength=4)
  assert load[0] > 2 * load.mean()
