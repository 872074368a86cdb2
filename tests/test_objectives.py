"""The objective interface of the one Trainer: an objective with an extra trainable head and a frozen reference
model (the shape reward models and DPO take) trains both the model and the head, keeps the reference bit for
bit, and `with_model_params` fills every place the layout keeps model weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs
from parallel import mesh as mesh_lib
from train import objectives
from train.core import step as step_lib
from train.objectives import lm


class _HeadAndReference(lm.LanguageModel):
  """lm loss + (1/T) * sum_t m_t * (head . 1 - 1)^2 + the reference's loss as a metric (no gradient path)."""
  name = "test_head_ref"
  sum_keys = ("ce", "z", "tokens", "head", "ref_ce")
  metric_keys = ("loss", "z_loss", "total_loss", "tokens", "ref_loss")
  extra_params = {"head": ((64,), ("embed",))}
  frozen_models = ("reference",)

  def sums(self, model, batch, extras, frozen):
    sums = super().sums(model, batch, extras, frozen)
    ref = super().sums(frozen["reference"], batch, extras, frozen)
    head = jnp.square(jnp.sum(extras["head"]) - 1.0) * sums["tokens"]
    return dict(sums, head=head, ref_ce=ref["ce"])

  def loss(self, sums):
    return sums["ce"] + sums["z"] + sums["head"]

  def metrics(self, sums, normalizer):
    return dict(super().metrics(sums, normalizer), ref_loss=sums["ref_ce"] / normalizer)


@pytest.fixture(scope="module")
def trainer():
  objectives.OBJECTIVES[_HeadAndReference.name] = _HeadAndReference
  c = configs.load("tiny", **{"model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2,
                              "model.num_heads": 4, "model.num_kv_heads": 2, "model.head_dim": 16,
                              "model.mlp_dim": 128, "model.max_seq_len": 32, "train.seq_len": 32,
                              "train.batch_size": 8, "train.warmup_steps": 1, "train.lr": 1e-2,
                              "train.objective": _HeadAndReference.name, "mesh.data": 2, "mesh.fsdp": 2,
                              "mesh.tensor": 2})
  yield step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh), step_lib.FAST_COMPILE)
  del objectives.OBJECTIVES[_HeadAndReference.name]


def test_extra_params_train_and_the_frozen_reference_stays(trainer):
  state = trainer.init()
  assert set(state["params"]) == {"model", "head"} and set(state["frozen"]) == {"reference"}
  assert state["params"]["head"].sharding.spec == jax.sharding.PartitionSpec("fsdp")
  start = jax.device_get(state)
  losses = []
  for i in range(3):
    state, m = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, i)))
    losses.append((float(m["loss"]), float(m["ref_loss"])))
  after = jax.device_get(state)
  assert losses[0][0] == pytest.approx(losses[0][1], rel=1e-6)  # policy == reference at the start
  assert losses[-1][0] != losses[-1][1]
  for a, b in zip(jax.tree.leaves(after["frozen"]), jax.tree.leaves(start["frozen"])):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(after["params"]["head"], start["params"]["head"])
  assert not np.array_equal(after["params"]["model"]["unembed"], start["params"]["model"]["unembed"])
  moments = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
  assert set(moments[0].mu) == {"model", "head"}  # optimizer state for the trainable tree only


def test_with_model_params_sets_the_model_and_its_frozen_copies(trainer):
  state = trainer.init()
  ones = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), trainer.abstract_model_params())
  ones = jax.device_put(ones, trainer.param_shardings)
  state = trainer.with_model_params(state, ones)
  for tree in (state["params"]["model"], state["frozen"]["reference"]):
    assert all(bool(jnp.all(x == 1)) for x in jax.tree.leaves(tree))
