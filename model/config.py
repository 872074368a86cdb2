"""Validation of `config.model`: every bad value fails at construction with a message naming the key."""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import ml_collections

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CHOICES = {
    "mlp_type": ("swiglu", "geglu", "gelu"),
    "norm_type": ("rmsnorm", "layernorm"),
    "rope_scaling": ("none", "llama3"),
    "block_type": ("sequential", "parallel"),
    "attention_impl": ("xla", "dot_product", "blockwise"),
    "dtype": tuple(DTYPES),
    "param_dtype": tuple(DTYPES),
    "router": ("topk_softmax", "softmax_topk"),
    "moe_impl": ("ragged", "tiled"),
}
_POSITIVE_INTS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                  "max_seq_len", "attention_block_size", "rope_original_max_len")
_POSITIVE_FLOATS = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor")


def default_model_config() -> ml_collections.ConfigDict:
  from configs import base  # local: configs is a sibling package that only builds ConfigDicts
  return base.get_config().model


def validate(cfg: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Checks a model config (ConfigDict or dict with the keys of `configs/base.py`); returns it as a ConfigDict.

  Raises ValueError naming the offending key (`model.<key>`) and how to fix it.
  """
  defaults = default_model_config()
  keys = set(cfg.keys())
  unknown = sorted(keys - set(defaults.keys()))
  if unknown:
    raise ValueError(f"unknown model config key(s) {', '.join('model.' + k for k in unknown)}; "
                     f"known keys are listed in configs/base.py")
  missing = sorted(set(defaults.keys()) - keys)
  if missing:
    raise ValueError(f"model config lacks key(s) {', '.join('model.' + k for k in missing)}; "
                     "start from configs/base.py get_config().model")
  c = ml_collections.ConfigDict(dict(cfg))
  for k in _POSITIVE_INTS:
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive integer")
  for k in _POSITIVE_FLOATS:
    if not isinstance(c[k], (int, float)) or c[k] <= 0:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive number")
  for k, choices in CHOICES.items():
    if c[k] not in choices:
      raise ValueError(f"model.{k}={c[k]!r} is not one of {', '.join(choices)}")
  if c.num_heads % c.num_kv_heads:
    raise ValueError(f"model.num_kv_heads={c.num_kv_heads} must divide model.num_heads={c.num_heads}")
  if c.head_dim % 2:
    raise ValueError(f"model.head_dim={c.head_dim} must be even: RoPE rotates pairs of dimensions")
  if not isinstance(c.sliding_window, int) or c.sliding_window < 0:
    raise ValueError(f"model.sliding_window={c.sliding_window!r} must be >= 1 tokens, or 0 for full causal "
                     "attention (a window smaller than 1 would let a token see nothing)")
  if not isinstance(c.global_every, int) or c.global_every < 0:
    raise ValueError(f"model.global_every={c.global_every!r} must be >= 0 (0 = every layer windowed)")
  if c.rope_scaling == "llama3" and c.rope_high_freq_factor <= c.rope_low_freq_factor:
    raise ValueError(f"model.rope_high_freq_factor={c.rope_high_freq_factor} must exceed "
                     f"model.rope_low_freq_factor={c.rope_low_freq_factor} for llama3 rope scaling")
  if c.init_std < 0:
    raise ValueError(f"model.init_std={c.init_std} must be >= 0")
  _validate_moe(c)
  return c


def _validate_moe(c: ml_collections.ConfigDict) -> None:
  for k in ("num_experts", "num_shared_experts", "expert_mlp_dim"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 0:
      raise ValueError(f"model.{k}={c[k]!r} must be an integer >= 0")
  for k in ("experts_per_token", "moe_every"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive integer")
  if not isinstance(c.capacity_factor, (int, float)) or c.capacity_factor < 0:
    raise ValueError(f"model.capacity_factor={c.capacity_factor!r} must be >= 0 (0 = dropless)")
  if not c.num_experts:
    return
  if c.experts_per_token > c.num_experts:
    raise ValueError(f"model.experts_per_token={c.experts_per_token} exceeds model.num_experts={c.num_experts}")
  if c.num_layers % c.moe_every:
    raise ValueError(f"model.num_layers={c.num_layers} is not a multiple of model.moe_every={c.moe_every}: the "
                     "layer scan repeats groups of moe_every layers")
  if c.mlp_type == "gelu":
    raise ValueError("model.mlp_type='gelu' with model.num_experts > 0: experts are gated (swiglu or geglu)")
  if c.block_type != "sequential":
    raise ValueError(f"model.block_type={c.block_type!r} with model.num_experts > 0: MoE layers are sequential")
  if c.use_bias:
    raise ValueError("model.use_bias=True with model.num_experts > 0: experts and router have no biases")


def is_moe_layer(c: ml_collections.ConfigDict, i: int) -> bool:
  """Layer i (0-based) has a Mixture-of-Experts feed-forward: layers moe_every-1, 2*moe_every-1, ..."""
  return bool(c.num_experts) and (i + 1) % c.moe_every == 0


def layers_per_unit(c: ml_collections.ConfigDict) -> int:
  """Layers in one repeated unit of the layer stack (what the layer scan iterates over)."""
  return c.moe_every if c.num_experts else 1


def layer_windows(c: ml_collections.ConfigDict) -> tuple[int, ...]:
  """Attention window per layer in tokens (0 = global/full causal), from sliding_window and global_every."""
  def window(i):
    if c.sliding_window == 0 or (c.global_every and (i + 1) % c.global_every == 0):
      return 0
    return c.sliding_window
  return tuple(window(i) for i in range(c.num_layers))
