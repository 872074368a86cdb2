"""Gemma-3-12B, the language model (HF google/gemma-3-12b-pt, text_config): 11,766,034,176 parameters; five
1024-token sliding-window layers to one global layer, RMSNorm of each q / k head, sandwich norms, tied embeddings.

google/gemma-3-12b-pt config.json text_config: hidden_size 3840, num_hidden_layers 48, num_attention_heads 16,
num_key_value_heads 8, head_dim 256, intermediate_size 15360, vocab_size 262208, hidden_activation
gelu_pytorch_tanh (GeGLU), rms_norm_eps 1e-6 (RMSNorm times 1 + w), query_pre_attn_scalar 256, sliding_window 1024
with sliding_window_pattern 6 (layer_types 5 x sliding, full), rope_theta 1e6 with rope_scaling linear factor 8 on
the global layers, rope_local_base_freq 10000 on the sliding ones, max_position_embeddings 131072, no soft caps,
embeddings times sqrt(hidden_size), tied. (The SigLIP vision tower of the multimodal checkpoint is not included.)
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=262208, d_model=3840, num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256,
                 mlp_dim=15360, mlp_type="geglu", max_seq_len=131072, norm_eps=1e-6, rope_theta=1000000.0,
                 rope_scaling="linear", rope_scaling_factor=8.0, rope_local_theta=10000.0, qk_norm="head",
                 norm_offset=True, norm_position="sandwich", embed_scale=True, query_pre_attn_scalar=256.0,
                 sliding_window=1024, layer_types=("sliding",) * 5 + ("full",), tie_embeddings=True)
  return c
