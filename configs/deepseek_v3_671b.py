"""DeepSeek-V3 (HF deepseek-ai/DeepSeek-V3, its config.json): 671B parameters, 37B active per token (the main
model; its multi-token-prediction layer, `--config.model.mtp_depth=1`, adds 11.6B here: the checkpoint's 14B
also counts that layer's copies of the embedding and output head). MLA (q LoRA 1536, kv latent 512, 128 + 64
rotated q/k widths, v 128), 3 dense layers then 58 MoE layers of 256 routed experts (top 8 of 8 groups limited to 4) plus 1
shared, sigmoid routing scaled by 2.5, YaRN x40 over 4096 positions with mscale 1.0 / mscale_all_dim 1.0.

config.json: vocab_size 129280, hidden_size 7168, intermediate_size 18432, moe_intermediate_size 2048,
num_hidden_layers 61, num_attention_heads 128, num_key_value_heads 128, n_shared_experts 1, n_routed_experts 256,
routed_scaling_factor 2.5, kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, v_head_dim 128,
qk_nope_head_dim 128, n_group 8, topk_group 4, num_experts_per_tok 8, first_k_dense_replace 3, norm_topk_prob
true, max_position_embeddings 163840, rms_norm_eps 1e-6, rope_theta 10000, tie_word_embeddings false.
"""
from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=129280, d_model=7168, num_layers=61, num_heads=128, num_kv_heads=128, head_dim=64,
                 mlp_dim=18432, max_seq_len=163840, norm_eps=1e-6, rope_theta=10000.0, rope_scaling="yarn",
                 rope_scaling_factor=40.0, rope_original_max_len=4096, rope_yarn_beta_fast=32.0,
                 rope_yarn_beta_slow=1.0, rope_attention_factor=1.0, rope_mscale_all_dim=1.0,
                 attention_type="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
                 num_experts=256, experts_per_token=8, expert_mlp_dim=2048, num_shared_experts=1,
                 router="sigmoid", router_norm_topk=True, routed_scaling_factor=2.5, router_groups=8,
                 router_topk_groups=4, first_dense_layers=3)
  return c
