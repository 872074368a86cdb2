"""train.optimizer = muon | adafactor | lion | schedule_free_adamw (and the state dtype) against optax's reference
aliases and NumPy: first steps on a model-shaped tree with a decay mask, Muon's Newton-Schulz spectrum, schedule-free's
averaged parameters, the config refusals, and the planner's state bytes against the Trainer's sharded state."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import configs
from configs.errors import ConfigError
from configs import validate
from train.core import optimizer as opt_lib
from train.planning import memory

LR, WD, STEPS = 1e-2, 0.1, 4
# logical axes as the model names them: the layer axis batched, q [D, H, K], o [H, K, D], MLP [D, F] / [F, D]
NAMES = {"embed": {"embedding": ("vocab", "embed")},
         "layers": {"attn": {"q": ("layers", "embed", "heads", "head_dim"), "o": ("layers", "heads", "head_dim", "embed")},
                    "mlp": {"down": ("layers", "mlp", "embed")}, "norm": {"scale": ("layers", "embed")}},
         "unembed": ("embed", "vocab")}
SHAPES = {"embed": {"embedding": (40, 16)},
          "layers": {"attn": {"q": (2, 16, 4, 8), "o": (2, 4, 8, 16)}, "mlp": {"down": (2, 48, 16)},
                     "norm": {"scale": (2, 16)}},
          "unembed": (16, 40)}
is_names = lambda x: isinstance(x, tuple) and all(isinstance(n, str) for n in x)


def _train_cfg(optimizer, **kw):
  t = configs.load("tiny").train
  t.update(optimizer=optimizer, lr=LR, warmup_steps=0, schedule="constant", weight_decay=WD, clip_norm=1.0,
           decay_exclude=("norm", "embedding"), adafactor_min_dim_to_factor=8)
  t.update(**kw)
  return t


def _params(seed=0):
  leaves, tree = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, s) for k, s in zip(keys, leaves)])


def _loss(params, targets):
  """A quartic bowl: gradients that change with the parameters, different scales per leaf."""
  return sum(jnp.sum((p - t) ** 2 + 0.5 * (p - t) ** 4) * (i + 1)
             for i, (p, t) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(targets))))


def _muon_dims():
  return jax.tree.map(opt_lib.muon_dimension_numbers, NAMES, is_leaf=is_names)


def _ours(t, steps=STEPS):
  """The train step's arithmetic: gradient at gradient_point, unit update times -lr (or the update itself),
  averaged back."""
  tx = opt_lib.make(t, muon_dims=_muon_dims() if t.optimizer == "muon" else None)
  params, targets = _params(0), _params(1)
  state = tx.init(params)
  for _ in range(steps):
    point = opt_lib.gradient_point(params, state)
    grads = jax.grad(_loss)(point, targets)
    updates, state = tx.update(grads, state, point)
    params = opt_lib.averaged(opt_lib.apply_lr(point, updates, LR, opt_lib.brings_lr(t)), state)
  return params


def _reference(tx, steps=STEPS, eval_params=None):
  params, targets = _params(0), _params(1)
  state = tx.init(params)
  for _ in range(steps):
    updates, state = tx.update(jax.grad(_loss)(params, targets), state, params)
    params = optax.apply_updates(params, updates)
  return eval_params(state, params) if eval_params else params


def _mask(params):
  return opt_lib.decay_mask(params, ("norm", "embedding"))


def _close(got, want, rtol=2e-5, atol=1e-7):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_lion_equals_optax_lion():
  t = _train_cfg("lion", b1=0.9, b2=0.99)
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(LR, b1=0.9, b2=0.99, weight_decay=WD, mask=_mask))
  _close(_ours(t), _reference(ref))


def test_adafactor_equals_optax_adafactor():
  # optax.adafactor adds its decay after the learning rate (p -= lr u + rate p): rate = lr * wd is meshlm's
  # decoupled decay at a constant learning rate.
  t = _train_cfg("adafactor", adafactor_decay_rate=0.8, adafactor_clip=1.0)
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adafactor(
      LR, min_dim_size_to_factor=8, decay_rate=0.8, clipping_threshold=1.0, multiply_by_parameter_scale=False,
      weight_decay_rate=LR * WD, weight_decay_mask=_mask))
  _close(_ours(t), _reference(ref))
  state = opt_lib.make(t).init(_params())
  moments = state[1][0]  # after clip's state: the factored moments
  # q [2, 16, 4, 8]: its two largest axes (16, 8) are factored, one mean over each; no full second moment.
  assert (moments.v_row["layers"]["attn"]["q"].shape, moments.v_col["layers"]["attn"]["q"].shape) == ((2, 4, 8),
                                                                                                    (2, 16, 4))
  assert moments.v["layers"]["attn"]["q"].shape == (1,)


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_equals_optax_muon(nesterov):
  """Matrices (q, o, down) through Muon with their layer axis batched; embeddings, unembed and norms through
  AdamW. optax.contrib.muon decays its Adam side unmasked and makes it Nesterov Adam when Muon is Nesterov: without
  Nesterov the whole tree equals it (no decay mask); with Nesterov (and no clipping, which would couple the leaves)
  the matrices equal it and the other leaves equal optax.adamw with the mask."""
  t = _train_cfg("muon", muon_nesterov=nesterov, muon_momentum=0.95, muon_rms=0.2, b1=0.9, b2=0.95, eps=1e-8,
                 decay_exclude=() if not nesterov else ("norm", "embedding"), clip_norm=0.0 if nesterov else 1.0)
  mask = _mask if nesterov else None
  muon = optax.contrib.muon(LR, ns_coeffs=tuple(t.muon_ns_coeffs), ns_steps=5, beta=0.95, eps=1e-8, weight_decay=WD,
                            weight_decay_mask=mask, nesterov=nesterov, consistent_rms=0.2, adam_b1=0.9, adam_b2=0.95,
                            adam_weight_decay=WD, muon_weight_dimension_numbers=_muon_dims())
  got = _ours(t)
  if not nesterov:
    _close(got, _reference(optax.chain(optax.clip_by_global_norm(1.0), muon)))
    return
  want, adam_ref = _reference(muon), _reference(optax.adamw(LR, b1=0.9, b2=0.95, eps=1e-8, weight_decay=WD, mask=_mask))
  matrices = set()
  is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  for path, d in jax.tree_util.tree_leaves_with_path(_muon_dims(), is_leaf=is_dims):
    a, b = get_path(got, path), get_path(want if d is not None else adam_ref, path)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    if d is not None:
      matrices.add(jax.tree_util.keystr(path))
  assert matrices == {"['layers']['attn']['q']", "['layers']['attn']['o']", "['layers']['mlp']['down']"}


def get_path(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


def test_schedule_free_keeps_the_averaged_parameters():
  """The state keeps x; optax's schedule_free_adamw keeps y and gives x through schedule_free_eval_params."""
  t = _train_cfg("schedule_free_adamw", b1=0.9, b2=0.999, eps=1e-8, decay_exclude=())
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.schedule_free_adamw(
      LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WD))
  want = _reference(ref, eval_params=lambda s, p: optax.contrib.schedule_free_eval_params(s[1], p))
  _close(_ours(t), want, rtol=1e-4, atol=1e-6)  # x -> y -> x each step costs a rounding


