"""The jitted training step: equal results on five meshes vs one device, sharding by the rules, gradient
accumulation, non-finite skipping, eval, and compiled memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from parallel import mesh as mesh_lib
import configs
from train.core import step as step_lib

STEPS = 3
MESHES = [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 2, 4)]
# Parameter -> logical names (model/layers.py) -> mesh axes under the default rules, written out by hand.
EXPECTED_SPECS = {
    "embed/embedding": P("tensor", "fsdp"),
    "final_norm/scale": P("fsdp"),
    "unembed": P("fsdp", "tensor"),
    "layers/attn/q": P(None, "fsdp", "tensor", None),
    "layers/attn/k": P(None, "fsdp", "tensor", None),
    "layers/attn/v": P(None, "fsdp", "tensor", None),
    "layers/attn/o": P(None, "tensor", None, "fsdp"),
    "layers/attn_norm/scale": P(None, "fsdp"),
    "layers/mlp_norm/scale": P(None, "fsdp"),
    "layers/mlp/gate": P(None, "fsdp", "tensor"),
    "layers/mlp/up": P(None, "fsdp", "tensor"),
    "layers/mlp/down": P(None, "tensor", "fsdp"),
}


def _config(shape=(1, 1, 1, 1), **train):
  c = configs.load("tiny")
  # Layer 0 attends in an 8-token window, layer 1 globally; synthetic batches pack 3 documents per row.
  c.model.update(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                 max_seq_len=32, sliding_window=8, global_every=2)
  c.train.update(batch_size=8, seq_len=32, steps=10, lr=1e-2, warmup_steps=1, z_loss=1e-3, clip_norm=0.5,
                 weight_decay=0.1)
  c.train.update(**train)
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2], sequence=shape[3])
  return c


_TRAINERS = {}


def _trainer(shape, **train):
  """One Trainer per (mesh, settings), shared by the tests of this module so each compiles once."""
  key = (shape, tuple(sorted(train.items())))
  if key not in _TRAINERS:
    c = _config(shape, **train)
    devices = jax.devices()[:1] if shape == (1, 1, 1, 1) else None
    _TRAINERS[key] = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE)
  return _TRAINERS[key]


def _flat(tree):
  return {"/".join(str(k.key) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _run(trainer, state=None, steps=STEPS):
  """Steps on synthetic batches 0..steps-1; returns (losses, metrics per step, final state)."""
  state = trainer.init() if state is None else state
  metrics = []
  for i in range(steps):
    batch = trainer.batch_to_device(step_lib.synthetic_batch(trainer.config, i))
    state, m = trainer.step_fn(state, batch)
    metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
  return [m["loss"] for m in metrics], metrics, state


@pytest.fixture(scope="module")
def reference():
  """One device, no accumulation: the independent reference."""
  trainer = _trainer((1, 1, 1, 1))
  init = jax.device_get(trainer.init())
  losses, metrics, state = _run(trainer)
  return {"trainer": trainer, "init": init, "losses": losses, "metrics": metrics,
          "params": jax.device_get(state["params"]), "state": state}


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_meshes_match_single_device(reference, shape):
  trainer = _trainer(shape)
  state = trainer.init()
  for name, leaf in _flat(state["params"]).items():  # created directly sharded, same values as on one device
    assert leaf.sharding.spec == EXPECTED_SPECS[name], name
    np.testing.assert_array_equal(np.asarray(leaf), _flat(reference["init"]["params"])[name], err_msg=name)
  losses, metrics, state = _run(trainer, state)
  np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
  for key in ("z_loss", "grad_norm", "param_norm", "lr", "tokens"):
    np.testing.assert_allclose([m[key] for m in metrics], [m[key] for m in reference["metrics"]], rtol=1e-5,
                               err_msg=key)
  mesh = trainer.mesh
  for name, leaf in _flat(state["params"]).items():
    spec = EXPECTED_SPECS[name]
    assert leaf.sharding.spec == spec, name
    per_device = tuple(n // int(np.prod([mesh.shape[a] for a in ([axes] if isinstance(axes, str) else axes or [])]))
                       for n, axes in zip(leaf.shape, tuple(spec) + (None,) * (leaf.ndim - len(spec))))
    assert leaf.addressable_shards[0].data.shape == per_device, name
    # Adam divides by sqrt(v): elements whose gradient is near eps amplify float noise (gradients agree to
    # ~1e-6 relative), so parameters are compared to 5% of one step's learning rate.
    np.testing.assert_allclose(np.asarray(leaf), _flat(reference["params"])[name], rtol=0, atol=5e-4,
                               err_msg=name)
  # Adam moments follow the parameters' sharding (ZeRO-1/2 savings come with FSDP).
  moments = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
  for moment in (moments[0].mu, moments[0].nu):
    for name, leaf in _flat(moment).items():
      assert leaf.sharding.spec == EXPECTED_SPECS[name], name
  assert int(state["step"]) == STEPS


def test_grad_accumulation_equals_large_batch(reference):
  trainer = _trainer((1, 2, 2, 2), grad_accum=4)  # 4 microbatches of 2 rows
  losses, metrics, state = _run(trainer)
  np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
  np.testing.assert_allclose([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in reference["metrics"]],
                             rtol=1e-5)
  for name, leaf in _flat(state["params"]).items():
    np.testing.assert_allclose(np.asarray(leaf), _flat(reference["params"])[name], rtol=0, atol=5e-4,
                               err_msg=name)


def _own_state(reference):
  """A private copy of the reference's final state: the step donates its input, and the fixture stays intact."""
  return jax.tree.map(jnp.copy, reference["state"])


