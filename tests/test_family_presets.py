"""The model-family presets (issue 36: configs/qwen2_5_7b.py, qwen3_8b, gemma2_9b, gemma3_12b, olmo2_7b,
llama3_1_8b): their settings are the published Hugging Face config.json values, their parameter count
(model.count_params, abstract evaluation, nothing allocated) equals the count computed here from those
dimensions by the architecture's formula, and that count is the published model size."""
import pytest

import configs
import model

# The Hugging Face config.json values of each family's checkpoint (the presets' docstrings name them), in meshlm's
# keys. hidden_size -> d_model, num_hidden_layers -> num_layers, intermediate_size -> mlp_dim, rms_norm_eps ->
# norm_eps, max_position_embeddings -> max_seq_len.
PUBLISHED_CONFIG = {
    "qwen2_5_7b": dict(vocab_size=152064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       mlp_dim=18944, norm_eps=1e-6, rope_theta=1e6, max_seq_len=131072, qkv_bias=True,
                       tie_embeddings=False),
    "qwen3_8b": dict(vocab_size=151936, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     mlp_dim=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, qk_norm="head",
                     tie_embeddings=False),
    "gemma2_9b": dict(vocab_size=256000, d_model=3584, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                      mlp_dim=14336, mlp_type="geglu", norm_eps=1e-6, rope_theta=10000.0, max_seq_len=8192,
                      attn_logit_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=256.0,
                      sliding_window=4096, layer_types=("sliding", "full"), norm_position="sandwich",
                      norm_offset=True, embed_scale=True, tie_embeddings=True),
    "gemma3_12b": dict(vocab_size=262208, d_model=3840, num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
                       mlp_dim=15360, mlp_type="geglu", norm_eps=1e-6, rope_theta=1e6, rope_scaling="linear",
                       rope_scaling_factor=8.0, rope_local_theta=10000.0, max_seq_len=131072,
                       query_pre_attn_scalar=256.0, sliding_window=1024, layer_types=("sliding",) * 5 + ("full",),
                       qk_norm="head", norm_position="sandwich", norm_offset=True, embed_scale=True,
                       attn_logit_softcap=0.0, final_logit_softcap=0.0, tie_embeddings=True),
    "olmo2_7b": dict(vocab_size=100352, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                     mlp_dim=11008, norm_eps=1e-6, rope_theta=500000.0, max_seq_len=4096, qk_norm="proj",
                     norm_position="post", tie_embeddings=False),
    "llama3_1_8b": dict(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        mlp_dim=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072,
                        rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_original_max_len=8192, tie_embeddings=False),
}
# Published sizes (model cards; Gemma 3's language model without its vision tower), to 3 significant digits.
PUBLISHED_SIZE = {"qwen2_5_7b": 7.62e9, "qwen3_8b": 8.19e9, "gemma2_9b": 9.24e9, "gemma3_12b": 11.8e9,
                  "olmo2_7b": 7.30e9, "llama3_1_8b": 8.03e9}


def formula_count(c: dict) -> int:
  """Parameters of the architecture, written out: per layer the q, k, v, o projections, the q/k/v biases, the
  q/k norm scales ([K] each per head kind, or [H*K] and [G*K] over the projections), the gated MLP (gate, up,
  down) and the norm scales (two pre-norms, four with sandwich norms, two post-norms); then the embedding (twice
  when untied) and the final norm."""
  D, L, H, G, K, F, V = (c[k] for k in ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                                        "vocab_size"))
  attention = D * H * K + 2 * D * G * K + H * K * D
  biases = H * K + 2 * G * K if c.get("qkv_bias") else 0
  qk_norm = {"none": 0, "head": 2 * K, "proj": H * K + G * K}[c.get("qk_norm", "none")]
  mlp = 3 * D * F
  norms = {"pre": 2, "sandwich": 4, "post": 2}[c.get("norm_position", "pre")] * D
  embeddings = V * D * (1 if c["tie_embeddings"] else 2)
  return L * (attention + biases + qk_norm + mlp + norms) + embeddings + D


@pytest.mark.parametrize("preset", sorted(PUBLISHED_CONFIG))
def test_preset_is_the_published_config(preset):
  config = configs.load(preset)
  configs.validate.check(config)
  model_config = config.model.to_dict()
  assert {k: model_config[k] for k in PUBLISHED_CONFIG[preset]} == PUBLISHED_CONFIG[preset]


@pytest.mark.parametrize("preset", sorted(PUBLISHED_CONFIG))
def test_preset_parameter_count_is_the_formula_and_the_published_size(preset):
  total = model.count_params(configs.load(preset).model)["total"]
  assert total == formula_count(PUBLISHED_CONFIG[preset])
  assert abs(total / PUBLISHED_SIZE[preset] - 1) < 0.01, (total, PUBLISHED_SIZE[preset])


def test_formula_counts_are_the_published_totals():
  """The exact totals Hugging Face reports for these checkpoints (safetensors parameter counts)."""
  assert formula_count(PUBLISHED_CONFIG["qwen2_5_7b"]) == 7_615_616_512
  assert formula_count(PUBLISHED_CONFIG["qwen3_8b"]) == 8_190_735_360
  assert formula_count(PUBLISHED_CONFIG["gemma2_9b"]) == 9_241_705_984
  assert formula_count(PUBLISHED_CONFIG["llama3_1_8b"]) == 8_030_261_248