def _newton_schulz_numpy(g, coeffs, steps, eps=1e-8):
  """Jordan's quintic iteration in float64: X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation."""
  x = g / (np.linalg.norm(g) + eps)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  a, b, c = coeffs
  for _ in range(steps):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
def test_muon_orthogonalisation_spectrum(shape):
  """One Muon step without momentum history is the Newton-Schulz image of the gradient: equal to NumPy's
  iteration, with singular values near 1 (5 quintic steps with Jordan's coefficients leave them in ~[0.7, 1.2])
  where the gradient's spread over two orders of magnitude."""
  rng = np.random.default_rng(0)
  u, _, vt = np.linalg.svd(rng.normal(size=shape), full_matrices=False)
  g = (u * np.geomspace(1.0, 0.01, min(shape))) @ vt
  coeffs = (3.4445, -4.775, 2.0315)
  tx = optax.contrib.scale_by_muon(ns_coeffs=coeffs, ns_steps=5, beta=0.95, nesterov=False,
                                   weight_dimension_numbers=opt_lib.muon_dimension_numbers(("embed", "mlp")))
  out, _ = tx.update(jnp.asarray(g, jnp.float32), tx.init(jnp.zeros(shape)))
  want = _newton_schulz_numpy(g, coeffs, 5)
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
  sv = np.linalg.svd(np.asarray(out, np.float64), compute_uv=False)
  assert 0.65 < sv.min() and sv.max() < 1.25, sv
  assert np.linalg.svd(g, compute_uv=False).max() / np.linalg.svd(g, compute_uv=False).min() > 90


def test_muon_dimension_numbers_of_the_model_axes():
  D = opt_lib.muon_dimension_numbers
  assert D(("layers", "embed", "heads", "head_dim")) == optax.contrib.MuonDimensionNumbers((1,), (2, 3))
  assert D(("layers", "heads", "head_dim", "embed")) == optax.contrib.MuonDimensionNumbers((1, 2), (3,))
  assert D(("layers", "experts", "mlp", "embed")) == optax.contrib.MuonDimensionNumbers((2,), (3,))
  for adam in (("vocab", "embed"), ("embed", "vocab"), ("layers", "embed"), ("layers", "embed", "experts"), None):
    assert D(adam) is None, adam


