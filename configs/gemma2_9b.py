"""Gemma-2-9B (HF google/gemma-2-9b): 9,241,705,984 parameters; soft-capped logits, alternating 4096-token
sliding-window and global layers, sandwich norms, tied embeddings.

google/gemma-2-9b config.json: hidden_size 3584, num_hidden_layers 42, num_attention_heads 16,
num_key_value_heads 8, head_dim 256, intermediate_size 14336, vocab_size 256000, hidden_activation
gelu_pytorch_tanh (GeGLU), rms_norm_eps 1e-6 (RMSNorm times 1 + w), rope_theta 10000, max_position_embeddings
8192, attn_logit_softcapping 50.0, final_logit_softcapping 30.0, query_pre_attn_scalar 256, sliding_window 4096
on the even layers (layer_types sliding, full, ...), embeddings times sqrt(hidden_size), tied.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=256000, d_model=3584, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                 mlp_dim=14336, mlp_type="geglu", max_seq_len=8192, norm_eps=1e-6, rope_theta=10000.0,
                 norm_offset=True, norm_position="sandwich", embed_scale=True, attn_logit_softcap=50.0,
                 final_logit_softcap=30.0, query_pre_attn_scalar=256.0, sliding_window=4096,
                 layer_types=("sliding", "full"), tie_embeddings=True)
  return c
