"""A DeepSeek-style MoE (MLA with q LoRA, sigmoid routing limited to 2 of 4 groups, a shared expert, the first layer
dense, score-bias updates) trained on an 8-device mesh (expert 2 x tensor 2 x data 2) equals one device's losses,
statistics and biases over 3 steps with gradient accumulation."""
import jax
import numpy as np
import pytest

import configs
from parallel import mesh as mesh_lib
from train.core import step as step_lib

pytestmark = pytest.mark.slow  # two trainers, one on the 8-device mesh


def _run(shape):
  c = configs.load("tiny_moe")
  c.model.update(vocab_size=128, d_model=32, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=32,
                 expert_mlp_dim=16, num_experts=8, experts_per_token=2, max_seq_len=16, num_shared_experts=1,
                 router="sigmoid", router_groups=4, router_topk_groups=2, routed_scaling_factor=2.5,
                 first_dense_layers=1, attention_type="mla", q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                 qk_rope_head_dim=4, v_head_dim=8, rope_interleave=True)
  c.train.update(batch_size=16, seq_len=16, grad_accum=2, lr=1e-2, warmup_steps=1, moe_aux_loss=0.01,
                 router_z_loss=0.001, router_bias_update_rate=0.01)
  c.mesh.update(data=shape[0], tensor=shape[1], expert=shape[2])
  devices = jax.devices()[:1] if shape == (1, 1, 1) else None
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)
  state = trainer.init()
  metrics = []
  for i in range(3):
    state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(c, i)))
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
  return metrics, jax.device_get(state["params"])


def test_deepseek_style_moe_on_a_mesh_equals_one_device():
  want_metrics, want_params = _run((1, 1, 1))
  got_metrics, got_params = _run((2, 2, 2))
  for a, b in zip(got_metrics, want_metrics):
    for k in ("loss", "moe_aux_loss", "router_z_loss", "moe_load_max_mean", "grad_norm",
              *(f"moe_load/{e}" for e in range(8))):
      np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0, err_msg=k)
  bias = np.asarray(got_params["layers"]["moe"]["score_bias"])
  np.testing.assert_array_equal(bias, np.asarray(want_params["layers"]["moe"]["score_bias"]))
  assert np.any(bias != 0)  # the update ran
