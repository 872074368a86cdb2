"""MaxText's `global_parameter_scale` models, for like-for-like comparison with MaxText's published TPU runs.

MaxText (AI-Hypercomputer/maxtext, MaxText/configs/base.yml) defines a default llama2-style decoder with
base_emb_dim 2048, base_num_query_heads = base_num_kv_heads 16, head_dim 128, base_mlp_dim 7168,
base_num_decoder_layers 16, vocab_size 32000, SiLU-gated MLP, RMSNorm, RoPE, untied output projection
(logits_via_embedding False), weights in float32 and activations in bfloat16. Its pyconfig.get_individual_scales
grows a power-of-two scale s = 2^k in a cycle of three doublings: with (q, r) = divmod(k, 3), heads and
mlp_dim are multiplied by 2^(q + [r > 0]), emb_dim by 2^(q + [r > 1]), layers by 2^q.

The v5e recipes (MaxText/configs/v5e/{16b,32b,64b}.sh) train them with remat_policy=full, max_target_length=2048,
flash attention and FSDP over the whole slice, per-device batch 6 / 4 / 2; 128b.sh uses per-device batch 1,
ici_fsdp 16 x ici_tensor 16 and remat_policy=minimal_offloaded (host offloading, which meshlm does not have).
"""
from configs import base

V5E_256_CHIPS = 256  # the slice of MaxText's published v5e table (MaxText/configs/v5e/README.md)


def scaled(scale: int, per_device_batch: int):
  """The MaxText model of `global_parameter_scale=scale` as a meshlm config, with MaxText's v5e recipe: global
  batch per_device_batch x 256 sequences of 2048 tokens, remat full, flash-style attention, FSDP over the slice."""
  k = scale.bit_length() - 1
  if scale < 1 or 2**k != scale:
    raise ValueError(f"global_parameter_scale={scale} must be a power of two")
  q, r = divmod(k, 3)
  heads_mlp, emb, layers = 2**(q + (r > 0)), 2**(q + (r > 1)), 2**q
  c = base.get_config()
  c.model.update(vocab_size=32000, d_model=2048 * emb, num_layers=16 * layers, num_heads=16 * heads_mlp,
                 num_kv_heads=16 * heads_mlp, head_dim=128, mlp_dim=7168 * heads_mlp, max_seq_len=2048,
                 norm_eps=1e-5, rope_theta=10000.0, dtype="bfloat16", param_dtype="float32",
                 attention_impl="blockwise", attention_block_size=512)
  c.mesh.update(data=1, fsdp=-1)
  c.train.update(seq_len=2048, batch_size=per_device_batch * V5E_256_CHIPS, remat="full")
  return c