def test_loss_and_eval_match_model_logits(reference):
  trainer, state = reference["trainer"], _own_state(reference)
  batch_np = step_lib.synthetic_batch(trainer.config, 100)
  logits = np.asarray(trainer.model(state)(jnp.asarray(batch_np["inputs"]), jnp.asarray(batch_np["segment_ids"]),
                                           jnp.asarray(batch_np["positions"])), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = logz - np.take_along_axis(logits, batch_np["targets"][..., None], -1)[..., 0]
  mask = batch_np["loss_mask"]
  expected = float((nll * mask).sum() / mask.sum())
  ev = jax.device_get(trainer.eval_fn(state, trainer.batch_to_device(batch_np)))
  assert float(ev["tokens"]) == mask.sum()
  assert float(ev["loss_sum"]) / float(ev["tokens"]) == pytest.approx(expected, rel=1e-5)
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch_np))  # the step reports the pre-update loss
  assert float(metrics["loss"]) == pytest.approx(expected, rel=1e-5)
  assert float(metrics["z_loss"]) == pytest.approx(1e-3 * float((logz ** 2 * mask).sum() / mask.sum()), rel=1e-4)


def test_nonfinite_step_is_skipped(reference):
  trainer, state = reference["trainer"], _own_state(reference)
  before = jax.device_get({"params": state["params"], "opt_state": state["opt_state"], "step": state["step"]})
  batch = step_lib.synthetic_batch(trainer.config, 200)
  batch["loss_mask"][0, 3] = np.nan
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
  assert float(metrics["nonfinite"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
  after = jax.device_get(state)
  assert int(after["step"]) == int(before["step"]) + 1
  for a, b in zip(jax.tree.leaves(after["params"]) + jax.tree.leaves(after["opt_state"]),
                  jax.tree.leaves(before["params"]) + jax.tree.leaves(before["opt_state"])):
    np.testing.assert_array_equal(a, b)
  batch["loss_mask"][0, 3] = 1.0  # the next finite step updates again
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(batch))
  assert float(metrics["nonfinite"]) == 0.0
  assert not np.array_equal(jax.device_get(state["params"]["unembed"]), after["params"]["unembed"])


def test_memory_analysis_counts_the_sharded_state(reference):
  trainer = _trainer((2, 2, 2, 1))
  mem = trainer.memory_analysis()  # lowers from abstract inputs only
  shard_bytes = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                    for x in jax.tree.leaves(trainer.abstract_state()) + jax.tree.leaves(trainer.abstract_batch()))
  assert mem["argument_bytes"] == pytest.approx(shard_bytes, rel=0.05)
  assert mem["alias_bytes"] > 0.9 * (mem["argument_bytes"] - 5 * 8 * 32 * 4 // 4)  # state is donated
  # The total bounds XLA's own peak from its buffer assignment (computed apart from these four figures), and is
  # no looser than the donated state counted twice plus the temporaries.
  peak = trainer.compiled().memory_analysis().peak_memory_in_bytes
  assert peak <= mem["total_bytes"] <= 2 * shard_bytes + mem["temp_bytes"]


def test_bf16_compute_keeps_float32_master_weights(reference):
  c = _config()
  c.model.dtype = "bfloat16"
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]), step_lib.FAST_COMPILE)
  state = jax.device_put(reference["init"], trainer.state_shardings)  # same float32 start as the reference
  state, metrics = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(c, 0)))
  assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
  assert float(metrics["loss"]) == pytest.approx(reference["losses"][0], rel=1e-2)  # bf16 rounding only
  assert float(metrics["loss"]) != reference["losses"][0]  # ... which is there: the compute really is bf16


def test_remat_policy_comes_from_config():
  c = _config(remat="full")
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
  assert trainer.model(trainer.abstract_state()).remat == "full"
  c.train.remat = "sometimes"
  with pytest.raises(ValueError, match="sometimes"):
    step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]))
