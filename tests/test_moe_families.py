"""DeepSeek-V3 and Qwen3-MoE parity with transformers (PyTorch): logits of random-weight models read by
model.hf.load (MLA with and without q LoRA, interleaved RoPE, YaRN's mscale, sigmoid routing with its score bias,
group-limited routing, shared experts, the first layers dense), the save round trip, greedy generation through
MLA's latent cache against transformers' generate, and the routing rule against a per-token NumPy reference."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from model import config as config_lib
from model import generate as gen
from model import hf
from model import kv_cache
from model import moe

TOL = 1e-5
V = 96
TOKENS = np.random.default_rng(0).integers(0, V, size=(2, 20)).astype(np.int32)
_MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=128, num_experts_per_tok=2)
CASES = {
    # q LoRA, interleaved RoPE, YaRN with mscale != mscale_all_dim, 4 groups of 2 experts (2 chosen), 1 shared.
    "deepseek_v3_qlora_groups_yarn": (transformers.DeepseekV3Config, dict(
        _MOE, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=12, q_lora_rank=10, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=4,
        topk_group=2, first_k_dense_replace=1, rope_interleave=True, num_mtp_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 16})),
    # one full q projection, RoPE in halves, no groups, no shared expert, v wider than q/k.
    "deepseek_v3_plain": (transformers.DeepseekV3Config, dict(
        _MOE, num_key_value_heads=4, n_shared_experts=0, n_routed_experts=4, routed_scaling_factor=1.0,
        kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, v_head_dim=16, qk_nope_head_dim=6, n_group=1,
        topk_group=1, first_k_dense_replace=2, rope_interleave=False, norm_topk_prob=False, num_mtp_layers=0)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        _MOE, num_key_value_heads=2, head_dim=8, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0])),
}


def _random(case, seed=0):
  config_cls, fields = CASES[case]
  torch.manual_seed(seed)
  ref = transformers.AutoModelForCausalLM.from_config(config_cls(**fields), attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in ref.named_parameters():  # random norms too, so a swapped or missing norm cannot pass
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    for name, b in ref.named_buffers():
      if "e_score_correction_bias" in name:  # a bias that changes which experts are chosen
        b.copy_(0.3 * torch.randn_like(b))
  return ref


def _logits(ref, tokens):
  with torch.no_grad():
    return ref(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  cache = {}

  def get(case):
    if case not in cache:
      ref = _random(case)
      path = tmp_path_factory.mktemp(case)
      ref.save_pretrained(path)
      cache[case] = (ref, path)
    return cache[case]
  return get


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_logits_match_transformers(built, case, scan):
  ref, path = built(case)
  model = hf.load(str(path), dtype="float32", scan_layers=scan)
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), _logits(ref, TOKENS), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_save_round_trips(built, case, tmp_path):
  ref, path = built(case)
  model = hf.load(str(path), dtype="float32")
  hf.save(model, str(tmp_path))
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["architectures"] == [type(ref).__name__]
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
  np.testing.assert_allclose(_logits(back, TOKENS), _logits(ref, TOKENS), atol=TOL, rtol=0)
  again = hf.load(str(tmp_path), dtype="float32")
  assert again.cfg == model.cfg
  if case.startswith("deepseek"):
    np.testing.assert_array_equal(np.asarray(again.layers.moe.score_bias[...]),
                                  np.asarray(model.layers.moe.score_bias[...]))


PROMPTS = [[5, 17, 30], [7, 1, 8, 3, 3, 4, 10, 11, 12, 60, 61], [40, 2, 9, 90, 33, 12]]


@pytest.mark.parametrize("case", ["deepseek_v3_qlora_groups_yarn", "deepseek_v3_plain", "qwen3_moe"])
def test_greedy_generate_equals_transformers(built, case):
  ref, path = built(case)
  model = hf.load(str(path), dtype="float32")
  ours = gen.generate(model, PROMPTS, 10)
  for prompt, got in zip(PROMPTS, ours):
    with torch.no_grad():
      out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_mla_cache_holds_the_latent_and_rope_key(built):
  _, path = built("deepseek_v3_qlora_groups_yarn")
  model = hf.load(str(path), dtype="float32")
  cache = kv_cache.zeros(model.cfg, jnp.zeros((2,), jnp.int32), 24)
  assert cache.k.shape == (3, 2, 24, 1, 12) and cache.v.shape == (3, 2, 24, 1, 4)  # kv_lora_rank, qk_rope_head_dim
  assert kv_cache.bytes_per_token(model.cfg) == (12 + 4) * 4
  # A prompt prefilled in two chunks (the second through the absorbed path) gives the logits of one pass.
  x_full, _ = model.features(jnp.asarray(TOKENS), cache=cache)
  x_a, c = model.features(jnp.asarray(TOKENS[:, :9]), cache=cache)
  x_b, _ = model.features(jnp.asarray(TOKENS[:, 9:]), cache=c._replace(index=jnp.asarray(c.index)))
  np.testing.assert_allclose(np.asarray(model.logits(x_b)), np.asarray(model.logits(x_full[:, 9:])), atol=TOL)


def _route_reference(logits, bias, k, groups, topk_groups, norm, scale):
  """DeepSeek-V3's routing for one token at a time, written from the paper's description with NumPy."""
  E = logits.shape[-1]
  out_w, out_e = [], []
  for row in logits.reshape(-1, E):
    s = 1.0 / (1.0 + np.exp(-row.astype(np.float64)))
    choice = s + bias
    size = E // groups
    rank = [np.sort(choice[g * size:(g + 1) * size])[-2:].sum() for g in range(groups)]
    allowed = set(np.argsort(rank)[::-1][:topk_groups].tolist())
    candidates = [e for e in range(E) if e // size in allowed]
    chosen = sorted(candidates, key=lambda e: -choice[e])[:k]
    w = s[chosen]
    w = w / w.sum() if norm else w
    out_w.append(w * scale)
    out_e.append(chosen)
  return np.array(out_w), np.array(out_e)


@pytest.mark.parametrize("groups,topk_groups,norm", [(1, 1, True), (4, 2, True), (8, 3, False)])
def test_sigmoid_group_limited_routing_equals_reference(groups, topk_groups, norm):
  rng = np.random.default_rng(groups)
  logits = rng.normal(size=(3, 7, 16)).astype(np.float32)
  bias = (rng.normal(size=16) * 0.5).astype(np.float32)
  w, e = moe.route(jnp.asarray(logits), 4, "sigmoid", jnp.asarray(bias), groups, topk_groups, norm, 2.5)
  want_w, want_e = _route_reference(logits, bias, 4, groups, topk_groups, norm, 2.5)
  np.testing.assert_array_equal(np.asarray(e).reshape(-1, 4), want_e)
  np.testing.assert_allclose(np.asarray(w).reshape(-1, 4), want_w, rtol=1e-6)


@pytest.mark.parametrize("keys,needle", [
    (dict(router_groups=3), "router_groups=3 must divide"),
    (dict(router_groups=4, router_topk_groups=5), "router_topk_groups=5 exceeds"),
    (dict(router="sigmoid", capacity_factor=1.25), "dropless"),
    (dict(first_dense_layers=4), "first_dense_layers=4 must be >= 0 and below"),
    (dict(first_dense_layers=1, moe_every=2), "less model.first_dense_layers=1 is not a multiple"),
    (dict(attention_type="mla", qk_rope_head_dim=3), "qk_rope_head_dim=3 must be even"),
    (dict(attention_type="mla", qk_norm="head"), "MLA normalises its latents"),
])
def test_bad_deepseek_keys_are_refused_by_name(keys, needle):
  cfg = config_lib.default_model_config()
  cfg.update(num_layers=4, num_experts=8, **keys)
  with pytest.raises(ValueError, match=needle):
    config_lib.validate(cfg)


# Published totals and active parameters (model cards: DeepSeek-V3 671B / 37B activated, the main model without its
# MTP layer; Qwen3-30B-A3B 30.5B / 3.3B; Qwen3-235B-A22B 235B / 22B).
PUBLISHED = {"deepseek_v3_671b": (671e9, 37e9), "qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_moe_presets_have_the_published_sizes(preset):
  import configs  # pylint: disable=g-import-not-at-top
  from model import counting  # pylint: disable=g-import-not-at-top
  config = configs.load(preset)
  configs.validate.check(config)
  counts = counting.count_params(config.model)
  total, active = PUBLISHED[preset]
  assert abs(counts["total"] / total - 1) < 0.02 and abs(counts["active"] / active - 1) < 0.02, counts
  # config.json round trip: the preset is what transformers' config class of the family holds
  assert hf.config_from_hf(hf.config_to_hf(config.model)) == config_lib.validate(config.model)


@pytest.mark.parametrize("impl", ["blockwise", "splash"])
def test_mla_through_the_attention_kernels_equals_xla(impl):
  """MLA's one-width padding (here v 16 wider than q/k 12, so the score scale is corrected) through the kernels
  (splash in Pallas interpret mode) gives the logits of the reference attention."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import Transformer  # pylint: disable=g-import-not-at-top
  base = config_lib.default_model_config()
  base.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=4, mlp_dim=48,
              max_seq_len=256, attention_type="mla", q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 256)), jnp.int32)
  blocks = {"blockwise": {"attention_block_size": 64},
            "splash": {"pallas_interpret": True, **{k: 128 for k in config_lib.SPLASH_BLOCK_KEYS}}}[impl]
  logits = {}
  for name, extra in (("xla", {}), (impl, blocks)):
    cfg = base.copy_and_resolve_references()
    cfg.update(attention_impl=name, **extra)
    logits[name] = np.asarray(Transformer(cfg, rngs=nnx.Rngs(0))(tokens))
  np.testing.assert_allclose(logits[impl], logits["xla"], atol=1e-6, rtol=0)


