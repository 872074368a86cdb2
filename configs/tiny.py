"""The CPU default: a ~4M-parameter Llama-style model that trains on 2 CPU cores in a few minutes."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=2048, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                 mlp_dim=768, max_seq_len=256)
  c.train.update(steps=300, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=30, log_every=10, eval_every=100,
                 eval_steps=4)
  c.checkpoint.every = 100
  return c
