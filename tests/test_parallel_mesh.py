"""Mesh construction, logical-axis rules, divisibility checks, multi-host start-up plan and batch assembly."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import model
import parallel
from parallel import distributed
from parallel import mesh as mesh_lib
from parallel import rules as rules_lib
import configs
from train.core import step as step_lib


def _config(data=-1, fsdp=1, tensor=1, sequence=1, **model_overrides):
  c = configs.load("tiny")
  c.model.update(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=32)
  c.model.update(**model_overrides)
  c.train.update(batch_size=8, seq_len=32)
  c.mesh.update(data=data, fsdp=fsdp, tensor=tensor, sequence=sequence)
  return c


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 2, 4),
                                   (-1, 2, 2, 1), (2, -1, 1, 1)])
def test_mesh_shape_and_devices(shape):
  mesh = mesh_lib.make_mesh(_config(*shape).mesh)
  expected = [n if n != -1 else 8 // -np.prod(shape) for n in shape]
  assert mesh.axis_names == ("data", "fsdp", "tensor", "sequence", "expert", "stage")
  assert [mesh.shape[a] for a in ("data", "fsdp", "tensor", "sequence")] == expected
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))  # every device exactly once


def test_tensor_is_the_innermost_axis():
  # Neighbouring device ids form the tensor groups: the fastest links carry the most traffic.
  mesh = mesh_lib.make_mesh(_config(1, 1, 2, 4).mesh)
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 4)
  assert (ids[1] - ids[0] == 1).all()


@pytest.mark.parametrize("shape,axis,numbers", [
    ((3, 1, 1, 1), "data", ("3", "8")),
    ((2, 2, 2, 2), "data", ("16", "8")),
    ((-1, 3, 1, 1), "data=-1", ("8", "3")),
])
def test_impossible_mesh_names_axis_and_numbers(shape, axis, numbers):
  with pytest.raises(mesh_lib.MeshError) as e:
    mesh_lib.make_mesh(_config(*shape).mesh)
  assert axis in str(e.value) and all(n in str(e.value) for n in numbers), str(e.value)


def test_stage_axis_sits_between_data_and_tensor():
  # Stages stay inside a data shard (a process feeds its rows to every stage); tensor takes the nearest devices.
  c = _config(2, 1, 2, 1)
  c.mesh.stage = 2
  mesh = mesh_lib.make_mesh(c.mesh)
  assert mesh.shape["stage"] == 2 and mesh.shape["data"] == 2 and mesh.shape["tensor"] == 2
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  data_of = {int(i): s for s in range(2) for i in np.take(ids, s, axis=mesh_lib.AXES.index("data")).ravel()}
  assert sorted(i for i, s in data_of.items() if s == 0) == [0, 1, 2, 3]
  stage_of = {int(i): s for s in range(2) for i in np.take(ids, s, axis=mesh_lib.AXES.index("stage")).ravel()}
  assert sorted(i for i, s in stage_of.items() if s == 0) == [0, 1, 4, 5]


def test_multi_slice_puts_data_across_slices_and_tensor_inside(monkeypatch):
  from jax.experimental import topologies
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu's lock file
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", num_slices=2).devices
  mesh = mesh_lib.make_mesh(_config(1, 2, 2, 1).mesh, devices)  # dcn_data=-1 -> 2 slices on data
  assert (mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (2, 2, 2)
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  for i in range(2):
    assert (slices[i] == slices[i].flat[0]).all()  # one data index = one slice: fsdp/tensor stay inside
  assert slices[0].flat[0] != slices[1].flat[0]


def test_default_rules_table():
  c = _config(2, 2, 2, 1)
  mesh = mesh_lib.make_mesh(c.mesh)
  rules = rules_lib.logical_rules(c.mesh)
  assert set(dict(rules)) >= set(model.axes.LOGICAL_NAMES)
  # Activations: batch over data+fsdp+expert, embed left whole (fsdp is taken by batch), length over sequence.
  batch = ("data", "fsdp", "expert")
  assert model.axes.spec(("batch", "length", "embed"), rules) == P(batch, "sequence", None)
  assert model.axes.spec(("batch", "length", "vocab"), rules) == P(batch, "sequence", "tensor")
  assert model.axes.spec(("batch", "kv_length", "kv_heads", "head_dim"), rules) == P(batch, None, "tensor", None)
  # MoE expert weights: experts over expert, then like a dense MLP kernel.
  assert model.axes.spec(("experts", "embed", "mlp"), rules) == P("expert", "fsdp", "tensor")
  # Parameters: embed over fsdp (ZeRO-3), heads / mlp / vocab over tensor.
  assert model.axes.spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
  assert model.axes.spec(("vocab", "embed"), rules) == P("tensor", "fsdp")
  assert rules_lib.fit_rules(rules, c.model, mesh) == rules


def test_rule_overrides_from_config():
  c = _config()
  c.mesh.rules = (("embed", None), ("mlp", ("tensor", "fsdp")))
  table = dict(rules_lib.logical_rules(c.mesh))
  assert table["embed"] is None and table["mlp"] == ("tensor", "fsdp") and table["heads"] == "tensor"
  c.mesh.rules = (("embedding", "fsdp"),)
  with pytest.raises(ValueError, match="unknown logical axis 'embedding'"):
    rules_lib.logical_rules(c.mesh)
  c.mesh.rules = (("embed", "fdsp"),)
  with pytest.raises(ValueError, match="unknown mesh axis 'fdsp'"):
    rules_lib.logical_rules(c.mesh)


def test_tensor_must_divide_heads_before_compiling(monkeypatch):
  c = _config(1, 1, 8, 1)  # 4 heads on 8 tensor shards
  monkeypatch.setattr(jax, "jit", lambda *a, **k: pytest.fail("compiled before validating"))
  with pytest.raises(ValueError, match="tensor.*num_heads=4"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))


def test_kv_heads_fewer_than_tensor_are_replicated():
  c = _config(2, 1, 4, 1, num_heads=8, num_kv_heads=1)  # MQA on 4 tensor shards
  rules = rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh_lib.make_mesh(c.mesh))
  assert dict(rules)["kv_heads"] is None and dict(rules)["heads"] == "tensor"
  c = _config(2, 1, 4, 1, num_heads=12, num_kv_heads=3)  # neither divides the other
  with pytest.raises(ValueError, match="num_kv_heads=3"):
    rules_lib.fit_rules(rules_lib.logical_rules(c.mesh), c.model, mesh_lib.make_mesh(c.mesh))


def test_parameter_dimension_not_divisible_names_parameter():
  c = _config(1, 1, 4, 2, vocab_size=250)  # vocab over tensor=4
  with pytest.raises(ValueError, match=r"embedding.*250.*tensor"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))


def test_batch_and_sequence_divisibility():
  c = _config(8, 1, 1, 1)
  c.train.grad_accum = 2  # microbatch 4 rows on 8 data shards
  with pytest.raises(ValueError, match="data x fsdp"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))
  c = _config(1, 1, 1, 8)
  c.train.seq_len = 36
  with pytest.raises(ValueError, match="sequence=8"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))


def test_global_batch_single_process_matches_device_put():
  c = _config(2, 2, 1, 2)
  mesh = mesh_lib.make_mesh(c.mesh)
  sharding = parallel.sharding.logical_sharding(mesh, rules_lib.logical_rules(c.mesh), ("batch", "length"))
  local = {"inputs": np.arange(8 * 6, dtype=np.int32).reshape(8, 6)}
  out = parallel.sharding.global_batch(local, sharding)["inputs"]
  assert out.sharding == sharding and out.shape == (8, 6)
  np.testing.assert_array_equal(np.asarray(out), local["inputs"])
  for shard in out.addressable_shards:  # each device holds exactly its block
    np.testing.assert_array_equal(np.asarray(shard.data), local["inputs"][shard.index])


@pytest.fixture
def clean_env(monkeypatch):
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_NTASKS",
            "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES",
            "MEGASCALE_COORDINATOR_ADDRESS"):
    monkeypatch.delenv(k, raising=False)
  return monkeypatch


def test_distributed_plan(clean_env):
  d = configs.load("tiny").distributed
  assert distributed.plan(d) is None  # single process: nothing to start
  d.update(coordinator_address="localhost:1234", num_processes=2, process_id=1)
  assert distributed.plan(d) == {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1,
                                 "initialization_timeout": 300}
  d.update(coordinator_address="", num_processes=0, process_id=-1)
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:99")
  clean_env.setenv("JAX_NUM_PROCESSES", "4")
  clean_env.setenv("JAX_PROCESS_ID", "3")
  assert distributed.plan(d)["process_id"] == 3
  clean_env.delenv("JAX_PROCESS_ID")
  with pytest.raises(ValueError, match="process_id"):
    distributed.plan(d)
  clean_env.delenv("JAX_COORDINATOR_ADDRESS")
  clean_env.setenv("SLURM_JOB_ID", "7")
  clean_env.setenv("SLURM_NTASKS", "16")
  assert distributed.plan(d) == {"initialization_timeout": 300}  # jax detects the SLURM parameters itself
  d.mode = "off"
  assert distributed.plan(d) is None
