"""DeepSeek-V3's auxiliary-loss-free balancing: the score-bias update rule on a hand-computed load, and one
training step of a sigmoid-routed model moving every MoE layer's bias by that rule from the step's expert loads
(measured by a separate forward pass of the same parameters and batch)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import configs
from model import moe
from parallel import mesh as mesh_lib
from train.core import step as step_lib


def test_update_equals_the_formula_on_a_hand_computed_load():
  # Two MoE layers of 4 experts; loads are shares of the assignments (mean 0.25).
  load = jnp.asarray([[0.40, 0.10, 0.25, 0.25], [0.05, 0.30, 0.30, 0.35]])
  params = {"layers": {"moe": {"score_bias": jnp.asarray([[0.0, 0.0, 0.0, 0.0], [0.1, -0.1, 0.0, 0.2]])},
                       "attn": {"q": jnp.ones((2, 3))}}}
  new = moe.update_score_bias(params, load, 0.001)
  # sign(0.25 - load): overloaded -> -1, underloaded -> +1, exactly balanced -> 0
  want = np.array([[-0.001, 0.001, 0.0, 0.0], [0.1 + 0.001, -0.1 - 0.001, 0.0 - 0.001, 0.2 - 0.001]])
  np.testing.assert_allclose(np.asarray(new["layers"]["moe"]["score_bias"]), want, rtol=0, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(new["layers"]["attn"]["q"]), np.ones((2, 3)))  # nothing else moves


def test_a_training_step_moves_each_layers_bias_by_its_load():
  config = configs.load("tiny", **{"model.num_experts": 4, "model.experts_per_token": 2, "model.expert_mlp_dim": 32,
                                   "model.router": "sigmoid", "model.first_dense_layers": 1,
                                   "train.router_bias_update_rate": 0.01, "train.batch_size": 4, "train.seq_len": 32,
                                   "mesh.data": 1})
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:1]))
  state = trainer.init()
  batch = trainer.batch_to_device(step_lib.synthetic_batch(config, 0))
  before = jax.tree.map(np.asarray, state["params"])
  model = trainer.model(state)
  _, aux = model(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True)
  load = np.asarray(aux[moe.LAYER_LOAD])
  assert load.shape == (config.model.num_layers - 1, 4)
  state, metrics = trainer.step_fn(state, batch)
  after = np.asarray(state["params"]["layers"]["moe"]["score_bias"])
  want = before["layers"]["moe"]["score_bias"] + 0.01 * np.sign(load.mean(-1, keepdims=True) - load)
  np.testing.assert_allclose(after, want, rtol=0, atol=1e-6)
  assert np.any(after != 0) and float(metrics["nonfinite"]) == 0
