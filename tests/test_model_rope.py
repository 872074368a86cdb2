"""RoPE: relative-position property and frequencies equal to transformers' (default and llama3 scaling)."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from configs import base
from model import rope


def _cfg(**kw):
  cfg = base.get_config().model
  cfg.update(**{"head_dim": 16, **kw})
  return cfg


@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_qk_depends_only_on_relative_position(scaling):
  cfg = _cfg(rope_scaling=scaling, rope_original_max_len=32, rope_theta=1000.0)
  inv = rope.inv_frequencies(cfg)
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 16)).astype(np.float32)

  def rotated(x, pos):
    cos, sin = rope.cos_sin(jnp.array([[pos]]), inv)
    return np.asarray(rope.apply(jnp.asarray(x)[None, None, None], cos, sin))[0, 0, 0].astype(np.float64)

  def score(m, n):
    return rotated(q, m) @ rotated(k, n)

  for m, n in [(5, 2), (9, 9), (3, 40)]:
    for shift in (1, 17, 200):
      assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
  assert abs(score(5, 2) - score(6, 2)) > 1e-3  # and it does depend on the offset


@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_frequencies_equal_transformers(scaling):
  cfg = _cfg(rope_scaling=scaling, rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
             rope_high_freq_factor=4.0, rope_original_max_len=8192, head_dim=128)
  params = {"rope_type": "default" if scaling == "none" else "llama3", "rope_theta": 500000.0}
  if scaling == "llama3":
    params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
  hf_cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                    max_position_embeddings=131072, rope_parameters=params)
  if scaling == "none":
    want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
  else:
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
  np.testing.assert_allclose(rope.inv_frequencies(cfg), want.numpy(), rtol=1e-6)
