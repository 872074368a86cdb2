"""Hugging Face families beyond Llama (Qwen2/2.5, Qwen3, Gemma 2, Gemma 3, OLMo 2; Llama 3.1's RoPE) as
configuration of the one transformer: random-weight transformers models (float32, eager attention) give the same
logits through `model.hf.load` (max |diff| <= 1e-5), `model.hf.save` round-trips through transformers'
`from_pretrained` into the family's own class, greedy `model.generate` equals transformers' `generate`, Gemma 3's
multimodal checkpoints load their text decoder, and config.json fields meshlm cannot follow are refused by name.

Each case's transformers model, its directory and the loaded meshlm model are built once per module (`built`).
"""
import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from model import config as config_lib
from model import generate as gen
from model import hf

TOL = 1e-5
SEQ = 24  # longer than every window below and than the dynamic case's max_position_embeddings
VOCAB = 128
SCALE = 0.12  # weight std: logits of a few units, where float32 rounding stays well under TOL
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
_FULL = {"layer_types": ("full",)}  # every layer global: the windows dropped

# case -> (transformers config class, overrides of BASE, meshlm keys the mapping must give, meshlm overrides each
# of which must change the logits: the feature the case tests acts at this size)
CASES = {
    # Qwen2: q/k/v biases; layers from max_window_layers on slide (use_sliding_window), window < SEQ; GQA, untied.
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
                     dict(qkv_bias=True, sliding_window=5, layer_types=("full", "sliding", "sliding")), [_FULL]),
    # Qwen2.5's YaRN (factor 4 over an original 32 tokens), MQA, tied embeddings.
    "qwen2_yarn_mqa_tied": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                rope_parameters=_YARN),
                            dict(rope_scaling="yarn", rope_original_max_len=32, num_kv_heads=1, tie_embeddings=True),
                            [{"rope_scaling": "none"}]),
    # Qwen3: per-head q/k RMSNorm; head_dim 32 != hidden / heads; GQA; layer_types given explicitly.
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1e6, use_sliding_window=True, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
              dict(qk_norm="head", head_dim=32, layer_types=("sliding", "full", "sliding")), [_FULL]),
    # Qwen3 with dynamic NTK RoPE past max_position_embeddings, MQA, tied.
    "qwen3_dynamic_mqa_tied": ("Qwen3Config", dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=True,
                                                   max_position_embeddings=16,
                                                   rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                    "rope_theta": 10000.0}),
                               dict(rope_scaling="dynamic", rope_original_max_len=16), [{"rope_scaling": "none"}]),
    # Gemma 2: both softcaps (low enough to act), query_pre_attn_scalar != head_dim, alternating sliding (window <
    # SEQ) / full layers, (1 + w) norms, scaled embedding, tied.
    "gemma2_softcap": ("Gemma2Config", dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24,
                                            sliding_window=6, attn_logit_softcapping=1.0,
                                            final_logit_softcapping=2.0),
                       dict(norm_position="sandwich", attn_logit_softcap=1.0, final_logit_softcap=2.0,
                            layer_types=("sliding", "full"), query_pre_attn_scalar=24.0),
                       [{"attn_logit_softcap": 0.0}, {"final_logit_softcap": 0.0}, {"query_pre_attn_scalar": 0.0},
                        _FULL]),
    # Gemma 2 with transformers' default softcaps (50 / 30), MQA, untied, linear RoPE scaling.
    "gemma2_mqa_untied": ("Gemma2Config", dict(num_hidden_layers=2, head_dim=16, num_key_value_heads=1,
                                               tie_word_embeddings=False, query_pre_attn_scalar=16,
                                               rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 10000.0}),
                          dict(attn_logit_softcap=50.0, final_logit_softcap=30.0, rope_scaling="linear"),
                          [{"rope_scaling": "none"}]),
    # Gemma 3: q/k norms, RoPE per layer type (full: 1e6 with linear scaling, sliding: 1e4), 3 sliding : 1 full.
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}),
               dict(qk_norm="head", rope_local_theta=1e4, rope_theta=1e6, rope_scaling="linear",
                    layer_types=("sliding", "sliding", "sliding", "full")),
               [{"rope_local_theta": 0.0}, {"rope_scaling": "none"}, _FULL]),
    # Gemma 3 from sliding_window_pattern alone (3 layers, pattern 2: sliding, full, sliding), final softcap, MQA.
    "gemma3_pattern_mqa": ("Gemma3TextConfig", dict(head_dim=16, num_key_value_heads=1, query_pre_attn_scalar=16,
                                                    sliding_window=4, sliding_window_pattern=2,
                                                    final_logit_softcapping=2.0),
                           dict(layer_types=("sliding", "full", "sliding"), final_logit_softcap=2.0),
                           [{"final_logit_softcap": 0.0}, _FULL]),
    # OLMo 2: post-norms only, q/k RMSNorm over the whole projection; GQA, untied (the layout shows in the weights).
    "olmo2": ("Olmo2Config", dict(rope_theta=500000.0), dict(norm_position="post", qk_norm="proj"), []),
    "olmo2_mqa_tied": ("Olmo2Config", dict(num_key_value_heads=1, tie_word_embeddings=True), dict(qk_norm="proj"),
                       []),
    # Llama 3.1: llama3 RoPE with a short original context so that all three frequency bands occur.
    "llama31": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32}),
                dict(rope_scaling="llama3", rope_original_max_len=32), [{"rope_scaling": "none"}]),
}
MODEL_TYPES = {"Qwen2Config": "qwen2", "Qwen3Config": "qwen3", "Gemma2Config": "gemma2",
               "Gemma3TextConfig": "gemma3_text", "Olmo2Config": "olmo2", "LlamaConfig": "llama"}
