"""Llama-3-8B (HF meta-llama/Meta-Llama-3-8B): 8,030,261,248 parameters."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 mlp_dim=14336, max_seq_len=8192, norm_eps=1e-5, rope_theta=500000.0)
  return c
