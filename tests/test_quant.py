"""int8 matmuls: exact integer arithmetic against a NumPy dequantised reference, the error bound against
float32, straight-through gradients, and the model option per layer type."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from model import quant

SPECS = {"bld,dhk->blhk": ((2, 5, 32), (32, 4, 8)), "blhk,hkd->bld": ((2, 5, 4, 8), (4, 8, 32)),
         "bld,df->blf": ((2, 5, 32), (32, 48)), "blf,fd->bld": ((2, 5, 48), (48, 32))}


def _numpy_quantize(x, axes):
  scale = np.abs(x).max(axis=axes, keepdims=True) / 127.0
  scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
  return np.clip(np.round(x / scale), -127, 127).astype(np.int64), scale


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_int8_einsum_is_exact_integer_arithmetic_and_within_the_error_bound(spec):
  rng = np.random.default_rng(0)
  xs, ws = SPECS[spec]
  x = rng.normal(size=xs).astype(np.float32)
  w = (0.1 * rng.normal(size=ws)).astype(np.float32)
  w[..., 0] = 0.0  # an all-zero output channel
  ax, aw = quant.contracting_axes(spec)
  qx, sx = _numpy_quantize(x, ax)
  qw, sw = _numpy_quantize(w, aw)
  acc = np.einsum(spec, qx, qw)  # int64: exact
  got = np.asarray(jax.jit(quant.int8_einsum, static_argnums=0)(spec, x, w))
  np.testing.assert_array_equal(np.asarray(jax.jit(
      lambda a, b: jnp.einsum(spec, *(quant.quantize(v, c)[0] for v, c in ((a, ax), (b, aw))),
                              preferred_element_type=jnp.int32))(x, w)), acc)
  np.testing.assert_allclose(got, acc * np.einsum(spec, sx, sw), rtol=1e-6)
  exact = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
  bound = (np.einsum(spec, np.broadcast_to(sx / 2, x.shape), np.abs(w)) + np.einsum(spec, np.abs(x),
           np.broadcast_to(sw / 2, w.shape)) + np.einsum(spec, np.broadcast_to(sx, x.shape),
                                                         np.broadcast_to(sw / 4, w.shape)))
  assert (np.abs(got - exact) <= bound + 1e-6).all()
  assert np.abs(got - exact).max() > 0  # it does quantise


def test_gradients_are_straight_through():
  spec = "bld,df->blf"
  rng = np.random.default_rng(1)
  x, w = (rng.normal(size=s).astype(np.float32) for s in SPECS[spec])
  loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
  want = jax.grad(loss(lambda a, b: jnp.einsum(spec, a, b)), argnums=(0, 1))(x, w)
  # The cotangent is taken at the quantised output (sin'), the rest is the float einsum's transpose.
  fwd = quant.int8_einsum(spec, x, w)
  have = jax.grad(loss(lambda a, b: quant.int8_einsum(spec, a, b)), argnums=(0, 1))(x, w)
  g = np.cos(np.asarray(fwd))
  np.testing.assert_allclose(np.asarray(have[0]), np.einsum("blf,df->bld", g, w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(have[1]), np.einsum("bld,blf->df", x, g), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(have[0]), np.asarray(want[0]), atol=0)  # cos at the quantised output


def test_model_quantises_only_the_chosen_layer_types():
  c = configs.load("tiny").model
  c.update(vocab_size=128, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
           max_seq_len=16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 128, size=(2, 16)), jnp.int32)
  out = {}
  for q, layers in (("none", ("attn", "mlp")), ("int8", ("attn", "mlp")), ("int8", ("mlp",)), ("int8", ())):
    c.update(quant=q, quant_layers=layers)
    out[(q, layers)] = np.asarray(nnx.jit(lambda m, x: m(x))(model_lib.Transformer(c, rngs=nnx.Rngs(0)), tokens))
  ref = out[("none", ("attn", "mlp"))]
  np.testing.assert_array_equal(out[("int8", ())], ref)
  for key in (("int8", ("attn", "mlp")), ("int8", ("mlp",))):
    err = np.abs(out[key] - ref).max()
    assert 0 < err < 0.05 * np.abs(ref).max(), key
  assert not np.array_equal(out[("int8", ("attn", "mlp"))], out[("int8", ("mlp",))])
  c.update(quant_layers=("attn", "embed"))
  with pytest.raises(ValueError, match="quant_layers"):
    model_lib.Transformer(c, rngs=nnx.Rngs(0))


def _dot_operand_ranks(spec, mesh):
  """Ranks of the dot_general operands `quant.project` traces under `mesh` (its platform decides the form)."""
  x, w = (jax.ShapeDtypeStruct(s, jnp.float32) for s in SPECS[spec])
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    jaxpr = jax.make_jaxpr(lambda a, b: quant.project(spec, a, b))(x, w)
  return [tuple(len(v.aval.shape) for v in e.invars) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("spec", ["bld,dhk->blhk", "blhk,hkd->bld"])
def test_projections_are_flattened_for_cpu_programs_only(spec):
  """CPU programs get one 2-D matmul (XLA:CPU's faster weight gradient); a TPU program keeps the einsum whole
  (its forward and backward products then share one all-gathered kernel layout)."""
  from train.planning import compile as aot  # pylint: disable=g-import-not-at-top
  from train.planning import hardware  # pylint: disable=g-import-not-at-top
  cpu = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  assert _dot_operand_ranks(spec, cpu) == [(2, 2)]
  try:
    tpu_devices = aot.abstract_devices(hardware.tpu_slice("v5e-4"))
  except aot.NoTpuCompiler as e:
    pytest.fail(str(e))
  tpu = jax.sharding.Mesh(np.array(tpu_devices[:1]), ("data",))
  assert _dot_operand_ranks(spec, tpu) == [tuple(len(s) for s in SPECS[spec])]
