"""QLoRA base-weight quantization (model/basequant.py) against independent NumPy references: the NF4 levels from
the normal quantiles, NF4 blocks and packed bytes as bitsandbytes lays them out on the PyTorch [out, in] weight,
int8 per channel, double quantization through ml_dtypes' e4m3, error bounds, jit / scan over layers, sharding."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from model import basequant as bq

LEVELS64 = bq.NF4_LEVELS.astype(np.float64)
ULP = 2.0**-23  # float32's relative spacing: scales are amax times the rounded reciprocal of 127 or 448
# name -> (shape, lead, n_in): q [D, H, K], o [H, K, D], scanned up [N, D, F], experts [N, E, D, F]
KERNELS = {"q": ((64, 4, 16), 0, 1), "o": ((4, 32, 48), 0, 2), "up": ((2, 128, 24), 1, 1),
           "experts": ((2, 3, 64, 16), 2, 1)}


def _norm_ppf(p):
  """The standard normal quantile: scipy's, else bisection of the CDF 0.5 (1 + erf(x / sqrt 2))."""
  try:
    from scipy.stats import norm
    return norm.ppf(p)
  except ImportError:
    def one(q):
      lo, hi = -10.0, 10.0
      for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q else (lo, mid)
      return (lo + hi) / 2
    return np.array([one(q) for q in np.asarray(p, np.float64)])


def test_nf4_levels_are_the_normalised_normal_quantiles():
  offset = 0.9677083  # bitsandbytes create_normal_map(offset=0.9677083, use_extra_value=True)
  pos = _norm_ppf(np.linspace(offset, 0.5, 9)[:-1])
  neg = -_norm_ppf(np.linspace(offset, 0.5, 8)[:-1])
  v = np.sort(np.concatenate([pos, [0.0], neg]))
  np.testing.assert_allclose(bq.NF4_LEVELS, v / v.max(), rtol=0, atol=1e-6)
  assert bq.NF4_LEVELS.dtype == np.float32 and len(bq.NF4_LEVELS) == 16


def _kernel(shape, seed):
  w = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 0.02
  return w


