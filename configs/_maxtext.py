"""MaxText's `global_parameter_scale` models, for like-for-like comparison with MaxText's published TPU runs.

A scale s = 2^k grows MaxText's base decoder in a cycle of three doublings (pyconfig.get_individual_scales): with
(q, r) = divmod(k, 3), heads and mlp_dim are multiplied by 2^(q + [r > 0]), emb_dim by 2^(q + [r > 1]), layers
by 2^q. Two base decoders:

- TODAY (MaxText 0.2.5, configs/base.yml since 2024-02-14): a llama2-style decoder, base_emb_dim 2048,
  base_num_query_heads = base_num_kv_heads 16, head_dim 128, base_mlp_dim 7168, 16 layers, vocab 32000, SiLU-gated
  MLP, RMSNorm, RoPE, untied output projection. What MaxText's `train_compile` builds today
  (benchmarks/predict_vs_maxtext.py compares its program with meshlm's): presets maxtext_{16,32,64,128}b.
- V5E_2023 (MaxText/configs/base.yml at 9bc243c95, 2023-11-01, when configs/v5e/README.md's table was measured
  with MaxText/configs/largest_job/*.sh): base_emb_dim 2560, base_num_heads 8, head_dim 256, base_mlp_dim 8192,
  16 layers, vocab 32768, one ungated relu MLP projection (mlp_activations ["relu"]), output projection tied to
  the embedding (logits_via_embedding True). The models behind the published MFUs: presets
  maxtext2023_{16,32,64,128}b (benchmarks/predict_maxtext.py's calibration rows).

Both recipes train with remat_policy=full, max_target_length=2048, MaxText's Pallas flash attention (meshlm's
splash kernel stands in), FSDP over the whole slice, per-device batch 6 / 4 / 2 / 1 for 16B / 32B / 64B / 128B,
weights in float32 and activations in bfloat16, and the LIBTPU_INIT_ARGS the scripts export (async collective
fusion, overlapped compute and collectives: meshlm's train.xla_overlap). The 128B scripts use ici_fsdp 16 x
ici_tensor 16 (largest_job/128b.sh with remat full; today's 128b.sh with host offloading): meshlm's tensor axis
leaves the residual stream whole, so the presets keep the other rows' FSDP over the slice.
"""
from configs import base

V5E_256_CHIPS = 256  # the slice of MaxText's published v5e table (MaxText/configs/v5e/README.md)

TODAY = {"d_model": 2048, "num_heads": 16, "head_dim": 128, "mlp_dim": 7168, "num_layers": 16, "vocab_size": 32000,
         "mlp_type": "swiglu", "tie_embeddings": False}
V5E_2023 = {"d_model": 2560, "num_heads": 8, "head_dim": 256, "mlp_dim": 8192, "num_layers": 16,
            "vocab_size": 32768, "mlp_type": "relu", "tie_embeddings": True}


def dims(scale: int, base_model: dict) -> dict:
  """The model keys of MaxText's `global_parameter_scale=scale` decoder grown from `base_model` (TODAY or
  V5E_2023); ValueError unless scale is a power of two."""
  k = scale.bit_length() - 1
  if scale < 1 or 2**k != scale:
    raise ValueError(f"global_parameter_scale={scale} must be a power of two")
  q, r = divmod(k, 3)
  heads_mlp, emb, layers = 2**(q + (r > 0)), 2**(q + (r > 1)), 2**q
  heads = base_model["num_heads"] * heads_mlp
  return dict(base_model, d_model=base_model["d_model"] * emb, num_layers=base_model["num_layers"] * layers,
              num_heads=heads, num_kv_heads=heads, mlp_dim=base_model["mlp_dim"] * heads_mlp)


def scaled(scale: int, per_device_batch: int, base_model: dict = TODAY):
  """The MaxText model of `global_parameter_scale=scale` as a meshlm config, with MaxText's v5e recipe: global
  batch per_device_batch x 256 sequences of 2048 tokens, remat full, splash attention, FSDP over the slice,
  the recipe's overlap flags."""
  c = base.get_config()
  c.model.update(**dims(scale, base_model), max_seq_len=2048, norm_eps=1e-5, rope_theta=10000.0,
                 dtype="bfloat16", param_dtype="float32", attention_impl="splash")
  c.mesh.update(data=1, fsdp=-1)
  c.train.update(seq_len=2048, batch_size=per_device_batch * V5E_256_CHIPS, remat="full", xla_overlap=True)
  return c
