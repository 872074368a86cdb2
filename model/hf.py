"""Hugging Face interchange for Llama and Mistral: `load(path)`, `save(model, path)`, `config_from_hf(dict)`.

A Hugging Face directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
Weights map one to one: HF Linear weights are [out, in] and are transposed/reshaped into meshlm's einsum kernels;
RoPE uses the same rotate-half convention, so q/k need no permutation. Fields meshlm cannot represent are refused
with a ValueError naming them. Neither torch nor transformers is needed.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from model import config as config_lib
from model.transformer import Transformer

_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
_SUPPORTED_TYPES = ("llama", "mistral")


def _refuse(field, value, why):
  raise ValueError(f"Hugging Face config field {field}={value!r} is not supported by meshlm: {why}")


def _rope_fields(hf: Mapping[str, Any]) -> dict:
  """meshlm rope keys from transformers 5 `rope_parameters` or the 4.x `rope_theta` + `rope_scaling` fields."""
  params = dict(hf.get("rope_parameters") or {})
  legacy = dict(hf.get("rope_scaling") or {})
  merged = {**legacy, **params}
  theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
  kind = merged.get("rope_type", merged.get("type", "default"))
  out = {"rope_theta": float(theta), "rope_scaling": "none"}
  if kind == "llama3":
    out.update(rope_scaling="llama3", rope_scaling_factor=float(merged["factor"]),
               rope_low_freq_factor=float(merged["low_freq_factor"]),
               rope_high_freq_factor=float(merged["high_freq_factor"]),
               rope_original_max_len=int(merged["original_max_position_embeddings"]))
  elif kind != "default":
    field = "rope_parameters.rope_type" if params else "rope_scaling.rope_type"
    _refuse(field, kind, "only default RoPE and llama3 scaling exist in meshlm (model.rope_scaling)")
  if merged.get("partial_rotary_factor", 1.0) != 1.0:
    _refuse("partial_rotary_factor", merged["partial_rotary_factor"], "RoPE rotates the whole head")
  return out


def config_from_hf(hf: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The meshlm `config.model` for a Hugging Face Llama/Mistral config.json dict (validated)."""
  model_type = hf.get("model_type")
  if model_type not in _SUPPORTED_TYPES:
    _refuse("model_type", model_type, f"meshlm reads {', '.join(_SUPPORTED_TYPES)} (Mixtral needs MoE)")
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      _refuse(field, hf[field], "meshlm's projections have no biases in Llama layout")
  if hf.get("attention_dropout", 0.0):
    _refuse("attention_dropout", hf["attention_dropout"], "meshlm has no dropout")
  act = hf.get("hidden_act", "silu")
  if act not in _ACTIVATIONS:
    _refuse("hidden_act", act, f"supported: {', '.join(_ACTIVATIONS)}")
  layer_types = hf.get("layer_types")
  if layer_types and len(set(layer_types)) > 1:
    _refuse("layer_types", layer_types, "mixed sliding/full layers are not mapped from HF configs")
  heads = int(hf["num_attention_heads"])
  cfg = config_lib.default_model_config()
  window = hf.get("sliding_window") if model_type == "mistral" else None
  cfg.update(
      vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads), mlp_dim=int(hf["intermediate_size"]),
      mlp_type=_ACTIVATIONS[act], norm_type="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      use_bias=False, max_seq_len=int(hf.get("max_position_embeddings", 4096)),
      sliding_window=int(window or 0), global_every=0, block_type="sequential",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)), **_rope_fields(hf))
  return config_lib.validate(cfg)


