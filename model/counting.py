"""Parameter counts (abstract evaluation, nothing allocated) and training FLOPs per token."""
from __future__ import annotations

from typing import Any, Mapping

import jax
from flax import nnx

from model import config as config_lib


def count_params(cfg_model: Mapping[str, Any]) -> dict[str, int]:
  """{"total": all parameters, "non_embedding": total minus the embedding matrices}; MoE models add "active".

  Embedding matrices (Kaplan et al. 2020) are the input table [V, D] and, when untied, the output projection
  [D, V]. "active" = parameters used per token: total minus the (E - k) unchosen experts' weights
  (3 * D * expert_mlp_dim each) in every MoE layer, the multi-token heads' included. Shapes come from
  `nnx.eval_shape` of the real model, so nothing is allocated, and every parameter the options create is counted:
  biases (use_bias, qkv_bias), q/k norms (qk_norm), the post norms of norm_position sandwich/post (and no pre-norms
  under post).
  """
  from model.transformer import Transformer  # local: transformer imports this package's siblings
  cfg = config_lib.validate(cfg_model)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  total = sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  embedding = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  counts = {"total": total, "non_embedding": total - embedding}
  if cfg.num_experts:
    # the multi-token heads' blocks are MoE layers too (model.layers.MultiTokenHead)
    moe_layers = sum(config_lib.is_moe_layer(cfg, i) for i in range(cfg.num_layers)) + cfg.mtp_depth
    per_expert = 3 * cfg.d_model * (cfg.expert_mlp_dim or cfg.mlp_dim)
    counts["active"] = total - moe_layers * (cfg.num_experts - cfg.experts_per_token) * per_expert
  return counts


def mean_attended_length(window: int, seq_len: int, causal: bool = True) -> float:
  """Mean number of keys a query attends to, in the continuous approximation.

  causal (the mask halves the work): full causal (window 0 or >= seq_len) T/2; window w < T:
  (1/T) * integral_0^T min(t, w) dt = w - w^2 / (2T). causal=False (no halving, the PaLM / torchtitan
  convention): T, or w for a window w < T.
  """
  T, w = float(seq_len), float(window)
  if window == 0 or w >= T:
    return T / 2 if causal else T
  return w - w * w / (2 * T) if causal else w


def flops_per_token(cfg_model: Mapping[str, Any], seq_len: int, causal_halving: bool = True) -> float:
  """Training (forward + backward) FLOPs per token.

    6 * (N_non_embedding + D * V)  +  12 * H * K * sum_layers mean_attended_length(window_l, T)

  with N_non_embedding counting active parameters for MoE models (a token runs k of the E experts).
  The first term is 2 FLOPs per multiply-add for every weight matmul, times 3 for forward + backward; it includes
  the output projection (D * V, a real matmul, tied or not) but not the input embedding lookup (no FLOPs).
  The second is QK^T and PV (2 matmuls * 2 FLOPs * H * K per attended key, times 3 for the backward); for full
  causal attention it is 6 * num_layers * H * K * T, i.e. 12 * L * H * K * T halved for the mask.
  causal_halving=False counts every key of the window (12 * L * H * K * T for full attention): the convention of
  PaLM (Chowdhery et al. 2022, appendix B) and torchtitan, whose MFU is therefore higher for the same run.
  """
  cfg = config_lib.validate(cfg_model)
  if seq_len < 1:
    raise ValueError(f"seq_len={seq_len} must be >= 1")
  counts = count_params(cfg)
  embedding = counts["total"] - counts["non_embedding"]
  n = counts.get("active", counts["total"]) - embedding + cfg.d_model * cfg.vocab_size
  attended = sum(mean_attended_length(w, seq_len, causal_halving) for w in config_lib.layer_windows(cfg))
  return 6.0 * n + 12.0 * cfg.num_heads * cfg.head_dim * attended
