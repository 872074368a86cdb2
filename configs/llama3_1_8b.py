"""Llama-3.1-8B (HF meta-llama/Llama-3.1-8B): 8,030,261,248 parameters; Llama 3 (configs/llama3_8b.py) with
Llama 3.1's RoPE scaling to a 131072-token context.

meta-llama/Llama-3.1-8B config.json: as Meta-Llama-3-8B (hidden_size 4096, 32 layers, 32 heads, 8 kv heads,
intermediate_size 14336, vocab_size 128256, rope_theta 500000, rms_norm_eps 1e-5) with max_position_embeddings
131072 and rope_scaling {rope_type llama3, factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0,
original_max_position_embeddings 8192}.
"""
from configs import llama3_8b


def get_config():
  c = llama3_8b.get_config()
  c.model.update(max_seq_len=131072, rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                 rope_high_freq_factor=4.0, rope_original_max_len=8192)
  return c
