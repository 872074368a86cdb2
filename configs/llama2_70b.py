"""Llama-2-70B (HF meta-llama/Llama-2-70b-hf): 68,976,648,192 parameters, GQA with 8 kv heads."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                 mlp_dim=28672, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0)
  return c