GENERATE = ["qwen2_window", "qwen3", "gemma2_softcap", "gemma3", "olmo2", "llama31"]  # one case per family


def _randomize(model, offset_norms):
  """Random weights, norms included (a swapped or missing norm must show); Gemma's norms are offsets from 1."""
  torch.manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if offset_norms else 1.0) + 0.1 * torch.randn_like(p))
      else:
        p.copy_(SCALE * torch.randn_like(p))
  return model.float().eval()


def _reference(case):
  cls, overrides, _, _ = CASES[case]
  config = getattr(transformers, cls)(**{**BASE, **overrides})
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  return _randomize(model, cls.startswith("Gemma"))


def _logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def _diff(model, tokens, want):
  return float(np.abs(np.asarray(model(jnp.asarray(tokens))) - want).max())


@pytest.fixture(scope="module")
def tokens():
  return np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """case -> (transformers model, its directory, meshlm model loaded from it), each built once."""
  cache = {}

  def get(case):
    if case not in cache:
      ref = _reference(case)
      path = tmp_path_factory.mktemp(case) / "hf"
      ref.save_pretrained(path)
      cache[case] = ref, path, hf.load(str(path), dtype="float32")
    return cache[case]
  return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_matches_transformers_and_save_round_trips(case, built, tokens, tmp_path):
  ref, path, model = built(case)
  for key, want in CASES[case][2].items():
    assert model.cfg[key] == want, key
  want = _logits(ref, tokens)
  diff = _diff(model, tokens, want)
  print(f"{case}: max |diff| {diff:.2e} (logits up to {np.abs(want).max():.1f})")
  assert diff <= TOL
  for override in CASES[case][3]:  # the tested feature acts: without it the logits differ
    assert _diff(hf.load(str(path), **override), tokens, want) > 1e-3, override

  dst = tmp_path / "saved"
  hf.save(model, str(dst))
  written = json.loads((dst / "config.json").read_text())
  assert written["model_type"] == MODEL_TYPES[CASES[case][0]]
  assert hf.config_from_hf(written) == config_lib.validate(model.cfg)  # config.json holds the whole function
  back = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").float().eval()
  assert type(back).__name__ == written["architectures"][0] == type(ref).__name__
  assert np.abs(_logits(back, tokens) - want).max() <= TOL


