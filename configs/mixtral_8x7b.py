"""Mixtral-8x7B-v0.1 (HF mistralai/Mixtral-8x7B-v0.1): 46,702,792,704 parameters, 12,879,925,248 active per token
(top-2 of 8 experts in every layer), full causal attention, rope_theta 1e6."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 mlp_dim=14336, max_seq_len=32768, norm_eps=1e-5, rope_theta=1e6, num_experts=8,
                 experts_per_token=2, expert_mlp_dim=14336)
  return c
