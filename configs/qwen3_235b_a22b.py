"""Qwen3-235B-A22B (HF Qwen/Qwen3-235B-A22B, its config.json): 235B parameters, 22B active per token; 94 MoE
layers of 128 experts (top 8, renormalised), RMSNorm of each q / k head, untied embeddings.

config.json: vocab_size 151936, hidden_size 4096, intermediate_size 12288, moe_intermediate_size 1536,
num_hidden_layers 94, num_attention_heads 64, num_key_value_heads 4, head_dim 128, num_experts 128,
num_experts_per_tok 8, decoder_sparse_step 1, mlp_only_layers [], max_position_embeddings 40960, rope_theta 1e6,
rms_norm_eps 1e-6, tie_word_embeddings false.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=151936, d_model=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
                 mlp_dim=12288, max_seq_len=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm="head", num_experts=128,
                 experts_per_token=8, expert_mlp_dim=1536, router="topk_softmax")
  return c
