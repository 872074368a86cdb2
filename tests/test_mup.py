"""muP (model.parametrization=mup): width-scaled initialisation, per-parameter Adam learning rates (closed form of
Adam's first step), the output and attention multipliers against the standard parametrization's forward pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from parallel import mesh as mesh_lib
from train.core import step as step_lib

HIDDEN = ("layers/attn/q", "layers/attn/k", "layers/attn/v", "layers/attn/o", "layers/mlp/gate", "layers/mlp/up",
          "layers/mlp/down")


def _config(d_model, parametrization="mup", base=32):
  c = configs.load("tiny")
  c.model.update(vocab_size=128, d_model=d_model, num_layers=1, num_heads=d_model // 16, num_kv_heads=d_model // 16,
                 head_dim=16, mlp_dim=2 * d_model, max_seq_len=16, parametrization=parametrization,
                 mup_base_width=base, init_std=0.05)
  c.train.update(batch_size=4, seq_len=16, lr=1e-3, warmup_steps=0, schedule="constant", weight_decay=0.0,
                 clip_norm=0.0, eps=1e-12)
  c.mesh.update(data=1, fsdp=1, tensor=1, sequence=1)
  return c


def _flat(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _params(c, seed=0):
  return _flat(nnx.to_pure_dict(nnx.state(model_lib.Transformer(c.model, rngs=nnx.Rngs(seed)), nnx.Param)))


def test_hidden_weights_shrink_with_width_and_the_rest_do_not():
  small, large = _params(_config(64)), _params(_config(256))  # width multipliers 2 and 8
  for name in HIDDEN:
    assert small[name].std() == pytest.approx(0.05 / np.sqrt(2), rel=0.05), name
    assert large[name].std() == pytest.approx(0.05 / np.sqrt(8), rel=0.05), name
  for name in ("embed/embedding", "unembed"):
    assert large[name].std() == pytest.approx(0.05, rel=0.05), name
  sp = _params(_config(256, "sp"))
  assert sp["layers/attn/q"].std() == pytest.approx(0.05, rel=0.05)


def test_adam_first_step_moves_each_weight_by_lr_times_its_multiplier():
  """Adam's first update is g / (|g| + eps) = +-1 per element, so |delta| = lr x the muP multiplier (1/m for hidden
  matrices, 1 otherwise) with m = 128 / 32 = 4."""
  c = _config(128)
  trainer = step_lib.Trainer(c, mesh_lib.make_mesh(c.mesh, jax.devices()[:1]), step_lib.FAST_COMPILE)
  state = trainer.init()
  before = _flat(jax.device_get(state["params"]))
  state, _ = trainer.step_fn(state, trainer.batch_to_device(step_lib.synthetic_batch(c, 0)))
  after = _flat(jax.device_get(state["params"]))
  for name in before:
    delta = np.abs(after[name] - before[name])
    moved = delta[delta > 0]
    want = 1e-3 / 4 if name in HIDDEN else 1e-3
    assert np.median(moved) == pytest.approx(want, rel=1e-3), name


def test_output_and_attention_multipliers_against_the_standard_parametrization():
  """muP logits = SP logits / m of the same weights with the queries scaled by 1/sqrt(head_dim)."""
  mup_cfg, sp_cfg = _config(128), _config(128, "sp")
  mup_model = model_lib.Transformer(mup_cfg.model, rngs=nnx.Rngs(0))
  graphdef, sp_state = nnx.split(model_lib.Transformer(sp_cfg.model, rngs=nnx.Rngs(1)))
  pure = nnx.to_pure_dict(nnx.state(mup_model))
  pure["layers"]["attn"]["q"] = pure["layers"]["attn"]["q"] / np.sqrt(16)  # a copy; mup_model keeps its own
  nnx.replace_by_pure_dict(sp_state, pure)
  sp_model = nnx.merge(graphdef, sp_state)
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 128, size=(2, 16)), jnp.int32)
  want = np.asarray(nnx.jit(lambda m, x: m(x))(sp_model, tokens)) / 4.0
  got = np.asarray(nnx.jit(lambda m, x: m(x))(mup_model, tokens))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mup_refuses_tied_embeddings():
  c = _config(64)
  c.model.tie_embeddings = True
  with pytest.raises(ValueError, match="tie_embeddings"):
    model_lib.Transformer(c.model, rngs=nnx.Rngs(0))


def test_lr_multipliers_scale_the_adam_direction_and_not_the_weight_decay():
  """First AdamW step with muP multipliers m: delta = -lr (m g / |g| + wd p), so the decay factor lr x wd is the
  same for every width (the `mup` package's MuAdamW); with_frozen's frozen parameters still do not move."""
  from train.core import optimizer as optimizer_lib
  t = _config(64).train
  t.update(weight_decay=0.5, decay_exclude=())
  params = {"hidden": jnp.full((3, 2), 2.0), "vector": jnp.full((2,), -1.0), "frozen": jnp.ones((2,))}
  grads = {"hidden": jnp.array([[1.0, -2.0], [3.0, -4.0], [5.0, 6.0]]), "vector": jnp.array([0.5, -0.5]),
           "frozen": jnp.ones((2,))}
  tx = optimizer_lib.with_frozen(optimizer_lib.make(t, {"hidden": 0.25, "vector": 1.0, "frozen": 1.0}), ("frozen",))
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["hidden"], 0.25 * np.sign(grads["hidden"]) + 0.5 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates["vector"], np.sign(grads["vector"]) + 0.5 * -1.0, rtol=1e-6)
  np.testing.assert_array_equal(updates["frozen"], 0.0)