def test_bfloat16_state_is_stored_narrow_and_updated_in_float32():
  t = _train_cfg("adamw", opt_state_dtype="bfloat16")
  tx = opt_lib.make(t)
  params, targets = _params(0), _params(1)
  state = tx.init(params)
  grads = jax.grad(_loss)(params, targets)
  updates, state = tx.update(grads, state, params)
  mu = state[1].mu
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mu))
  assert state[1].count.dtype == jnp.int32
  # One step from zero moments: m = (1 - b1) g in float32, then rounded once to bfloat16.
  want = jax.tree.map(lambda g: ((1 - t.b1) * g).astype(jnp.bfloat16), jax.tree.map(
      lambda g: g * min(1.0, 1.0 / float(optax.tree.norm(grads))), grads))
  _close(jax.tree.map(lambda x: x.astype(jnp.float32), mu), jax.tree.map(lambda x: x.astype(jnp.float32), want),
         rtol=0, atol=0)


@pytest.mark.parametrize("override, message", [
    ({"optimizer": "sgd"}, "config.train.optimizer='sgd' is not one of"),
    ({"optimizer": "schedule_free_adamw", "schedule": "cosine"}, "set train.schedule=constant"),
    ({"opt_state_dtype": "float16"}, "config.train.opt_state_dtype='float16'"),
    ({"optimizer": "muon", "muon_ns_coeffs": (1.0, 2.0)}, "config.train.muon_ns_coeffs"),
])
def test_bad_optimizer_settings_are_refused(override, message):
  c = configs.load("tiny")
  c.train.update(**override)
  with pytest.raises(ConfigError, match=message):
    validate.check(c)


def test_keys_of_another_optimizer_are_refused():
  c = configs.load("tiny")
  c.train.update(optimizer="adamw", muon_momentum=0.9)
  with pytest.raises(ConfigError, match="train.muon_momentum=0.9 has no effect unless train.optimizer=muon"):
    validate.check(c)
  c = configs.load("tiny")
  c.train.update(optimizer="lion", eps=1e-6)
  with pytest.raises(ConfigError, match="train.eps"):
    validate.check(c)


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "muon", "adafactor", "schedule_free_adamw"])
def test_planned_state_bytes_equal_the_trainers_state(optimizer):
  """train.plan's optimizer bytes per device (its ratio times the planned weights) against the bytes of the
  Trainer's opt_state shards on an 8-device fsdp mesh (no compile: shardings of the abstract state)."""
  from parallel import mesh as mesh_lib
  from train.core import step as step_lib
  c = configs.load("tiny")
  c.model.update(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=256,
                 max_seq_len=16)
  c.train.update(optimizer=optimizer, opt_state_dtype="bfloat16", batch_size=8, seq_len=16,
                 schedule="constant" if optimizer == "schedule_free_adamw" else "cosine")
  c.mesh.update(data=1, fsdp=8)
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh))
  abstract = trainer.abstract_state()
  shard_bytes = lambda x: np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  held = sum(shard_bytes(x) for x in jax.tree.leaves(abstract["opt_state"]))
  weights = sum(shard_bytes(x) for x in jax.tree.leaves(abstract["params"]))
  import model
  n = model.count_params(c.model)["total"]
  planned = memory.meshlm_state(c, n, {"fsdp": 8, "tensor": 1, "expert": 1, "stage": 1})
  assert planned["weights"] == pytest.approx(weights, rel=0.02)
  assert planned["optimizer"] == pytest.approx(held, rel=0.05), (optimizer, planned["optimizer"], held)


# ---- the Trainer on 8 devices ------------------------------------------------------------------------------------
MESHES = {"fsdp8": (1, 8, 1), "data2_tensor4": (2, 1, 4)}  # (data, fsdp, tensor)


def _trainer(optimizer, shape, devices=None):
  from parallel import mesh as mesh_lib
  from train.core import step as step_lib
  c = configs.load("tiny")
  # 8 layers: Muon's matrix stacks can move onto the layer axis on either mesh (optimizer.muon_layout).
  c.model.update(vocab_size=128, d_model=32, num_layers=8, num_heads=4, num_kv_heads=4, head_dim=8, mlp_dim=64,
                 max_seq_len=16)
  c.train.update(optimizer=optimizer, batch_size=8, seq_len=16, lr=1e-2, warmup_steps=1, adafactor_min_dim_to_factor=8,
                 schedule="constant" if optimizer == "schedule_free_adamw" else "cosine")
  c.mesh.update(data=shape[0], fsdp=shape[1], tensor=shape[2])
  return step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, devices), step_lib.FAST_COMPILE), c


def _steps(trainer, config, state, first, last):
  from train.core import step as step_lib
  for i in range(first, last):
    state, _ = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(config, i)))
  return state


