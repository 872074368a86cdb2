"""Mixtral parity with transformers (PyTorch): logits of random-weight models read by model.hf.load, the
load-balancing loss of one layer's router logits, the save round trip, and shape mismatches named by field."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.mixtral import modeling_mixtral

from model import hf
from model import moe
from test_hf import _hf_logits, _random_hf_model  # tests/ is on sys.path under pytest

TOL = 1e-4
SEQ = 24
V = 96


def _random_mixtral(seed, **overrides):
  return _random_hf_model("mixtral", seed, **{"intermediate_size": 40, "num_local_experts": 4,
                                             "num_experts_per_tok": 2, "rope_theta": 1e6, **overrides})


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, V, size=(2, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
  ref = _random_mixtral(seed=3)
  path = tmp_path_factory.mktemp("mixtral")
  ref.save_pretrained(path)
  return ref, path


@pytest.mark.parametrize("overrides", [{"moe_impl": "ragged"}, {"scan_layers": False}, {}],
                         ids=["scan_ragged", "unrolled", "auto_tiled"])
def test_mixtral_logits_match_transformers(mixtral_dir, tokens, overrides):
  ref, path = mixtral_dir
  model = hf.load(str(path), dtype="float32", **overrides)
  assert (model.cfg.num_experts, model.cfg.experts_per_token) == (4, 2)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), _hf_logits(ref, tokens), atol=TOL, rtol=0)


def test_mixtral_save_round_trips(mixtral_dir, tokens, tmp_path):
  ref, path = mixtral_dir
  model = hf.load(str(path), dtype="float32")
  hf.save(model, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref, tokens), atol=TOL, rtol=0)
  # Reloading the saved directory gives back every parameter exactly.
  again = hf.load(str(tmp_path), dtype="float32")
  np.testing.assert_array_equal(np.asarray(again.layers.moe.gate[...]), np.asarray(model.layers.moe.gate[...]))


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_equals_transformers_load_balancing_loss(masked):
  rng = np.random.default_rng(1)
  B, L, E, K = 3, 10, 6, 2
  logits_BLE = rng.normal(size=(B, L, E)).astype(np.float32) * 2
  valid_BL = np.ones((B, L), bool)
  if masked:
    valid_BL[0, 7:] = valid_BL[2, 4:] = False
  _, experts_BLK = moe.route(jnp.asarray(logits_BLE), K, "topk_softmax")
  keep = moe.keep_mask(experts_BLK, jnp.asarray(valid_BL), E, 0)
  got = moe.router_stats(jnp.asarray(logits_BLE), experts_BLK, keep, jnp.asarray(valid_BL))["moe_aux_loss"]
  want = modeling_mixtral.load_balancing_loss_func(
      (torch.tensor(logits_BLE.reshape(B * L, E)),), E, K,
      attention_mask=torch.tensor(valid_BL.astype(np.int64)) if masked else None)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_mixtral_config_round_trip_and_refusals():
  cfg = hf.config_from_hf(_random_mixtral(0).config.to_dict())
  assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim, cfg.moe_every) == (4, 2, 40, 1)
  assert hf.config_to_hf(cfg)["num_local_experts"] == 4
  cfg.capacity_factor = 1.25  # a capacity limit changes the function: Mixtral has none
  with pytest.raises(ValueError, match="capacity_factor"):
    hf.config_to_hf(cfg)
  with pytest.raises(ValueError, match="router_jitter_noise"):
    hf.config_from_hf({**_random_mixtral(0).config.to_dict(), "router_jitter_noise": 0.1})


def test_shape_mismatch_names_config_fields(mixtral_dir, tmp_path):
  _, path = mixtral_dir
  cfg = hf.config_from_hf(json.loads((path / "config.json").read_text()))
  cfg.update(d_model=64, num_experts=8)
  with pytest.raises(ValueError, match=r"model\.d_model \(hidden_size\): 64 vs 48.*model\.num_experts "
                                       r"\(num_local_experts\): 8 vs 4"):
    hf.check_compatible(cfg, str(path))
  hf.check_compatible(hf.config_from_hf(json.loads((path / "config.json").read_text())), str(path))
  # Weights that disagree with their own config.json: the error names the tensor and the config fields.
  for f in path.iterdir():
    (tmp_path / f.name).write_bytes(f.read_bytes())
  conf = json.loads((path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**conf, "intermediate_size": 32}))
  with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight.*\[40, 48\].*\[32, 48\].*intermediate_size=32"):
    hf.load(str(tmp_path))


def test_greedy_generation_equals_transformers_generate(mixtral_dir):
  """Prompts of different lengths (left-padded in one batch by model.generate) decode token for token as
  transformers' greedy `generate` decodes each prompt alone."""
  from model import generate
  ref, path = mixtral_dir
  model = hf.load(str(path), dtype="float32")
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, V, size=n).tolist() for n in (5, 11)]
  got = generate.generate(model, prompts, max_new_tokens=8)
  for prompt, tokens in zip(prompts, got):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    assert tokens == out[0, len(prompt):].tolist()