@pytest.mark.parametrize("case", ["qwen2_window", "olmo2"])
def test_sharded_load_and_save_of_flattened_tensors(case, built, tmp_path):
  """Qwen2's [H*K] biases and OLMo 2's [H*K] / [G*K] q/k norms read block by block with head_dim split over the
  tensor axis (a device's entries are not contiguous), and written back from the sharded model in several files."""
  import parallel  # pylint: disable=g-import-not-at-top
  from test_hf_sharded import LAYOUTS, _mesh  # pylint: disable=g-import-not-at-top
  ref, path, unsharded = built(case)
  tokens = np.random.default_rng(2).integers(0, VOCAB, size=(8, 16)).astype(np.int32)  # a row per device
  want = _logits(ref, tokens)
  mesh, rules = _mesh(*LAYOUTS["head_dim_split"], model_cfg=unsharded.cfg)
  with parallel.activate(mesh, rules):
    model = hf.load(str(path), progress=False)
    assert _diff(model, tokens, want) <= TOL
    for name in ("q_bias", "k_bias") if case.startswith("qwen2") else ("q_norm/scale", "k_norm/scale"):
      x = functools.reduce(getattr, name.split("/"), model.layers.attn).get_value()  # [layers, heads, head_dim]
      full = np.asarray(functools.reduce(getattr, name.split("/"), unsharded.layers.attn).get_value())
      assert x.addressable_shards[0].data.shape[-1] == 4  # head_dim 16 split 4 ways
      for shard in x.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])
    hf.save(model, str(tmp_path / "saved"), max_shard_size="40KB", progress=False)
  assert (tmp_path / "saved" / "model.safetensors.index.json").exists()
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager")
  assert np.abs(_logits(back.float().eval(), tokens) - want).max() <= TOL


PROMPTS = [[5, 17, 30], [7, 1, 8, 3, 3, 4, 10, 11, 12, 60, 61], [40, 2, 9, 90, 33, 12]]
NEW = 10


@pytest.mark.parametrize("case", GENERATE)
def test_greedy_generate_equals_transformers(case, built):
  ref, _, model = built(case)
  ours = gen.generate(model, PROMPTS, NEW, stop_ids=(2,))
  for prompt, got in zip(PROMPTS, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, eos_token_id=2, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    if 2 in want:  # transformers pads a finished single row no further; cut after its EOS as meshlm does
      want = want[:want.index(2) + 1]
    assert got == want
  assert sum(len(t) for t in ours) > 2 * NEW  # long continuations are compared, not only early stops


def _multimodal_gemma3(tmp_path):
  """A tiny Gemma3ForConditionalGeneration (SigLIP tower + Gemma 3 decoder) saved as transformers 5 saves it."""
  text = {**BASE, "num_hidden_layers": 2, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 5,
          "sliding_window_pattern": 2}
  vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                patch_size=16)
  config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                     eoi_token_index=VOCAB - 2)
  ref = transformers.Gemma3ForConditionalGeneration(config)
  ref.config._attn_implementation = "eager"  # pylint: disable=protected-access
  ref = _randomize(ref, offset_norms=True)
  ref.save_pretrained(tmp_path)
  return ref


