"""The CPU default (`python -m train`): a 1.3M-parameter Llama-style model (GQA, RoPE, SwiGLU, RMSNorm) trained
for 300 steps of 16 x 128 tokens on the built-in corpus. About 3 minutes on 2 CPU cores, tokenizer training and
compilation included (benchmarks/train_run.py measures it); the eval loss falls from 7.66 at step 0 (uniform
over the vocabulary: ln 2048 = 7.62) to about 4.9.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                 mlp_dim=384, max_seq_len=128)
  c.train.update(steps=300, batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30, log_every=10, eval_every=100,
                 eval_steps=4)
  c.checkpoint.every = 100
  return c
