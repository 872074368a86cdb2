"""OLMo-2-7B (HF allenai/OLMo-2-1124-7B): 7,298,617,344 parameters; norms after each sublayer (no pre-norm),
RMSNorm over the whole q and k projections, untied embeddings.

allenai/OLMo-2-1124-7B config.json: hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
num_key_value_heads 32, intermediate_size 11008, vocab_size 100352, rope_theta 500000, rms_norm_eps 1e-6,
max_position_embeddings 4096, attention_bias false, tie_word_embeddings false (Olmo2: q_norm over 4096, k_norm over
4096, post_attention_layernorm and post_feedforward_layernorm on the sublayer outputs).
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=100352, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                 mlp_dim=11008, max_seq_len=4096, norm_eps=1e-6, rope_theta=500000.0, qk_norm="proj",
                 norm_position="post")
  return c
