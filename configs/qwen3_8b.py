"""Qwen3-8B (HF Qwen/Qwen3-8B): 8,190,735,360 parameters; RMSNorm of each q / k head, untied embeddings.

Qwen/Qwen3-8B config.json: hidden_size 4096, num_hidden_layers 36, num_attention_heads 32, num_key_value_heads 8,
head_dim 128, intermediate_size 12288, vocab_size 151936, rope_theta 1e6, rms_norm_eps 1e-6,
max_position_embeddings 40960, attention_bias false, tie_word_embeddings false (q_norm / k_norm over head_dim).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=151936, d_model=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                 mlp_dim=12288, max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0, qk_norm="head")
  return c
