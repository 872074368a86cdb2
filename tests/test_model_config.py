"""Bad model configurations fail at construction with a message naming the key; counts and FLOPs."""
import re

import jax
import numpy as np
import pytest
from flax import nnx

import model
from configs import base
from model import counting
import configs

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48)


def make_cfg(**overrides):
  cfg = base.get_config().model
  cfg.update(**{**TINY, **overrides})
  return cfg


@pytest.mark.parametrize("overrides,needle", [
    (dict(num_kv_heads=3), "model.num_kv_heads=3 must divide model.num_heads=4"),
    (dict(sliding_window=-1), "model.sliding_window=-1"),
    (dict(head_dim=7), "model.head_dim=7"),
    (dict(mlp_type="tanh"), "model.mlp_type='tanh'"),
    (dict(mlp_type="relu", num_experts=4, experts_per_token=2), "model.mlp_type='relu' with model.num_experts > 0"),
    (dict(norm_type="batchnorm"), "model.norm_type"),
    (dict(attention_impl="flash"), "model.attention_impl"),
    (dict(dtype="float8"), "model.dtype"),
    (dict(num_layers=0), "model.num_layers=0"),
    (dict(global_every=-2), "model.global_every=-2"),
    (dict(rope_scaling="longrope"), "model.rope_scaling"),
])
def test_bad_config_fails_at_construction_naming_the_key(overrides, needle):
  with pytest.raises(ValueError, match=re.escape(needle)):
    model.Transformer(make_cfg(**overrides), rngs=nnx.Rngs(0))


def test_unknown_model_key_is_rejected():
  cfg = dict(make_cfg())
  cfg["num_head"] = 4
  with pytest.raises(ValueError, match="model.num_head"):
    model.Transformer(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(configs.ConfigError, match="num_head"):
    configs.load("tiny", **{"model.num_head": 4})


def test_unknown_remat_policy_is_rejected():
  with pytest.raises(ValueError, match="remat='everything'"):
    model.Transformer(make_cfg(), rngs=nnx.Rngs(0), remat="everything")


# Published parameter counts (Hugging Face model cards / safetensors totals).
PUBLISHED = {"llama2_7b": 6_738_415_616, "llama2_70b": 68_976_648_192, "llama3_8b": 8_030_261_248,
             "mistral_7b": 7_241_732_096}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_counts_equal_published(preset):
  assert model.count_params(configs.load(preset).model)["total"] == PUBLISHED[preset]


def test_scaling_family_sizes():
  sizes = {p: model.count_params(configs.load(p).model)["total"] for p in ("meshlm_125m", "meshlm_350m", "meshlm_1b")}
  assert 115e6 < sizes["meshlm_125m"] < 135e6 and 320e6 < sizes["meshlm_350m"] < 380e6
  assert 0.95e9 < sizes["meshlm_1b"] < 1.1e9


@pytest.mark.parametrize("tied", [False, True])
def test_count_params_matches_allocated_model_and_formula(tied):
  cfg = make_cfg(tie_embeddings=tied, use_bias=True)
  m = model.Transformer(cfg, rngs=nnx.Rngs(0))
  allocated = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  V, D, H, G, K, F, N = 64, 32, 4, 2, 8, 48, 2
  per_layer = D * H * K * 2 + D * G * K * 2 + 3 * D * F + 2 * D  # q, o, k, v, mlp, two norm scales
  per_layer += H * K + 2 * G * K + D + 2 * F + D + 2 * D  # biases: q, k, v, o, gate, up, down, two norm biases
  embeddings = V * D * (1 if tied else 2)
  counts = model.count_params(cfg)
  assert counts["total"] == allocated == N * per_layer + embeddings + 2 * D  # + final norm scale and bias
  assert counts["non_embedding"] == counts["total"] - embeddings


def _visible_keys_per_query(window, T):
  """Brute force: mean over queries of the keys a causal (windowed) mask lets each query see."""
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  mask = (j <= i) & ((window == 0) | (i - j < window))
  return mask.sum() / T


@pytest.mark.parametrize("window,global_every", [(0, 0), (64, 0), (64, 3), (4096, 0)])
def test_flops_per_token(window, global_every):
  T = 1024
  cfg = make_cfg(num_layers=6, sliding_window=window, global_every=global_every)
  n = model.count_params(cfg)["non_embedding"]
  windows = [0 if window == 0 or (global_every and (i + 1) % global_every == 0) else window for i in range(6)]
  # The brute-force count includes the diagonal; the documented continuous form omits half a key per window:
  # (1/T) sum_i min(i + 1, w) = w - w^2 / (2T) + w / (2T).
  attended = sum(_visible_keys_per_query(w, T) - min(w or T, T) / (2 * T) for w in windows)
  want = 6 * (n + 32 * 64) + 12 * 4 * 8 * attended
  assert model.flops_per_token(cfg, T) == pytest.approx(want, rel=1e-12)
  if window == 0:  # the documented full-causal special case: 6 * layers * H * K * T
    assert model.flops_per_token(cfg, T) - 6 * (n + 32 * 64) == pytest.approx(6 * 6 * 4 * 8 * T)


def test_counting_allocates_nothing():
  before = len(jax.live_arrays())
  model.count_params(configs.load("llama2_70b").model)
  assert len(jax.live_arrays()) == before
