"""fp8 matmuls (model.quant=fp8): e4m3 / e5m2 rounding against ml_dtypes' NumPy types, the forward product against
a float64 product of the dequantised operands and the error bound against float32, the straight-through e5m2
backward pass against its NumPy transcription, and the model option."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import configs
import model as model_lib
from model import quant

SPECS = {"bld,dhk->blhk": ((2, 5, 32), (32, 4, 8)), "blhk,hkd->bld": ((2, 5, 4, 8), (4, 8, 32)),
         "bld,df->blf": ((2, 5, 32), (32, 48)), "blf,fd->bld": ((2, 5, 48), (48, 32))}
# (NumPy type, largest finite, unit roundoff 2^-mantissa_bits-1, half the smallest subnormal), from the formats.
FORMATS = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 2.0**-4, 2.0**-10),
           "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 2.0**-3, 2.0**-17)}


def _np_quantize(x, fmt):
  """NumPy reference: the smallest power-of-two scale with amax / scale <= fmax, round to nearest even by
  ml_dtypes' cast."""
  np_type, fmax, _, _ = FORMATS[fmt]
  x = np.asarray(x, np.float32)
  amax, scale = float(np.abs(x).max()), 1.0
  while amax and amax / scale > fmax:
    scale *= 2.0
  while amax and amax / (scale / 2) <= fmax:
    scale /= 2.0
  assert amax / scale <= fmax
  return (x / np.float32(scale)).astype(np_type), np.float32(scale)


def _rounding_error_bound(x, scale, fmt):
  _, _, u, half_subnormal = FORMATS[fmt]
  return u * np.abs(x) + half_subnormal * scale


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantize_matches_ml_dtypes_rounding(fmt):
  rng = np.random.default_rng(0)
  # Normals over many binades, values that land in the subnormal range after scaling, ties, exact zeros.
  x = (rng.normal(size=4096) * np.exp2(rng.integers(-20, 6, size=4096))).astype(np.float32)
  x[:3] = 0.0
  dtype = {"e4m3": quant.E4M3, "e5m2": quant.E5M2}[fmt]
  q, s = jax.jit(quant.quantize_fp8, static_argnums=1)(x, dtype)
  want_q, want_s = _np_quantize(x, fmt)
  assert q.dtype == dtype and float(s) == float(want_s)
  np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))  # bit for bit
  assert np.isfinite(np.asarray(q, np.float32)).all()
  assert FORMATS[fmt][1] / 2 <= np.abs(np.asarray(q, np.float32)).max() <= FORMATS[fmt][1]  # the top binade is used
  err = np.abs(np.asarray(q, np.float64) * float(s) - x)
  assert (err <= _rounding_error_bound(x, float(s), fmt) * (1 + 1e-6)).all() and err.max() > 0
  zq, zs = quant.quantize_fp8(jnp.zeros((3, 4)), dtype)
  assert float(zs) == 1.0 and not np.asarray(zq, np.float32).any()


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_fp8_einsum_equals_dequantised_product_and_is_within_the_error_bound(spec):
  rng = np.random.default_rng(1)
  xs, ws = SPECS[spec]
  x = rng.normal(size=xs).astype(np.float32)
  w = (0.1 * rng.normal(size=ws)).astype(np.float32)
  got = np.asarray(jax.jit(quant.fp8_einsum, static_argnums=0)(spec, x, w), np.float64)
  (qx, sx), (qw, sw) = _np_quantize(x, "e4m3"), _np_quantize(w, "e4m3")
  dequant = np.einsum(spec, qx.astype(np.float64), qw.astype(np.float64)) * float(sx) * float(sw)
  np.testing.assert_allclose(got, dequant, rtol=1e-5, atol=1e-6)  # float32 accumulation of the fp8 products
  exact = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
  ex, ew = _rounding_error_bound(x, float(sx), "e4m3"), _rounding_error_bound(w, float(sw), "e4m3")
  bound = np.einsum(spec, ex, np.abs(w)) + np.einsum(spec, np.abs(x), ew) + np.einsum(spec, ex, ew)
  assert (np.abs(got - exact) <= bound * (1 + 1e-4) + 1e-6).all()
  assert np.abs(got - exact).max() > 0  # it does quantise


def test_gradients_are_straight_through_in_e5m2():
  spec = "bld,df->blf"
  rng = np.random.default_rng(2)
  x, w = (rng.normal(size=s).astype(np.float32) for s in SPECS[spec])
  loss = lambda f: (lambda a, b: jnp.sum(jnp.sin(f(a, b))))
  have = jax.jit(jax.grad(loss(lambda a, b: quant.fp8_einsum(spec, a, b)), argnums=(0, 1)))(x, w)
  # NumPy transcription: the cotangent cos(y) at the fp8 output, rounded to e5m2, times the saved e4m3 operands.
  y = np.asarray(jax.jit(quant.fp8_einsum, static_argnums=0)(spec, x, w))
  qg, sg = _np_quantize(np.cos(y), "e5m2")
  (qx, sx), (qw, sw) = _np_quantize(x, "e4m3"), _np_quantize(w, "e4m3")
  g64, x64, w64 = (a.astype(np.float64) * float(s) for a, s in ((qg, sg), (qx, sx), (qw, sw)))
  np.testing.assert_allclose(np.asarray(have[0]), np.einsum("blf,df->bld", g64, w64), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(have[1]), np.einsum("bld,blf->df", x64, g64), rtol=1e-5, atol=1e-5)
  # Gradients flow: for a fixed cotangent c (loss sum(c * y)) they stay within a few percent of float32's.
  c = rng.normal(size=y.shape).astype(np.float32)
  have = jax.jit(jax.grad(lambda a, b: jnp.sum(c * quant.fp8_einsum(spec, a, b)), argnums=(0, 1)))(x, w)
  want = np.einsum("blf,df->bld", c, w), np.einsum("bld,blf->df", x, c)
  for h, f in zip(have, want):
    h, f = np.asarray(h).ravel(), f.ravel()
    assert 0 < np.linalg.norm(h - f) < 0.1 * np.linalg.norm(f)


def test_model_fp8_on_the_chosen_layer_types():
  c = configs.load("tiny").model
  c.update(vocab_size=128, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
           max_seq_len=16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 128, size=(2, 16)), jnp.int32)
  forward = nnx.jit(lambda m, x: m(x))
  ref = np.asarray(forward(model_lib.Transformer(c, rngs=nnx.Rngs(0)), tokens))
  c.update(quant="fp8", quant_layers=("mlp",))
  fp8 = model_lib.Transformer(c, rngs=nnx.Rngs(0))
  assert fp8.layers.attn.quant == "none" and fp8.layers.mlp.quant == "fp8"
  err = np.abs(np.asarray(forward(fp8, tokens)) - ref).max()
  assert 0 < err < 0.1 * np.abs(ref).max()
