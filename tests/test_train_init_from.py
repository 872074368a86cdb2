"""`train.init_from`: parameters from another meshlm run or from a Hugging Face directory, onto this run's mesh."""
import jax
import numpy as np
import pytest

from model import hf
from parallel import mesh as mesh_lib
from train.core import checkpoint as ckpt_lib
import configs
from train.core import loop
from train.core import setup
from train.core import step as step_lib

SMALL = {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2,
         "model.head_dim": 16, "model.mlp_dim": 128, "model.vocab_size": 512, "model.max_seq_len": 64,
         "train.seq_len": 64, "train.batch_size": 8, "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}


@pytest.fixture(scope="module")
def trainer():
  config = configs.load("tiny", **SMALL)
  return step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))


def _random_params(trainer):
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), trainer.abstract_state()["params"])


def _assert_equal_trees(got, want, shardings):
  flat_got, flat_want = jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (path, g), (_, w), s in zip(flat_got, flat_want, jax.tree.leaves(shardings)):
    assert g.sharding == s, path
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=str(path))


def test_init_from_a_meshlm_run_directory(trainer, tmp_path):
  params = _random_params(trainer)
  # Saved unsharded (as another run on another mesh might have), restored onto this run's shardings.
  ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), None)
  ck.save(7, {"params": params, "step": np.int32(7)}, None, {})
  ck.close()
  _assert_equal_trees(setup.init_from(trainer, str(tmp_path)), params, trainer.param_shardings)
  _assert_equal_trees(setup.init_from(trainer, str(tmp_path / "checkpoints" / "7")), params,
                      trainer.param_shardings)


def test_init_from_a_hugging_face_directory(trainer, tmp_path):
  params = _random_params(trainer)
  hf.save(trainer.model({"params": params}), str(tmp_path / "hf"))
  _assert_equal_trees(setup.init_from(trainer, str(tmp_path / "hf")), params, trainer.param_shardings)

  wider = step_lib.Trainer(configs.load("tiny", **dict(SMALL, **{"model.d_model": 128})), trainer.mesh)
  with pytest.raises(loop.TrainingError, match=r"differing fields .*model\.d_model \(hidden_size\): 128 vs 64"):
    setup.init_from(wider, str(tmp_path / "hf"))
  with pytest.raises(loop.TrainingError, match="not a directory"):
    setup.init_from(trainer, str(tmp_path / "missing"))
