"""meshlm scaling family, ~1.0B parameters (GQA 16/8 heads, tied embeddings)."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=2048, num_layers=20, num_heads=16, num_kv_heads=8, head_dim=128,
                 mlp_dim=5632, max_seq_len=2048, tie_embeddings=True)
  return c
