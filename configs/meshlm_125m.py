"""meshlm scaling family, ~124M parameters (GPT-3 Small shape, Llama-style blocks, tied embeddings)."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                 mlp_dim=2560, max_seq_len=2048, tie_embeddings=True)
  return c