def test_deepseek_multi_token_heads_round_trip(built, tmp_path):
  """A DeepSeek-V3 model with one multi-token head (model.mtp_depth) saved as checkpoint layer num_layers (enorm,
  hnorm, eh_proj, shared_head.norm and a full block): transformers loads the directory and gives the main model's
  logits (it runs no MTP layer), and reading it back restores every head tensor exactly."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import Transformer  # pylint: disable=g-import-not-at-top
  ref, _ = built("deepseek_v3_plain")
  cfg = hf.config_from_hf(ref.config.to_dict())
  cfg.mtp_depth = 1
  model = Transformer(cfg, rngs=nnx.Rngs(5))
  hf.save(model, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
  np.testing.assert_allclose(_logits(back, TOKENS), np.asarray(model(jnp.asarray(TOKENS))), atol=TOL, rtol=0)
  again = hf.load(str(tmp_path), dtype="float32")
  assert again.cfg.mtp_depth == 1
  for a, b in zip(jax.tree.leaves(nnx.state(again.mtp)), jax.tree.leaves(nnx.state(model.mtp))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # transformers' own save of that model keeps num_nextn_predict_layers but no MTP layer: read without heads
  back.save_pretrained(tmp_path / "hf_saved")
  assert hf.load(str(tmp_path / "hf_saved"), dtype="float32").cfg.mtp_depth == 0
