"""MoE training steps with expert parallelism on 8 CPU devices equal one device's (losses, balance statistics,
parameters) over 3 steps with gradient accumulation, dropless and with a capacity limit."""
import jax
import numpy as np
import pytest

import configs
from parallel import mesh as mesh_lib
from train.core import step as step_lib

pytestmark = pytest.mark.slow  # five trainers compiled on the 8-device mesh

STEPS = 3
# (data, fsdp, tensor, expert)
MESHES = [(2, 1, 1, 4), (1, 2, 2, 2), (1, 1, 1, 8)]


def _config(shape, capacity_factor):
  c = configs.load("tiny_moe")
  c.model.update(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32,
                 expert_mlp_dim=16, num_experts=8, experts_per_token=2, max_seq_len=16,
                 capacity_factor=capacity_factor)
  c.train.update(batch_size=16, seq_len=16, grad_accum=2, lr=1e-2, warmup_steps=1, moe_aux_loss=0.1,
                 router_z_loss=0.01)
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], expert=shape[3])
  return c


def _run(shape, capacity_factor=0.0):
  c = _config(shape, capacity_factor)
  devices = jax.devices()[:1] if shape == (1, 1, 1, 1) else None
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)
  state = trainer.init()
  metrics = []
  for i in range(STEPS):
    state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(c, i)))
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
  return trainer, metrics, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference():
  return {cf: _run((1, 1, 1, 1), cf) for cf in (0.0, 1.0)}


def _compare(got, want):
  for a, b in zip(got[1], want[1]):
    for k in ("loss", "moe_aux_loss", "router_z_loss", "moe_load_max_mean", "moe_dropped_frac", "grad_norm",
              *(f"moe_load/{e}" for e in range(8))):
      np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0, err_msg=k)
  # Parameters after 3 AdamW steps: Adam divides each gradient by its own RMS, so a near-zero gradient entry that
  # differs in the last float bits moves its update visibly; the losses above are the <= 1e-5 criterion.
  for x, y in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(x, y, atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "data{}_fsdp{}_tensor{}_expert{}".format(*s))
def test_dropless_expert_parallel_equals_one_device(reference, shape):
  got = _run(shape)
  spec = got[0].param_shardings["layers"]["moe"]["gate"].spec
  assert spec[1] == "expert"  # [layers, experts, embed, mlp]: the experts are split over the expert axis
  _compare(got, reference[0.0])
  assert reference[0.0][1][0]["moe_dropped_frac"] == 0.0


def test_capacity_is_mesh_independent(reference):
  """Capacity is counted per sequence from the whole sequence's routing, so drops do not depend on the layout."""
  got = _run(MESHES[0], capacity_factor=1.0)
  assert all(m["moe_dropped_frac"] > 0 for m in reference[1.0][1])
  _compare(got, reference[1.0])
