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


def test_parameters_and_activations_carry_logical_names():
  cfg = base.get_config().model
  cfg.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)
  abstract = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
  names = {"/".join(map(str, path)): var.get_metadata()["out_sharding"]
           for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))}
  assert names["layers/attn/q"] == ("layers", "embed", "heads", "head_dim")
  assert names["layers/attn/k"] == ("layers", "embed", "kv_heads", "head_dim")
  assert names["layers/mlp/down"] == ("layers", "mlp", "embed")
  assert names["embed/embedding"] == ("vocab", "embed") and names["unembed"] == ("embed", "vocab")
  assert all(len(n) == v.ndim for n, v in zip(names.values(), jax.tree.leaves(nnx.state(abstract, nnx.Param))))
  # Under a mesh and rules, parameters are created sharded and activations are constrained.
  mesh = _mesh()
  with jax.set_mesh(mesh), axes.axis_rules(RULES):
    sharded = nnx.eval_shape(lambda: model.Transformer(cfg, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(sharded, nnx.Param))
    assert specs["layers"]["attn"]["q"].get_value() == P(None, None, "tensor", None)
    assert specs["unembed"].get_value() == P(None, "tensor")
    tokens = jnp.zeros((4, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(nnx.graphdef(sharded), s)(tokens))(nnx.state(sharded)))
  assert jaxpr.count("sharding_constraint") >= 8  # embeddings, q/k/v, context, outputs, logits
