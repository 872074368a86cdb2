"""Mistral-7B-v0.1 (HF mistralai/Mistral-7B-v0.1): 7,241,732,096 parameters, 4096-token sliding window."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 mlp_dim=14336, max_seq_len=32768, norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096)
  return c
