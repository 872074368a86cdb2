"""Hugging Face parity: model.hf.load gives transformers' (PyTorch) logits; save round-trips through transformers."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from model import hf

TOL = 1e-4
SEQ = 24


def _random_hf_model(model_type, seed, **overrides):
  base = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
  base.update(overrides)
  config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                "mixtral": transformers.MixtralConfig}[model_type]
  config = config_cls(**base)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Random norm weights too, so a swapped or missing norm cannot go unnoticed.
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


CASES = {
    # GQA, rope_theta != 10000, untied.
    "llama_gqa": ("llama", dict(rope_theta=500000.0)),
    # MQA, tied embeddings, head_dim independent of hidden/heads, unrolled layers on the meshlm side.
    "llama_mqa_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, head_dim=16)),
    # Llama-3.1 rope scaling with a short original context so all three frequency bands occur.
    "llama3_scaling": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    # Mistral with a window shorter than the sequence.
    "mistral_window": ("mistral", dict(sliding_window=7)),
}


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, 96, size=(2, SEQ)).astype(np.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_matches_transformers_and_save_round_trips(case, tokens, tmp_path):
  model_type, overrides = CASES[case]
  ref = _random_hf_model(model_type, seed=len(case), **overrides)
  src = tmp_path / "hf"
  # One case is written in several shards (model.safetensors.index.json), as large checkpoints are.
  ref.save_pretrained(src, max_shard_size="40KB" if case == "llama_gqa" else "1GB")
  assert (src / "model.safetensors.index.json").exists() == (case == "llama_gqa")
  kwargs = {"scan_layers": False} if case == "llama_mqa_tied" else {}
  model = hf.load(str(src), dtype="float32", **kwargs)
  want = _hf_logits(ref, tokens)
  got = np.asarray(model(jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  if case == "llama3_scaling":
    assert (model.cfg.rope_scaling, model.cfg.rope_original_max_len) == ("llama3", 64)
  if case == "llama_gqa":
    assert (model.cfg.rope_theta, model.cfg.num_kv_heads) == (500000.0, 2)
  if case == "mistral_window":
    assert model.cfg.sliding_window == 7
    full = _random_hf_model("mistral", seed=len(case), **{**overrides, "sliding_window": None})
    # The window matters at this length: without it the logits differ (the test would catch a dropped window).
    assert np.abs(_hf_logits(full, tokens) - want).max() > 1e-3

  dst = tmp_path / "saved"
  hf.save(model, str(dst))
  back = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").float().eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), want, atol=TOL, rtol=0)


def test_config_fields_map(tmp_path):
  cfg = hf.config_from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
                           "num_hidden_layers": 3, "num_attention_heads": 2, "rms_norm_eps": 1e-6,
                           "max_position_embeddings": 77, "rope_theta": 1234.0, "tie_word_embeddings": True})
  assert (cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 12, 3, 2, 2, 4)
  assert (cfg.norm_eps, cfg.max_seq_len, cfg.rope_theta, cfg.tie_embeddings) == (1e-6, 77, 1234.0, True)
  back = hf.config_to_hf(cfg)
  assert back["rope_parameters"]["rope_theta"] == 1234.0 and back["num_key_value_heads"] == 2


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True), ("mlp_bias", True), ("hidden_act", "relu"), ("model_type", "gpt2"),
    ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}), ("attention_dropout", 0.1)])
def test_unsupported_fields_are_refused(field, value):
  hf_cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
            "num_hidden_layers": 1, "num_attention_heads": 2, field: value}
  with pytest.raises(ValueError, match=field):
    hf.config_from_hf(hf_cfg)