def test_gemma3_multimodal_checkpoint_loads_its_text_decoder(tokens, tmp_path):
  ref = _multimodal_gemma3(tmp_path / "new")
  want = _logits(ref, tokens)
  model = hf.load(str(tmp_path / "new"))
  assert (model.cfg.qk_norm, model.cfg.layer_types, model.cfg.tie_embeddings) == ("head", ("sliding", "full"), True)
  assert _diff(model, tokens, want) <= TOL
  # transformers 4.52-4.57's layout of the same checkpoint (module names: model.language_model.*, and a stored
  # tied head); transformers 5 writes the Hub's language_model.model.*, as above.
  import safetensors.numpy  # pylint: disable=g-import-not-at-top
  weights = safetensors.numpy.load_file(str(tmp_path / "new" / "model.safetensors"))
  assert "language_model.model.embed_tokens.weight" in weights
  renamed = {("model." + k).replace("model.language_model.model.", "model.language_model."): v
             for k, v in weights.items()}
  renamed["lm_head.weight"] = weights["language_model.model.embed_tokens.weight"]
  old = tmp_path / "old"
  old.mkdir()
  safetensors.numpy.save_file(renamed, str(old / "model.safetensors"))
  (old / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
  assert _diff(hf.load(str(old)), tokens, want) <= TOL
  # Saved back: a text-only Gemma3ForCausalLM with the same logits.
  hf.save(model, str(tmp_path / "text"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager")
  assert type(back).__name__ == "Gemma3ForCausalLM"
  assert np.abs(_logits(back.float().eval(), tokens) - want).max() <= TOL


def _hf_config(cls, **fields):
  return {**getattr(transformers, cls)(**{**BASE, **fields}).to_dict()}


def test_config_fields_map_as_transformers_reads_them():
  # Qwen2 of transformers 4.x: no layer_types, the window from use_sliding_window + max_window_layers.
  qwen = _hf_config("Qwen2Config", num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                    max_window_layers=2)
  del qwen["layer_types"]
  cfg = hf.config_from_hf(qwen)
  assert (cfg.sliding_window, cfg.layer_types, cfg.qkv_bias) == (64, ("full", "full", "sliding", "sliding"), True)
  assert hf.config_from_hf({**qwen, "use_sliding_window": False}).sliding_window == 0  # the window is dropped
  # Gemma 3 of transformers 4.x: rope_theta / rope_local_base_freq / rope_scaling, the pattern as
  # _sliding_window_pattern, a sparse nested text_config (transformers' defaults for what it omits).
  legacy = {"model_type": "gemma3", "text_config": {
      "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6,
      "vocab_size": VOCAB, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "_sliding_window_pattern": 3,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 16}}
  cfg = hf.config_from_hf(legacy)
  assert cfg.layer_types == ("sliding", "sliding", "full") and cfg.tie_embeddings
  assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling, cfg.rope_scaling_factor) == (1e6, 1e4, "linear", 8.0)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.query_pre_attn_scalar) == (8, 4, 256, 256.0)
  # YaRN's attention factor from DeepSeek's mscale fields; a 4.x rope_scaling with "type".
  yarn = hf.config_from_hf({**_hf_config("Qwen2Config"), "rope_scaling": {
      "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 2.0, "mscale_all_dim": 1.0}})
  assert yarn.rope_scaling == "yarn" and yarn.rope_attention_factor == pytest.approx(
      (0.2 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1))
  # Written back: Qwen's window in both forms (layer_types, and 4.x's max_window_layers where it fits).
  back = hf.config_to_hf(hf.config_from_hf(qwen))
  assert (back["model_type"], back["architectures"], back["use_sliding_window"], back["max_window_layers"]) == (
      "qwen2", ["Qwen2ForCausalLM"], True, 2)


@pytest.mark.parametrize("field,value,model_type", [
    ("rope_parameters.rope_type", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "Qwen2Config"),
    ("rope_parameters.sliding_attention.rope_type",
     {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "Gemma3TextConfig"),
    ("rope_parameters", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "Gemma3TextConfig"),
    ("use_bidirectional_attention", {"use_bidirectional_attention": True}, "Gemma3TextConfig"),
    ("attn_logit_softcapping", {"attn_logit_softcapping": 50.0}, "Gemma3TextConfig"),
    ("attention_bias", {"attention_bias": True}, "Qwen3Config"),
    ("attention_bias", {"attention_bias": True}, "Olmo2Config"),
    ("attention_dropout", {"attention_dropout": 0.1}, "Gemma2Config"),
    ("hidden_activation", {"hidden_activation": "gelu"}, "Gemma2Config"),
    ("sliding_window", {"use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"] * 2},
     "Qwen3Config"),
    ("layer_types", {"layer_types": ["chunked_attention"] * 4}, "Gemma2Config"),
    ("partial_rotary_factor", {"partial_rotary_factor": 0.5}, "Olmo2Config"),
    ("text_config.model_type", {"model_type": "gemma3", "text_config": {"model_type": "llama"}}, "Gemma3TextConfig"),
])
def test_fields_meshlm_cannot_follow_are_refused_by_name(field, value, model_type):
  config = {**_hf_config(model_type, num_hidden_layers=4), **value}
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    hf.config_from_hf(config)


@pytest.mark.parametrize("keys,needle", [
    ({"qkv_bias": True, "qk_norm": "head"}, "no Hugging Face family"),
    ({"sliding_window": 4, "layer_types": ("sliding", "full")}, "model.sliding_window=4"),
    ({"attn_logit_softcap": 30.0}, "model.attn_logit_softcap"),
    ({"qk_norm": "head", "sliding_window": 4, "layer_types": ("sliding", "full"), "rope_local_theta": 1e4},
     "model.rope_local_theta"),
    ({"qk_norm": "proj", "norm_position": "post", "sliding_window": 4}, "Hugging Face olmo2"),
    ({"rope_scaling": "dynamic", "rope_original_max_len": 64}, "model.rope_original_max_len"),
])
def test_models_no_family_holds_are_refused_on_save(keys, needle):
  cfg = hf.config_from_hf(_hf_config("LlamaConfig", num_hidden_layers=2))
  cfg.update(keys)
  with pytest.raises(ValueError, match=needle):
    hf.config_to_hf(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen2_window", "qwen3", "gemma2_softcap", "gemma3", "olmo2"])
def test_sft_from_a_family_directory_exports_a_directory_transformers_loads(case, tmp_path):
  """`python -m train --config=sft_tiny --config.train.init_from=DIR` on a family's directory (its tokenizer.json
  and chat template included), then `python -m train.export`: transformers loads the family's class with the
  trained run's logits, and the tokenizer with its chat template."""
  from chat_testing import CHATS, hf_tokenizer_dir  # pylint: disable=g-import-not-at-top
  from train import __main__ as train_main  # pylint: disable=g-import-not-at-top
  from train.rundir import export  # pylint: disable=g-import-not-at-top
  from train.rundir import restore  # pylint: disable=g-import-not-at-top
  directory = hf_tokenizer_dir(tmp_path)  # a BPE tokenizer.json (< 400 tokens) with a Llama-3-style template
  cls, overrides, _, _ = CASES[case]
  config = getattr(transformers, cls)(**{**BASE, **overrides, "vocab_size": 400})
  start = _randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"),
                     cls.startswith("Gemma"))
  start.save_pretrained(directory)
  chats = tmp_path / "chats.jsonl"
  chats.write_text("".join(json.dumps(c) + "\n" for c in CHATS * 8))
  workdir, out = tmp_path / "run", tmp_path / "exported"
  argv = [f"--workdir={workdir}", "--config=sft_tiny", f"--config.train.init_from={directory}",
          f"--config.data.sources=chat:{chats}", "--config.data.chat_template=auto", "--config.train.steps=2",
          "--config.train.seq_len=64", "--config.train.batch_size=8", "--config.train.eval_every=0",
          "--config.train.eval_generations=0",
          "--config.train.warmup_steps=1", "--config.checkpoint.every=2", "--config.log.progress=False",
          "--config.log.tensorboard=False"]
  assert train_main.main(argv) == 0
  assert export.main(["--workdir", str(workdir), "--output", str(out)]) == 0

  assert json.loads((out / "config.json").read_text())["model_type"] == MODEL_TYPES[cls]
  back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
  assert type(back) is type(start)
  tokens = np.random.default_rng(1).integers(3, 300, size=(2, SEQ))
  trained = restore.load_run(str(workdir)).model
  assert np.abs(_logits(back, tokens) - np.asarray(trained(jnp.asarray(tokens)))).max() <= TOL
  assert np.abs(_logits(back, tokens) - _logits(start, tokens)).max() > 1e-3  # it trained
  theirs = transformers.AutoTokenizer.from_pretrained(directory)
  ours = transformers.AutoTokenizer.from_pretrained(out)
  assert ours.chat_template == theirs.chat_template
  assert ours("Sort the digits: 3 1 2")["input_ids"] == theirs("Sort the digits: 3 1 2")["input_ids"]