def _numpy_nf4(w, lead, n_in, block):
  """bitsandbytes' view: the PyTorch [out, in] weight of each lead index, flattened, in blocks of `block`
  consecutive elements; nearest level by float64 argmin (first index on ties); two codes per byte, even element
  high. Returns (bytes [lead, O*I/2], absmax [lead, O*I/block], nearest index [lead, O*I], dequantized w)."""
  ls, ins, outs = w.shape[:lead], w.shape[lead:lead + n_in], w.shape[lead + n_in:]
  n_i, n_o = math.prod(ins), math.prod(outs)
  torch_w = np.moveaxis(w.reshape(ls + (n_i, n_o)), -1, -2).reshape(ls + (n_o * n_i // block, block))
  absmax = np.abs(torch_w).max(axis=-1)
  x = torch_w / np.where(absmax > 0, absmax, np.float32(1))[..., None]
  idx = np.abs(x.astype(np.float64)[..., None] - LEVELS64).argmin(axis=-1)
  dq = bq.NF4_LEVELS[idx] * absmax[..., None]
  dq = np.moveaxis(dq.reshape(ls + (n_o, n_i)), -1, -2).reshape(w.shape)
  flat = idx.reshape(ls + (-1,))
  packed = (flat[..., 0::2] << 4 | flat[..., 1::2]).astype(np.uint8)
  return packed, absmax.reshape(ls + (-1,)), flat, dq


def _to_torch_order(a, lead):
  """Our [lead, I/block, (block/2,) outs...] child -> [lead, O * ...] in bitsandbytes' flattened order."""
  a = np.asarray(a)
  n_o = a.ndim - lead - (2 if a.dtype == np.uint8 else 1)
  axes = tuple(range(lead)) + tuple(range(a.ndim - n_o, a.ndim)) + tuple(range(lead, a.ndim - n_o))
  return a.transpose(axes).reshape(a.shape[:lead] + (-1,))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_nf4_matches_the_bitsandbytes_layout_on_the_torch_weight(name):
  shape, lead, n_in = KERNELS[name]
  w = _kernel(shape, 0)
  # The first block of output channel 0 of the first lead index: an exact tie between levels 7 and 8 (x is
  # L8/2, representable) takes the lower one; the block of output channel 1 is all zero.
  i0 = (0,) * lead
  first = np.zeros(math.prod(shape[lead:lead + n_in]), np.float32)
  first[:2] = [1.0, bq.NF4_LEVELS[8] / 2]
  w[i0 + (Ellipsis,)].reshape(-1, math.prod(shape[lead + n_in:]))[:, 0] = first
  w[i0 + (Ellipsis,)].reshape(-1, math.prod(shape[lead + n_in:]))[:64, 1] = 0.0
  block = 32 if name == "experts" else 64
  qk = jax.jit(bq.quantize, static_argnums=(1, 2, 3, 4))(w, lead, n_in, "nf4", block)
  packed, absmax, idx, dq = _numpy_nf4(w, lead, n_in, block)
  n_blocks = math.prod(shape[lead:lead + n_in]) // block
  assert qk.children[0].shape == shape[:lead] + (n_blocks, block // 2) + shape[lead + n_in:]
  assert qk.children[0].dtype == jnp.uint8 and qk.children[1].dtype == jnp.float32
  np.testing.assert_array_equal(_to_torch_order(qk.children[0], lead), packed)
  np.testing.assert_array_equal(_to_torch_order(qk.children[1], lead), absmax)
  unpacked = np.stack([np.asarray(qk.children[0]) >> 4, np.asarray(qk.children[0]) & 15], axis=lead + 2)
  np.testing.assert_array_equal(_to_torch_order(unpacked.reshape(unpacked.shape[:lead + 1] + (block,)
                                                                  + unpacked.shape[lead + 3:]), lead), idx)
  assert idx[i0][1] == 7  # the tie went low
  got = np.asarray(qk.dequantize(jnp.float32))
  np.testing.assert_array_equal(got, dq)
  assert qk.shape == shape and qk.ndim == len(shape) and qk.dtype == np.float32 and qk.lead == lead
  # Error bound: half the widest gap between adjacent levels times the block's absmax.
  c = np.abs(w.reshape(shape[:lead] + (n_blocks, block, -1))).max(axis=lead + 1, keepdims=True)
  err = np.abs(w - got).reshape(c.shape[:lead + 1] + (block, -1))
  assert (err <= c * np.diff(LEVELS64).max() / 2 * (1 + 1e-6)).all()


def test_int8_per_channel_matches_numpy_and_is_within_half_a_step():
  w = _kernel((2, 4, 16, 24), 1)  # scanned o: [N, H, K, D]
  w[0, :, :, 3] = 0.0  # an all-zero channel
  qk = jax.jit(bq.quantize, static_argnums=(1, 2, 3))(w, 1, 2, "int8")
  amax = np.abs(w).max(axis=(1, 2))
  s = np.asarray(qk.children[1])
  np.testing.assert_allclose(s, np.where(amax > 0, amax.astype(np.float64) / 127, 1), rtol=ULP, atol=0)
  q = np.clip(np.round(w / s[:, None, None, :]), -127, 127).astype(np.int8)  # given the scale checked above
  np.testing.assert_array_equal(np.asarray(qk.children[0]), q)
  got = np.asarray(qk.dequantize(jnp.float32))
  np.testing.assert_array_equal(got, q.astype(np.float32) * s[:, None, None, :])
  assert (np.abs(w - got) <= s[:, None, None, :] / 2 * (1 + 1e-6)).all()
  assert (got[0, :, :, 3] == 0).all() and qk.nbytes == w.size + 4 * 2 * 24


@pytest.mark.parametrize("shape,double_block", [((2, 256, 512), 256), ((2, 128, 96), 256)])
def test_double_quantization_matches_ml_dtypes_e4m3(shape, double_block):
  w = _kernel(shape, 2) * np.exp(np.random.default_rng(3).normal(size=shape[:2] + (1,))).astype(np.float32)
  qk = bq.quantize(w, 1, 1, "nf4", 64, double=True, double_block=double_block)
  _, c8, s2, mean = qk.children
  absmax = np.asarray(bq.quantize(w, 1, 1, "nf4", 64).children[1])  # [N, I/64, F]
  n = shape[-1]
  b2 = double_block if n % double_block == 0 else n  # one block over the axis when it does not divide
  assert qk.double_block == b2 and s2.shape == (shape[0], shape[1] // 64, n // b2) and mean.shape == (shape[0],)
  np.testing.assert_allclose(np.asarray(mean), absmax.astype(np.float64).mean(axis=(1, 2)), rtol=1e-6)
  # The rest given the stored mean (summation order makes float32 means differ in the last ulp).
  g = (absmax - np.asarray(mean)[:, None, None]).reshape(shape[0], shape[1] // 64, n // b2, b2)
  amax2 = np.abs(g).max(axis=-1)
  scale = np.asarray(s2)
  np.testing.assert_allclose(scale, np.where(amax2 > 0, amax2.astype(np.float64) / 448, 1), rtol=ULP, atol=0)
  want8 = (g / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)  # given the scales checked above
  np.testing.assert_array_equal(np.asarray(c8).view(np.uint8), want8.reshape(absmax.shape).view(np.uint8))
  c_hat = (want8.astype(np.float32) * scale[..., None]).reshape(absmax.shape) + np.asarray(mean)[:, None, None]
  np.testing.assert_allclose(np.asarray(qk.absmax), c_hat, rtol=1e-7, atol=0)
  cen = np.abs(absmax - np.asarray(mean)[:, None, None])
  bound = 2.0**-4 * cen + 2.0**-10 * np.repeat(scale, b2, axis=-1).reshape(absmax.shape)
  assert (np.abs(c_hat - absmax) <= bound * (1 + 1e-5) + 1e-9).all()
  assert np.abs(c_hat - absmax).max() > 0  # it does quantize
  # The weights: the same codes times the dequantized constants, within both errors.
  _, _, idx, _ = _numpy_nf4(w, 1, 1, 64)
  got = np.asarray(qk.dequantize(jnp.float32))
  want = np.moveaxis((bq.NF4_LEVELS[idx.reshape(shape[0], n, -1, 64)] * _to_torch_order(c_hat, 1).reshape(
      shape[0], n, -1)[..., None]).reshape(shape[0], n, shape[1]), -1, -2)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
  c = np.repeat(absmax, 64, axis=1)
  assert (np.abs(w - got) <= c * np.diff(LEVELS64).max() / 2 + np.repeat(np.abs(c_hat - absmax), 64, axis=1)
          + 1e-7).all()


def test_bytes_per_parameter_of_a_large_kernel():
  w = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  for kind, double in (("nf4", False), ("nf4", True), ("int8", False)):
    qk = jax.eval_shape(lambda x, k=kind, d=double: bq.quantize(x, 0, 1, k, double=d), w)
    per = qk.nbytes / qk.size
    want = {("nf4", False): 0.5 + 4 / 64, ("nf4", True): 0.5 + 1 / 64 + 4 / (64 * 256),
            ("int8", False): 1 + 4 / 8192}[(kind, double)]
    assert per == pytest.approx(want, rel=1e-6), (kind, double, per)
    assert bq.nbytes_per_param(kind, 64, double, fan_in=8192) == pytest.approx(want, rel=1e-6)
    assert qk.dtype == jnp.bfloat16 and qk.shape == w.shape
  assert bq.nbytes_per_param("nf4") == 0.5625 and bq.nbytes_per_param("none") == 2.0


def _assert_same_dequantized(got, want, double):
  """Bit for bit, except that double quantization's c8 * s2 + m may compile to one fused multiply-add or not:
  that changes c^ by half an ulp of c8 * s2 (|c8 s2| <= max c), so w^ by at most 2^-24 max |w^|."""
  got, want = np.asarray(got), np.asarray(want)
  if double:
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-23 * np.abs(want).max())
  else:
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind,double", [("int8", False), ("nf4", False), ("nf4", True)])
def test_jit_and_scan_over_layers_dequantize_each_layer_as_the_whole(kind, double):
  w = _kernel((3, 64, 2, 16), 4).astype(jnp.bfloat16)  # scanned q: [N, D, H, K]
  qk = bq.quantize(jnp.asarray(w), 1, 1, kind, double=double, double_block=16)
  whole = np.asarray(qk.dequantize(jnp.float32))
  _assert_same_dequantized(jax.jit(lambda t: t[...].astype(jnp.float32))(qk), whole, double)
  assert qk[...] is qk and qk.astype(jnp.bfloat16).dtype == jnp.bfloat16

  def body(carry, layer):
    assert layer.shape == (64, 2, 16) and layer.lead == 0  # the lead dim is sliced off every child
    return carry + jnp.sum(layer.dequantize(jnp.float32)), layer.dequantize(jnp.float32)

  total, per_layer = jax.jit(lambda t: jax.lax.scan(body, jnp.float32(0), t))(qk)
  _assert_same_dequantized(per_layer, whole, double)
  np.testing.assert_allclose(float(total), whole.sum(), rtol=1e-5)
  _assert_same_dequantized(qk[1].dequantize(jnp.float32), whole[1], double)
  again = jax.jit(bq.quantize, static_argnums=(1, 2, 3), static_argnames=("double", "double_block"))(
      jnp.asarray(w), 1, 1, kind, double=double, double_block=16)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(qk)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_specs_shard_the_children_and_dequantize_unchanged():
  mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as meshlm's
  cases = [((2, 256, 512), 1, 1, P(None, "fsdp", "tensor")),  # scanned up [N, D, F]
           ((4, 64, 32), 0, 2, P("tensor", None, "fsdp"))]  # o [H, K, D]
  for shape, lead, n_in, spec in cases:
    w = jnp.asarray(_kernel(shape, 5))
    for kind, double in (("int8", False), ("nf4", False), ("nf4", True)):
      qk = bq.quantize(w, lead, n_in, kind, double=double)
      abstract = jax.eval_shape(lambda x, k=kind, d=double: bq.quantize(x, lead, n_in, k, double=d), w)
      sp = bq.specs(spec, abstract, lead, n_in)
      names = {("int8", 1): [spec, P(None, "tensor")], ("int8", 0): [spec, P("fsdp")],
               ("nf4", 1): [P(None, "fsdp", None, "tensor"), P(None, "fsdp", "tensor")],
               ("nf4", 0): [P("tensor", None, "fsdp"), P("tensor", "fsdp")]}[(kind, lead)]
      if double:  # the e4m3 constants take absmax's place
        names += [P(None, "fsdp", None) if lead else P("tensor", None), P(None) if lead else P()]
      assert list(jax.tree.leaves(sp)) == names, (shape, kind, double)
      placed = jax.device_put(qk, jax.tree.map(lambda s: NamedSharding(mesh, s), sp))
      got = jax.jit(lambda t: t.dequantize(jnp.float32), out_shardings=NamedSharding(mesh, spec))(placed)
      _assert_same_dequantized(got, qk.dequantize(jnp.float32), double)
      assert [c.sharding.spec for c in placed.children] == names
  assert bq.specs(P("fsdp"), w, 0, 2) == P("fsdp")  # kind "none": the kernel's own


def test_bad_kind_and_block_raise_naming_them():
  w = jnp.zeros((48, 16))
  with pytest.raises(ValueError, match=r"block=64.*48"):
    bq.quantize(w, 0, 1, "nf4")
  with pytest.raises(ValueError, match="block=7"):
    bq.quantize(jnp.zeros((14, 16)), 0, 1, "nf4", block=7)
  with pytest.raises(ValueError, match="kind='nf3'"):
    bq.quantize(w, 0, 1, "nf3")
  with pytest.raises(ValueError, match="kind='fp4'"):
    bq.nbytes_per_param("fp4")
  with pytest.raises(ValueError, match="double_block=0"):
    bq.quantize(jnp.zeros((64, 16)), 0, 1, "nf4", double=True, double_block=0)
  assert bq.quantize(w, 0, 1, "none") is w
