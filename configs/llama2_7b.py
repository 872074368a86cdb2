"""Llama-2-7B (Touvron et al. 2023; HF meta-llama/Llama-2-7b-hf): 6,738,415,616 parameters."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                 mlp_dim=11008, max_seq_len=4096, norm_eps=1e-5, rope_theta=10000.0)
  return c
