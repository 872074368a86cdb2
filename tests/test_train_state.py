"""The train state's RNG stream is not a parameter-init key; rows per process are checked against the layout."""
import types

import jax
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from parallel import mesh as mesh_lib
from parallel import sharding
from train.core import step as step_lib

SMALL = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2, "model.num_kv_heads": 1,
         "model.head_dim": 16, "model.mlp_dim": 64, "model.vocab_size": 128, "model.max_seq_len": 16,
         "train.seq_len": 16, "train.batch_size": 8, "model.scan_layers": False}


def _key_data(k):
  return tuple(np.asarray(jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k)
               .ravel().tolist())


def test_training_rng_is_none_of_the_parameter_init_keys():
  config = configs.load("tiny", **SMALL)
  trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh))
  seed = 3
  state = trainer.init(seed)
  params_key, _ = trainer.init_keys(jax.random.PRNGKey(seed))
  # The parameters really come from params_key: an eager model built from it has the same values.
  ref = nnx.to_pure_dict(nnx.state(model_lib.Transformer(config.model, rngs=nnx.Rngs(params=params_key)),
                                   nnx.Param))
  for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-7)
  # Every key the model's init drew from that stream (one per parameter, and more), and the stream's own key.
  stream = nnx.Rngs(params=params_key)
  drawn = {_key_data(stream.params()) for _ in range(4 * len(jax.tree.leaves(ref)))} | {_key_data(params_key)}
  assert _key_data(state["rng"]) not in drawn
  # Per-step keys fold the step into the training key: none of them is an init key either.
  assert not {_key_data(jax.random.fold_in(state["rng"], s)) for s in range(100)} & drawn


def _fake_mesh(process_of_device, shape):
  names = mesh_lib.AXES
  devices = np.vectorize(lambda p: types.SimpleNamespace(process_index=int(p)), otypes=[object])(
      np.asarray(process_of_device).reshape(shape))
  return types.SimpleNamespace(devices=devices, axis_names=names)


def test_rows_per_process_are_checked_against_the_layout():
  # 2 processes x 4 devices. data=2 across processes, tensor=4 inside: each process owns one row block.
  ok = _fake_mesh([0, 0, 0, 0, 1, 1, 1, 1], (2, 1, 4, 1, 1, 1))
  sharding.check_rows_per_process(ok, ("data", "fsdp"))
  # tensor=8 over both processes (data=1): both processes would hold all rows.
  bad = _fake_mesh([0, 0, 0, 0, 1, 1, 1, 1], (1, 1, 8, 1, 1, 1))
  with pytest.raises(ValueError, match=r"mesh axis tensor=8 spans processes.*data x fsdp"):
    sharding.check_rows_per_process(bad, ("data", "fsdp"))
  # fsdp=2 x sequence=4 with the sequence axis across the processes.
  bad = _fake_mesh([0, 1, 0, 1, 0, 1, 0, 1], (1, 2, 1, 4, 1, 1))
  with pytest.raises(ValueError, match=r"mesh axis sequence=4 spans processes"):
    sharding.check_rows_per_process(bad, ("data", "fsdp"))


def test_trainer_checks_rows_per_process_before_compiling(monkeypatch):
  config = configs.load("tiny", **SMALL, **{"mesh.data": 2, "mesh.tensor": 2, "mesh.fsdp": 2})
  mesh = mesh_lib.make_mesh(config.mesh)
  # Pretend devices are split between two processes along the tensor axis (as a TPU pod with tensor across
  # hosts would be): the Trainer must refuse before building anything.
  fake = {d.id: i % 2 for i, d in enumerate(mesh.devices.ravel())}
  fake_devices = np.vectorize(lambda d: types.SimpleNamespace(process_index=fake[d.id]), otypes=[object])(
      mesh.devices)
  monkeypatch.setattr(step_lib.Trainer, "mesh", property(lambda self: types.SimpleNamespace(
      devices=fake_devices, axis_names=mesh.axis_names, shape=mesh.shape), lambda self, v: None), raising=False)
  with pytest.raises(ValueError, match="mesh axis tensor=2 spans processes"):
    step_lib.Trainer(config, mesh)
