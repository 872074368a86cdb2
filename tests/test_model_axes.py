"""model.axes: constrain is a no-op without mesh + rules; with them, parameters and activations are sharded."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import model
from configs import base
from model import axes

RULES = (("batch", "data"), ("length", "sequence"), ("kv_length", None), ("embed", None), ("heads", "tensor"),
         ("kv_heads", "tensor"), ("head_dim", None), ("mlp", "tensor"), ("vocab", "tensor"), ("layers", None))


def _mesh():
  return jax.make_mesh((2, 2, 2), ("data", "tensor", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _has_constraint(fn, *args):
  return "sharding_constraint" in str(jax.make_jaxpr(fn)(*args))


def test_constrain_is_identity_without_mesh_or_rules():
  x = jnp.ones((4, 8, 16))
  names = ("batch", "length", "embed")
  assert axes.constrain(x, names) is x
  assert not _has_constraint(lambda x: axes.constrain(x, names), x)
  with axes.axis_rules(RULES):  # rules but no mesh
    assert not _has_constraint(lambda x: axes.constrain(x, names), x)
  with jax.set_mesh(_mesh()):  # mesh but no rules
    assert not _has_constraint(lambda x: axes.constrain(x, names), x)
  with jax.set_mesh(_mesh()), axes.axis_rules(RULES):
    assert _has_constraint(lambda x: axes.constrain(x, names), x)


def test_spec_follows_rules_and_uses_each_mesh_axis_once():
  assert axes.spec(("batch", "length", "heads", "head_dim"), RULES) == P("data", "sequence", "tensor", None)
  # kv_length maps to no mesh axis: K/V are gathered under sequence parallelism.
  assert axes.spec(("batch", "kv_length", "kv_heads", "head_dim"), RULES) == P("data", None, "tensor", None)
  assert axes.spec(("embed", "embed2"), (("embed", "data"), ("embed2", "data"))) == P("data", None)


def test_sharded_model_matches_single_device():
  cfg = base.get_config().model
  cfg.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  tokens = np.random.default_rng(0).integers(0, 64, size=(4, 8)).astype(np.int32)
  single = model.Transformer(cfg, rngs=nnx.Rngs(0))
  want = np.asarray(single(tokens))
  mesh = _mesh()
  with jax.set_mesh(mesh), axes.axis_rules(RULES):
    sharded = model.Transformer(cfg, rngs=nnx.Rngs(0))
    for var, spec in [(sharded.layers.attn.q, P(None, None, "tensor", None)),  # [layers, D, H, K]
                      (sharded.layers.mlp.down, P(None, "tensor", None)),  # [layers, F, D]
                      (sharded.unembed, P(None, "tensor"))]:  # [D, V]
      value = var.get_value()
      assert value.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), value.ndim), value.sharding
    forward = nnx.jit(lambda m, t: m(t))
    got = forward(sharded, tokens)
    assert _has_constraint(lambda s, t: nnx.merge(nnx.graphdef(sharded), s)(t), nnx.state(sharded), tokens)
  assert got.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P("data", "sequence", "tensor")), 3)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
