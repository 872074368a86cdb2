"""One remat policy table (model/remat.py) serves both the model's jax.checkpoint policies and the planner's
activation-memory model (train/planning/memory.py)."""
import configs
from model import remat
from train.planning import memory


def test_one_remat_table_drives_the_model_and_the_memory_model():
  for name, policy in remat.POLICIES.items():
    assert set(policy.keeps) <= set(remat.GROUPS), name
    assert "input" in policy.keeps, name  # the scan carry is always kept
  assert remat.POLICIES["none"].checkpoint is None
  # The memory model sizes exactly the groups the table speaks of.
  m = configs.load("tiny").model
  assert set(memory._layer_bytes(m, 128, 1)) == set(remat.GROUPS)