def config_to_hf(cfg: Mapping[str, Any]) -> dict:
  """The config.json dict (Llama, or Mistral when a sliding window is set) for a meshlm model config."""
  cfg = config_lib.validate(cfg)
  checks = {"norm_type": "rmsnorm", "block_type": "sequential", "use_bias": False, "global_every": 0}
  for key, want in checks.items():
    if cfg[key] != want:
      raise ValueError(f"model.{key}={cfg[key]!r} has no Hugging Face Llama/Mistral equivalent (needs {want!r})")
  if cfg.mlp_type == "gelu":
    raise ValueError("model.mlp_type='gelu' has no Hugging Face Llama/Mistral equivalent (swiglu or geglu)")
  rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling == "llama3":
    rope.update(rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  model_type = "mistral" if cfg.sliding_window else "llama"
  hf = {
      "architectures": ["MistralForCausalLM" if model_type == "mistral" else "LlamaForCausalLM"],
      "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu" if cfg.mlp_type == "swiglu" else "gelu_pytorch_tanh",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
      "attention_bias": False, "attention_dropout": 0.0,
      "rope_theta": cfg.rope_theta, "rope_parameters": rope,
      "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
  }
  if cfg.rope_scaling != "none":
    hf["rope_scaling"] = rope
  if model_type == "mistral":
    hf["sliding_window"] = cfg.sliding_window
  else:
    hf["mlp_bias"] = False
  return hf


def _layer_tensors(cfg) -> list[tuple[str, str, Any]]:
  """(HF name after `model.layers.{i}.`, meshlm path inside a block, numpy meshlm shape -> HF [out, in])."""
  D, H, G, K = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  table = [
      ("self_attn.q_proj.weight", "attn/q", lambda w: w.reshape(D, H * K).T),
      ("self_attn.k_proj.weight", "attn/k", lambda w: w.reshape(D, G * K).T),
      ("self_attn.v_proj.weight", "attn/v", lambda w: w.reshape(D, G * K).T),
      ("self_attn.o_proj.weight", "attn/o", lambda w: w.reshape(H * K, D).T),
      ("mlp.gate_proj.weight", "mlp/gate", lambda w: w.T),
      ("mlp.up_proj.weight", "mlp/up", lambda w: w.T),
      ("mlp.down_proj.weight", "mlp/down", lambda w: w.T),
      ("input_layernorm.weight", "attn_norm/scale", lambda w: w),
      ("post_attention_layernorm.weight", "mlp_norm/scale", lambda w: w),
  ]
  return [t for t in table if not (t[1] == "mlp/gate" and cfg.mlp_type == "gelu")]


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  tensors = {}
  for name in files:
    with safe_open(os.path.join(path, name), framework="flax") as f:
      for key in f.keys():
        tensors[key] = f.get_tensor(key)
  return tensors


def _get(tree, path: str):
  for part in path.split("/"):
    tree = getattr(tree, part)
  return tree


def load(path: str, dtype: str = "float32", compute_dtype: str | None = None, **model_overrides) -> Transformer:
  """Reads a Hugging Face Llama/Mistral directory into a meshlm Transformer.

  dtype: parameter dtype ("float32", "bfloat16"); compute_dtype: activation dtype (default: dtype). Other
  `config.model` keys (scan_layers, attention_impl, ...) may be overridden by keyword.
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  cfg.update(param_dtype=dtype, dtype=compute_dtype or dtype, **model_overrides)
  cfg = config_lib.validate(cfg)
  tensors = _read_safetensors(path)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  pdtype = config_lib.DTYPES[cfg.param_dtype]
  used = set()

  def take(name, shape, transpose=True):
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} missing from the safetensors files")
    used.add(name)
    w = np.asarray(tensors[name].astype(jnp.float32))
    return (w.T if transpose and w.ndim == 2 else w).reshape(shape)

  def assign(var, value):
    var.set_value(jnp.asarray(value, pdtype))

  assign(model.embed.embedding, take("model.embed_tokens.weight", model.embed.embedding.shape, transpose=False))
  assign(model.final_norm.scale, take("model.norm.weight", model.final_norm.scale.shape))
  if not cfg.tie_embeddings:
    assign(model.unembed, take("lm_head.weight", model.unembed.shape))
  for suffix, local, _ in _layer_tensors(cfg):
    names = [f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      var = _get(model.layers, local)
      assign(var, np.stack([take(n, var.shape[1:]) for n in names]))
    else:
      for i, n in enumerate(names):
        var = _get(model.layers[i], local)
        assign(var, take(n, var.shape))
  unused = sorted(set(tensors) - used - {"lm_head.weight"})
  if unused:
    raise ValueError(f"{path}: tensors meshlm does not map: {', '.join(unused[:5])}"
                     f"{' ...' if len(unused) > 5 else ''}")
  return model


def save(model: Transformer, path: str, dtype: str | None = None) -> None:
  """Writes `model` as a Hugging Face directory (config.json + model.safetensors) that transformers loads.

  dtype: stored dtype ("float32", "bfloat16"; default: the model's param_dtype).
  """
  from safetensors.flax import save_file
  cfg = ml_collections.ConfigDict(model.cfg.to_dict())
  hf = config_to_hf(cfg)
  out_dtype = config_lib.DTYPES[dtype or cfg.param_dtype]
  tensors = {}

  def put(name, value):
    tensors[name] = jnp.asarray(np.ascontiguousarray(value), out_dtype)

  def host(var):
    return np.asarray(jax.device_get(var.get_value()), np.float32)

  put("model.embed_tokens.weight", host(model.embed.embedding))
  put("model.norm.weight", host(model.final_norm.scale))
  if not cfg.tie_embeddings:
    put("lm_head.weight", host(model.unembed).T)
  for suffix, local, to_hf in _layer_tensors(cfg):
    if cfg.scan_layers:
      per_layer = list(host(_get(model.layers, local)))
    else:
      per_layer = [host(_get(block, local)) for block in model.layers]
    for i, w in enumerate(per_layer):
      put(f"model.layers.{i}.{suffix}", to_hf(w))
  os.makedirs(path, exist_ok=True)
  hf["torch_dtype"] = hf["dtype"] = dtype or cfg.param_dtype
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
