"""meshlm scaling family, ~341M parameters (GPT-3 Medium shape, Llama-style blocks, tied embeddings)."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=1024, num_layers=24, num_heads=16, num_kv_heads=16, head_dim=64,
                 mlp_dim=2816, max_seq_len=2048, tie_embeddings=True)
  return c
