"""Qwen2.5-7B (HF Qwen/Qwen2.5-7B): 7,615,616,512 parameters; biases on q, k, v, untied embeddings.

Qwen/Qwen2.5-7B config.json: hidden_size 3584, num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4
(head_dim 3584 / 28 = 128), intermediate_size 18944, vocab_size 152064, rope_theta 1e6, rms_norm_eps 1e-6,
max_position_embeddings 131072, use_sliding_window false, tie_word_embeddings false (Qwen2 puts biases on the
q, k, v projections).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=152064, d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                 mlp_dim=18944, max_seq_len=131072, norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True)
  return c
