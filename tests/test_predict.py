"""The performance model (train/planning/predict.py) against closed forms: a matmul's roofline, ring collectives, and
the cost of recomputation; programs compiled for TPU v4 by libtpu on this CPU machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import configs
from train.planning import compile as aot
from train.planning import hardware
from train.planning import hlo
from train.planning import predict

V4_16 = hardware.tpu_slice("v4-16")  # 8 chips, torus 2x2x2
V4 = hardware.CHIPS["tpu_v4"]
SMALL = {"model.num_layers": 3, "train.seq_len": 64, "model.max_seq_len": 64, "train.batch_size": 16,
         "model.vocab_size": 512, "model.d_model": 128, "model.mlp_dim": 256, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.head_dim": 64, "mesh.data": 1, "mesh.fsdp": 8, "model.dtype": "bfloat16"}


@pytest.fixture(scope="module")
def devices():
  return aot.abstract_devices(V4_16)


def test_single_large_matmul_costs_flops_over_peak(devices):
  m, k, n = 4096, 8192, 2048
  mesh = Mesh(np.array(devices), ("x",))
  rep = NamedSharding(mesh, P())
  compiled = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=rep),
                                              jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=rep)).compile()
  flops = 2 * m * k * n  # every chip computes the whole (replicated) product
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=flops,
                      tokens_per_chip=1, efficiency=1.0)
  assert p["hardware_flops_per_chip"] == pytest.approx(flops, rel=1e-6)
  assert p["step_seconds"] == pytest.approx(flops / 275e12, rel=1e-3)
  assert p["compute_seconds"] == pytest.approx(p["step_seconds"]) and p["memory_bound_seconds"] == 0
  assert p["mfu"] == pytest.approx(1.0, rel=1e-3) and p["collective_seconds"] == 0
  # The efficiency factor scales FLOP-bound time only.
  half = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=flops,
                         tokens_per_chip=1, efficiency=0.5)
  assert half["step_seconds"] == pytest.approx(2 * flops / 275e12, rel=1e-3)


def test_memory_bound_kernel_costs_bytes_over_bandwidth(devices):
  mesh = Mesh(np.array(devices), ("x",))
  rep = NamedSharding(mesh, P())
  shape = (4096, 4096)
  compiled = jax.jit(lambda a: a * 2.0).lower(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)).compile()
  nbytes = 2 * 4 * shape[0] * shape[1]  # read and write one float32 array
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=0,
                      tokens_per_chip=1)
  assert p["memory_bound_seconds"] == pytest.approx(nbytes / 1200e9, rel=1e-3)
  assert p["compute_seconds"] == 0


def test_ring_collective_time_follows_bytes_and_group_size(devices):
  # A v4 link moves 50 GB/s each way; a bidirectional ring over each torus axis the group spans.
  link = 50e9
  for group, axes in ((2, 1), (4, 2), (8, 3)):
    bw = predict.ring_bandwidth(group, V4, V4_16.torus)
    assert bw == 2 * axes * link
    for nbytes in (1e6, 1e9):
      ag = predict.collective_seconds("all-gather", nbytes, group, bw)
      assert ag == pytest.approx((group - 1) / group * nbytes / (2 * axes * link))
      assert predict.collective_seconds("all-reduce", nbytes, group, bw) == pytest.approx(2 * ag)
      # a reduce-scatter's result is the 1/group shard of the same array
      assert predict.collective_seconds("reduce-scatter", nbytes / group, group, bw) == pytest.approx(ag)
  assert predict.collective_seconds("all-gather", 1e9, 1, 1e9) == 0
  # GPUs: NVLink inside the 8-GPU node, InfiniBand beyond it.
  h100 = hardware.CHIPS["h100"]
  assert predict.ring_bandwidth(8, h100) == 450e9 and predict.ring_bandwidth(16, h100) == 50e9


def test_compiled_all_gather_is_timed_by_the_ring_formula(devices):
  # Gathering a float32 [8, 1024, 1024] array sharded over the 8 chips of a 2x2x2 torus.
  mesh = Mesh(np.array(devices), ("x",))
  x = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  compiled = jax.jit(lambda a: a * 2.0, out_shardings=NamedSharding(mesh, P())).lower(x).compile()
  (op,) = hlo.collective_ops(compiled.as_text(), 8)
  full = 8 * 1024 * 1024 * 4
  assert (op["kind"], op["group"], op["bytes"], op["per_step"]) == ("all-gather", 8, full, 1)
  p = predict.predict(compiled.as_text(), V4, num_devices=8, torus=V4_16.torus, model_flops_per_chip=0,
                      tokens_per_chip=1)
  assert p["collective_seconds"] == pytest.approx(7 / 8 * full / (3 * 2 * 50e9))
  assert p["exposed_collective_seconds"] == pytest.approx(p["collective_seconds"])  # synchronous: not hidden


@pytest.fixture(scope="module")
def remat_reports(devices):
  out = {}
  for remat in ("none", "full"):
    config = configs.load("tiny", **SMALL, **{"train.remat": remat})
    out[remat] = aot.compile_step(config, V4_16, devices)
  return out


def test_predicted_time_grows_with_recomputation(remat_reports):
  none, full = remat_reports["none"]["predicted"], remat_reports["full"]["predicted"]
  assert full["step_seconds"] > none["step_seconds"]
  # Full remat runs each layer's forward again: its matmuls add about a third of the layers' training FLOPs.
  assert full["hardware_flops_per_chip"] > 1.1 * none["hardware_flops_per_chip"]
  model_flops = remat_reports["none"]["flops"]["model_per_chip"]
  assert none["hardware_flops_per_chip"] >= 0.9 * model_flops
  for p, r in ((none, remat_reports["none"]), (full, remat_reports["full"])):
    tokens = r["batch_size"] * r["seq_len"] / r["num_devices"]
    assert p["tokens_per_sec_per_chip"] == pytest.approx(tokens / p["step_seconds"])
    assert p["mfu"] == pytest.approx(model_flops / (p["step_seconds"] * 275e12))
    assert p["uncosted_kernels"] == 0 and len(p["top_ops"]) == 10