def _updates(trainer, grads_seq):
  """The optimizer's update after each of `grads_seq` (the same gradients on every mesh), from the trainer's
  initial state, jitted with the trainer's shardings."""
  sh = trainer.state_shardings
  fn = jax.jit(lambda g, s, p: trainer.tx.update(g, s, p), in_shardings=(sh["params"], sh["opt_state"], sh["params"]),
               out_shardings=(sh["params"], sh["opt_state"]))
  state = trainer.init()
  opt_state, out = state["opt_state"], []
  for grads in grads_seq:
    update, opt_state = fn(grads, opt_state, state["params"])
    out.append(jax.device_get(update))
  return out


def _relative(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "lion", "muon", "adafactor", "schedule_free_adamw"])
def test_sharded_updates_equal_one_device_and_resume_exactly(optimizer, tmp_path):
  """The update of 3 consecutive steps from the same gradients on fsdp=8 and on data=2 x tensor=4 equals one
  device's (relative 1e-5: Muon's Newton-Schulz on the relaid matrices, Adafactor's factored moments over split
  axes). Whole training steps too, where gradients differ by the meshes' reduction order: 1e-5 for the update
  rules that do not divide by a per-element RMS; 1e-4 for AdamW and schedule-free (Adam scales an entry whose
  gradient is near 0 up to unit size, so float32 reduction-order noise there moves it visibly). On fsdp=8 a
  checkpoint after step 1, restored into a fresh state and continued, equals the uninterrupted run bit for bit."""
  from train.core import checkpoint as ckpt_lib
  one, config = _trainer(optimizer, (1, 1, 1), jax.devices()[:1])
  keys = jax.random.split(jax.random.key(7), 3)
  shapes = jax.tree.map(lambda x: x.shape, jax.device_get(one.init()["params"]))
  grads_seq = [jax.tree.map(lambda shp, k=k: 0.01 * jax.random.normal(k, shp), shapes,
                            is_leaf=lambda x: isinstance(x, tuple)) for k in keys]
  want_updates = _updates(one, grads_seq)
  want = jax.device_get(_steps(one, config, one.init(), 0, 3)["params"])
  step_tolerance = 1e-4 if optimizer in ("adamw", "schedule_free_adamw") else 1e-5
  for name, shape in MESHES.items():
    trainer, config = _trainer(optimizer, shape)
    for i, (got_u, want_u) in enumerate(zip(_updates(trainer, grads_seq), want_updates)):
      for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_u), jax.tree.leaves(want_u)):
        assert _relative(a, b) < 1e-5, (name, i, jax.tree_util.keystr(path), _relative(a, b))
    got = jax.device_get(_steps(trainer, config, trainer.init(), 0, 3)["params"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      assert _relative(a, b) < step_tolerance, (name, jax.tree_util.keystr(path), _relative(a, b))
    if name != "fsdp8":
      continue
    checkpointer = ckpt_lib.Checkpointer(str(tmp_path / "ckpt"))
    checkpointer.save(1, _steps(trainer, config, trainer.init(), 0, 1), None, {})
    checkpointer.wait()
    restored, _ = checkpointer.restore(trainer.abstract_state())
    checkpointer.close()
    resumed = jax.device_get(_steps(trainer, config, restored, 1, 3))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(resumed), jax.tree.leaves(
        jax.device_get(_steps(trainer, config, trainer.init(), 0, 3)))):
      assert np.array_equal(a, b), jax.tree_util.keystr(path)


@pytest.mark.slow
def test_muon_orthogonalises_whole_matrices_on_an_fsdp_mesh():
  """With the 8 layers' matrix stacks moved onto the layer axis (optimizer.muon_layout), the compiled Muon step
  gathers and reduces exactly what AdamW's does: the Newton-Schulz products add no collective over the split matrix
  axes, only all-to-alls of each device's shard of the matrices (gradient in, update out), at most 4 of them."""
  from train.planning import hlo
  moved = {}
  for optimizer in ("adamw", "muon"):
    trainer, _ = _trainer(optimizer, MESHES["fsdp8"])
    moved[optimizer] = {}
    for op in hlo.collective_ops(trainer.compiled().as_text(), 8):
      moved[optimizer][op["kind"]] = moved[optimizer].get(op["kind"], 0) + op["bytes"] * max(op["per_step"], 1)
  for kind in ("all-gather", "all-reduce"):
    assert moved["muon"].get(kind, 0) == moved["adamw"].get(kind, 0), kind
  d, f, layers = 32, 64, 8
  shard_bytes = layers * (4 * d * d + 3 * d * f) * 4 // 8  # q, k, v, o and the MLP's three, float32, over 8 devices
  extra = moved["muon"].get("all-to-all", 0) - moved["adamw"].get("all-to-all", 0)
  assert 2 * shard_bytes <= extra <= 4 * shard_bytes, (extra, shard_bytes)
