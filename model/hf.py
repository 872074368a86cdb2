"""Hugging Face interchange for the decoder families meshlm's one transformer expresses: Llama (2, 3.x), Mistral,
Mixtral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 and OLMo 2. `load(path)`, `save(model, path)`, `config_from_hf`,
`config_to_hf`.

A Hugging Face directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
A family is configuration of the one transformer (`FAMILIES`: the model keys each fixes, e.g. Qwen2's q/k/v
biases, Gemma's (1 + w) norms, scaled embedding and sandwich norms, OLMo 2's post-norms). `config_from_hf` maps
every config.json field that changes the function (transformers' defaults for omitted ones) or refuses it with a
ValueError naming it; `config_to_hf` writes the family's own model_type and architectures. Gemma 3's multimodal
directories (model_type gemma3) load their text decoder. Weights map one to one through one two-way name table
(`name_table`): HF Linear weights are [out, in] and are transposed/reshaped into meshlm's einsum kernels;
Mixtral's per-expert matrices stack into [E, D, F] kernels; RoPE uses the same rotate-half convention, so q/k need
no permutation. Neither torch nor transformers is needed.

Both directions stream (docs/hf.md): `load` with a mesh builds every parameter sharded, each device's block read
alone from the memory-mapped files (`model.safetensors_io`); `save` gathers and writes one tensor at a time into
Hugging Face's sharded layout.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from model import axes
from model import config as config_lib
from model import safetensors_io
from model.transformer import Transformer
from parallel import sharding as sharding_lib

_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}


class Family(NamedTuple):
  """A Hugging Face decoder family as configuration of meshlm's transformer."""
  architecture: str  # the transformers class written to config.json's `architectures` (AutoModelForCausalLM's)
  keys: Mapping[str, Any]  # the meshlm keys the family fixes; the other _FAMILY_KEYS keep their defaults
  windows: str  # "none": no sliding window; "uniform": one window on every layer (or none); "per_layer": layer_types
  defaults: Mapping[str, Any]  # transformers' defaults of the fields read, for a config.json that omits them


# The keys that tell the families apart, at their defaults (Llama's layout).
_FAMILY_KEYS = {"qkv_bias": False, "qk_norm": "none", "norm_offset": False, "embed_scale": False,
                "norm_position": "pre", "attention_type": "mha"}
_GEMMA = {"norm_offset": True, "embed_scale": True, "norm_position": "sandwich"}
# Defaults of transformers 5's config classes (a nested config, as Gemma 3's text_config, is written sparsely).
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02,
                   "rope_theta": 10000.0}
_MISTRAL_DEFAULTS = {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                     "max_position_embeddings": 131072, "sliding_window": 4096}
_QWEN_DEFAULTS = {**_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28}
_GEMMA_DEFAULTS = {**_LLAMA_DEFAULTS, "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
                   "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
                   "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                   "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
_DEEPSEEK_DEFAULTS = {**_LLAMA_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                      "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                      "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
                      "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                      "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
                      "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 4096,
                      "rms_norm_eps": 1e-6, "rope_interleave": True, "num_nextn_predict_layers": 1}
FAMILIES = {
    "llama": Family("LlamaForCausalLM", {}, "none", _LLAMA_DEFAULTS),
    "mistral": Family("MistralForCausalLM", {}, "uniform", _MISTRAL_DEFAULTS),
    "mixtral": Family("MixtralForCausalLM", {}, "uniform",
                      {**_MISTRAL_DEFAULTS, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
                       "num_local_experts": 8, "num_experts_per_tok": 2}),
    "qwen2": Family("Qwen2ForCausalLM", {"qkv_bias": True}, "per_layer", _QWEN_DEFAULTS),
    "qwen3": Family("Qwen3ForCausalLM", {"qk_norm": "head"}, "per_layer", {**_QWEN_DEFAULTS, "head_dim": 128}),
    "gemma2": Family("Gemma2ForCausalLM", _GEMMA, "per_layer", _GEMMA_DEFAULTS),
    "gemma3_text": Family("Gemma3ForCausalLM", {**_GEMMA, "qk_norm": "head"}, "per_layer",
                          {**_GEMMA_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
                           "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_theta": 1e6,
                           "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", {"qk_norm": "head"}, "uniform",
                        {**_QWEN_DEFAULTS, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                         "num_hidden_layers": 24, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                         "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                         "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": []}),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", {"attention_type": "mla"}, "none", _DEEPSEEK_DEFAULTS),
    "olmo2": Family("Olmo2ForCausalLM", {"norm_position": "post", "qk_norm": "proj"}, "none",
                    {**_LLAMA_DEFAULTS, "vocab_size": 50304, "rms_norm_eps": 1e-5}),
}
_WRAPPERS = {"gemma3": "gemma3_text"}  # multimodal model_type -> its text decoder's, nested under text_config
_HF_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}  # layer_types entries -> meshlm's


def _refuse(field, value, why):
  raise ValueError(f"Hugging Face config field {field}={value!r} is not supported by meshlm: {why}")


def _decoder_config(hf: Mapping[str, Any]) -> tuple[dict, str]:
  """(the decoder's config dict, its model_type); Gemma 3's multimodal config nests it under text_config, tied to
  the embedding as the top level says (transformers ties by the outer config)."""
  model_type = hf.get("model_type")
  if model_type in _WRAPPERS:
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", _WRAPPERS[model_type]) != _WRAPPERS[model_type]:
      _refuse("text_config.model_type", text["model_type"], f"{model_type}'s decoder is {_WRAPPERS[model_type]}")
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    return text, _WRAPPERS[model_type]
  if model_type not in FAMILIES:
    _refuse("model_type", model_type, f"meshlm reads {', '.join([*FAMILIES, *_WRAPPERS])}")
  return dict(hf), model_type


def _refuse_unsupported(hf: Mapping[str, Any], model_type: str, get: Callable[[str], Any]) -> None:
  """ValueError naming a field that changes the function in a way meshlm's transformer cannot follow."""
  if get("attention_bias") and model_type != "qwen2":  # Qwen2's q/k/v biases are always there (qkv_bias)
    _refuse("attention_bias", hf["attention_bias"], "meshlm has biases on q, k and v only (Qwen2's layout, "
            "model.qkv_bias), not on the output projection")
  if hf.get("mlp_bias"):
    _refuse("mlp_bias", hf["mlp_bias"], "meshlm's MLPs have no biases")
  if get("attention_dropout"):
    _refuse("attention_dropout", hf["attention_dropout"], "meshlm has no dropout")
  if hf.get("use_bidirectional_attention"):
    _refuse("use_bidirectional_attention", hf["use_bidirectional_attention"], "meshlm's decoder attends causally")
  if model_type == "mixtral" and hf.get("router_jitter_noise", 0.0):
    _refuse("router_jitter_noise", hf["router_jitter_noise"], "meshlm's router has no jitter")
  if model_type == "gemma3_text" and hf.get("attn_logit_softcapping") is not None:
    _refuse("attn_logit_softcapping", hf["attn_logit_softcapping"], "transformers' Gemma 3 does not apply it, so "
            "no model.attn_logit_softcap would give its logits")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    _refuse("partial_rotary_factor", hf["partial_rotary_factor"], "RoPE rotates the whole head")
  field = "hidden_activation" if model_type.startswith("gemma") else "hidden_act"
  if get(field) not in _ACTIVATIONS:
    _refuse(field, get(field), f"supported: {', '.join(_ACTIVATIONS)}")


def config_from_hf(hf: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """The meshlm `config.model` (validated) for a Hugging Face config.json dict of a family in FAMILIES, or of
  Gemma 3's multimodal model (its text decoder). A field meshlm cannot represent raises ValueError naming it."""
  hf, model_type = _decoder_config(hf)
  family = FAMILIES[model_type]
  get = lambda field: hf.get(field, family.defaults.get(field))
  _refuse_unsupported(hf, model_type, get)
  heads, d_model, num_layers = int(get("num_attention_heads")), int(get("hidden_size")), int(get("num_hidden_layers"))
  cfg = config_lib.default_model_config()
  cfg.update(family.keys)
  if model_type.startswith("gemma"):
    cfg.update(query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
               final_logit_softcap=float(get("final_logit_softcapping") or 0.0),
               attn_logit_softcap=float(get("attn_logit_softcapping") or 0.0))  # Gemma 3's is refused when set
  kinds, window = _layer_kinds(hf, model_type, get, num_layers)
  cfg.update(
      vocab_size=int(get("vocab_size")), d_model=d_model, num_layers=num_layers, num_heads=heads,
      num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim") or d_model // heads),
      mlp_dim=int(get("intermediate_size")),
      mlp_type=_ACTIVATIONS[get("hidden_activation" if model_type.startswith("gemma") else "hidden_act")],
      norm_type="rmsnorm", norm_eps=float(get("rms_norm_eps")), use_bias=False,
      max_seq_len=int(get("max_position_embeddings")), global_every=0, block_type="sequential",
      tie_embeddings=bool(get("tie_word_embeddings")), init_std=float(get("initializer_range")),
      **_window_keys(kinds, window), **_rope_keys(hf, model_type, get, kinds))
  if model_type in _MOE_READERS:  # the experts (and DeepSeek's MLA): keys beyond the common fields
    cfg.update(_MOE_READERS[model_type](hf, get, num_layers))
  return config_lib.validate(cfg)


def _mixtral_keys(hf: Mapping[str, Any], get: Callable[[str], Any], num_layers: int) -> dict:
  """Mixtral: top-k softmax experts `intermediate_size` wide in every layer."""
  del hf, num_layers
  return dict(num_experts=int(get("num_local_experts")), experts_per_token=int(get("num_experts_per_tok")),
              expert_mlp_dim=int(get("intermediate_size")), moe_every=1, num_shared_experts=0, capacity_factor=0.0,
              router="topk_softmax")


def _qwen3_moe_keys(hf: Mapping[str, Any], get: Callable[[str], Any], num_layers: int) -> dict:
  """Qwen3-MoE's experts: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
  (meshlm: moe_every, and mlp_only_layers = the first k layers as first_dense_layers); softmax router, its top k
  renormalised with norm_topk_prob (= topk_softmax) or not (softmax_topk)."""
  step, dense = int(get("decoder_sparse_step")), sorted(get("mlp_only_layers") or [])
  if dense and (dense != list(range(len(dense))) or step != 1):
    _refuse("mlp_only_layers", dense, "meshlm keeps dense layers only as the first k (model.first_dense_layers) "
            "with decoder_sparse_step=1")
  experts = hf.get("num_local_experts", get("num_experts"))  # transformers 5 writes num_experts as num_local_experts
  return dict(num_experts=int(experts), experts_per_token=int(get("num_experts_per_tok")),
              expert_mlp_dim=int(get("moe_intermediate_size")), moe_every=step, first_dense_layers=len(dense),
              router="topk_softmax" if get("norm_topk_prob") else "softmax_topk")


def _deepseek_v3_keys(hf: Mapping[str, Any], get: Callable[[str], Any], num_layers: int) -> dict:
  """DeepSeek-V3: MLA widths (every head its own keys; head_dim is the rotated width), sigmoid routing with its
  score bias, groups and scale, shared experts, the first k layers dense; transformers applies YaRN's
  mscale_all_dim to the softmax scale (rope_mscale_all_dim)."""
  rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  mscale_all_dim = float(rope.get("mscale_all_dim") or 0.0) if _rope_type(rope) == "yarn" else 0.0
  return dict(attention_type="mla", num_kv_heads=int(get("num_attention_heads")),
              head_dim=int(get("qk_rope_head_dim")), q_lora_rank=int(get("q_lora_rank") or 0), kv_lora_rank=int(get("kv_lora_rank")),
              qk_nope_head_dim=int(get("qk_nope_head_dim")), qk_rope_head_dim=int(get("qk_rope_head_dim")),
              v_head_dim=int(get("v_head_dim")), rope_interleave=bool(get("rope_interleave")),
              rope_mscale_all_dim=mscale_all_dim,
              num_experts=int(get("n_routed_experts")), experts_per_token=int(get("num_experts_per_tok")),
              expert_mlp_dim=int(get("moe_intermediate_size")), num_shared_experts=int(get("n_shared_experts") or 0),
              router="sigmoid", router_norm_topk=bool(get("norm_topk_prob")),
              routed_scaling_factor=float(get("routed_scaling_factor")), router_groups=int(get("n_group") or 1),
              router_topk_groups=int(get("topk_group") or 1),
              first_dense_layers=_first_dense(int(get("first_k_dense_replace") or 0), num_layers), moe_every=1,
              mtp_depth=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0))


def _first_dense(k: int, num_layers: int) -> int:
  if not 0 <= k < num_layers:
    _refuse("first_k_dense_replace", k, f"meshlm's DeepSeek-V3 has at least one MoE layer ({num_layers} layers)")
  return k


_MOE_READERS = {"mixtral": _mixtral_keys, "qwen3_moe": _qwen3_moe_keys, "deepseek_v3": _deepseek_v3_keys}


def _layer_kinds(hf: Mapping[str, Any], model_type: str, get: Callable[[str], Any],
                 num_layers: int) -> tuple[list[str], int | None]:
  """Each layer's attention ("sliding" / "full") and the window, as transformers builds them for the family:
  `layer_types`, else Qwen's use_sliding_window + max_window_layers (layers from max_window_layers on slide), Gemma
  2's alternation (even layers slide) or Gemma 3's sliding_window_pattern (every pattern-th layer is full)."""
  windows, qwen = FAMILIES[model_type].windows, model_type in ("qwen2", "qwen3", "qwen3_moe")
  window = None if windows == "none" else get("sliding_window")
  if qwen and not get("use_sliding_window"):
    window = None  # Qwen's config drops the window unless use_sliding_window
  if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
    _refuse("sliding_window", window, "a window is a positive number of tokens")
  types = hf.get("layer_types")
  if windows != "per_layer":
    if types and len(set(types)) > 1:
      _refuse("layer_types", types, f"transformers' {model_type} gives every layer the same attention")
    return ["sliding" if window else "full"] * num_layers, window
  if types is None and qwen:
    first = int(get("max_window_layers"))
    types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]
  elif types is None:
    pattern = 2 if model_type == "gemma2" else hf.get("sliding_window_pattern",
                                                     hf.get("_sliding_window_pattern", get("sliding_window_pattern")))
    if not isinstance(pattern, int) or pattern < 1:
      _refuse("sliding_window_pattern", pattern, "a positive number of layers")
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
  if len(types) != num_layers or any(t not in _HF_KINDS for t in types):
    _refuse("layer_types", types, f"one of {', '.join(_HF_KINDS)} per layer ({num_layers} layers)")
  kinds = [_HF_KINDS[t] for t in types]
  if "sliding" in kinds and window is None:
    _refuse("sliding_window", window, "layer_types has sliding_attention layers but no window is set"
            + (" (use_sliding_window is false)" if qwen else ""))
  return kinds, window


def _period(kinds: Sequence[str]) -> tuple[str, ...]:
  """The shortest prefix of `kinds` whose repetition gives `kinds` (model.layer_types repeats its tuple)."""
  n = len(kinds)
  return next(tuple(kinds[:p]) for p in range(1, n + 1) if n % p == 0 and list(kinds) == list(kinds[:p]) * (n // p))


def _window_keys(kinds: Sequence[str], window: int | None) -> dict:
  """meshlm sliding_window / layer_types for per-layer kinds: one window everywhere needs no layer_types."""
  if "sliding" not in kinds:
    return {"sliding_window": 0, "layer_types": ()}
  return {"sliding_window": int(window), "layer_types": _period(kinds) if "full" in kinds else ()}


def _rope_type(rope: Mapping[str, Any]) -> str:
  return rope.get("rope_type", rope.get("type", "default"))


def _rope_keys(hf: Mapping[str, Any], model_type: str, get: Callable[[str], Any], kinds: Sequence[str]) -> dict:
  """meshlm rope keys from transformers 5's `rope_parameters` (nested per layer type for Gemma 3) or the 4.x fields
  (`rope_theta`, `rope_scaling`; Gemma 3's `rope_local_base_freq`), resolved as transformers 5 resolves them."""
  params = dict(hf.get("rope_parameters") or {})
  nested = [k for k in params if k in _HF_KINDS]
  if model_type != "gemma3_text":
    if nested:
      _refuse("rope_parameters", params, "RoPE per layer type is Gemma 3's (model.rope_local_theta)")
    rope = dict(hf.get("rope_scaling") or params)  # transformers 5 takes the 4.x rope_scaling over rope_parameters
    rope.setdefault("rope_theta", get("rope_theta"))
    return _scaled_rope(rope, hf, get, "rope_scaling" if hf.get("rope_scaling") else "rope_parameters", flat=True)
  if params and not nested:
    _refuse("rope_parameters", params, "Gemma 3's RoPE is nested per layer type ({'full_attention': {...}, "
            "'sliding_attention': {...}})")
  full = dict(params.get("full_attention") or {"rope_type": "default"})
  full.update(hf.get("rope_scaling") or {})  # the 4.x field scales the full layers
  full.setdefault("rope_theta", get("rope_theta"))
  local = dict(params.get("sliding_attention") or {"rope_type": "default"})
  local.setdefault("rope_theta", get("rope_local_base_freq"))
  out = {"rope_theta": float(full["rope_theta"]), "rope_scaling": "none"}
  if "full" in kinds:
    out = _scaled_rope(full, hf, get, "rope_parameters.full_attention", flat=False)
  if "sliding" in kinds:
    if _rope_type(local) != "default":
      _refuse("rope_parameters.sliding_attention.rope_type", _rope_type(local),
              "meshlm's sliding layers (model.rope_local_theta) use unscaled RoPE")
    if local.get("partial_rotary_factor", 1.0) != 1.0:
      _refuse("rope_parameters.sliding_attention.partial_rotary_factor", local["partial_rotary_factor"],
              "RoPE rotates the whole head")
    out["rope_local_theta"] = float(local["rope_theta"])
  return out


def _scaled_rope(rope: Mapping[str, Any], hf: Mapping[str, Any], get: Callable[[str], Any], field: str,
                 flat: bool) -> dict:
  """meshlm rope_theta / rope_scaling keys for one transformers RoPE dict (`field` names it in errors; `flat`: not
  nested per layer type, where a top-level original_max_position_embeddings wins, as transformers 5 has it)."""
  kind = _rope_type(rope)
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    _refuse(f"{field}.partial_rotary_factor", rope["partial_rotary_factor"], "RoPE rotates the whole head")
  max_len = int(get("max_position_embeddings"))
  original = int(hf["original_max_position_embeddings"] if flat and "original_max_position_embeddings" in hf
                 else rope.get("original_max_position_embeddings") or max_len)
  out = {"rope_theta": float(rope["rope_theta"]), "rope_scaling": "none"}
  if kind == "linear":
    out.update(rope_scaling="linear", rope_scaling_factor=float(rope["factor"]))
  elif kind == "dynamic":  # transformers grows the base past max_position_embeddings (not the original length)
    out.update(rope_scaling="dynamic", rope_scaling_factor=float(rope["factor"]), rope_original_max_len=max_len)
  elif kind == "llama3":
    out.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
               rope_low_freq_factor=float(rope["low_freq_factor"]),
               rope_high_freq_factor=float(rope["high_freq_factor"]), rope_original_max_len=original)
  elif kind == "yarn":
    out.update(_yarn_keys(rope, original, max_len, field, truncate=rope.get("truncate", True) if flat else True))
  elif kind != "default":
    _refuse(f"{field}.rope_type", kind, "meshlm's RoPE is default, linear, dynamic, yarn or llama3 "
            "(model.rope_scaling)")
  return out


def _yarn_keys(rope: Mapping[str, Any], original: int, max_len: int, field: str, truncate: bool) -> dict:
  """meshlm yarn keys as transformers' `_compute_yarn_parameters` reads its dict (truncate: transformers reads it
  from the top level of rope_parameters, so a dict nested per layer type always truncates)."""
  factor = float(rope.get("factor") or max_len / original)  # no factor: the ratio of the two lengths
  attention = rope.get("attention_factor")
  if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):  # DeepSeek's form
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
  if attention is not None and not attention > 0:
    _refuse(f"{field}.attention_factor", attention, "a positive factor on cos and sin")
  return dict(rope_scaling="yarn", rope_scaling_factor=factor, rope_original_max_len=original,
              rope_yarn_beta_fast=float(rope.get("beta_fast") or 32),
              rope_yarn_beta_slow=float(rope.get("beta_slow") or 1),
              rope_attention_factor=float(attention or 0.0), rope_yarn_truncate=bool(truncate))


def family_of(cfg: Mapping[str, Any]) -> str:
  """The Hugging Face model_type that holds the model config `cfg`: the family whose keys (FAMILIES) it has; with
  Llama's layout, Mixtral with experts, Mistral with one window on every layer, else Llama."""
  have = {k: cfg[k] for k in _FAMILY_KEYS}
  fits = [t for t, f in FAMILIES.items() if have == {**_FAMILY_KEYS, **f.keys}]
  if not fits:
    layouts = "; ".join(f"{t}: {dict(f.keys) or 'the defaults'}" for t, f in FAMILIES.items() if t != "mistral")
    raise ValueError(f"model {', '.join(f'{k}={v!r}' for k, v in have.items())}: no Hugging Face family has this "
                     f"layout ({layouts})")
  base = fits[0]
  if cfg["num_experts"]:
    if base not in _MOE_FAMILIES:
      raise ValueError(f"model.num_experts={cfg['num_experts']} with {base}'s layout: Hugging Face holds experts in "
                       f"{', '.join(_MOE_FAMILIES.values())} only (the layouts of {', '.join(_MOE_FAMILIES)})")
    return _MOE_FAMILIES[base]
  if base == "deepseek_v3":
    raise ValueError("model.attention_type='mla' with model.num_experts=0: Hugging Face's DeepSeek-V3 (the family "
                     "holding MLA) has MoE layers")
  if base != "llama":
    return base
  return "mistral" if all(config_lib.layer_windows(cfg)) else "llama"


_MOE_FAMILIES = {"llama": "mixtral", "qwen3": "qwen3_moe", "deepseek_v3": "deepseek_v3"}  # dense layout -> MoE family


def config_to_hf(cfg: Mapping[str, Any]) -> dict:
  """The config.json dict for a model config, in the family `family_of` picks, with its model_type and
  architectures (so AutoModelForCausalLM loads that class). Keys the family cannot hold raise ValueError."""
  cfg = config_lib.validate(cfg)
  checks = {"norm_type": "rmsnorm", "block_type": "sequential", "use_bias": False}
  for key, want in checks.items():
    if cfg[key] != want:
      raise ValueError(f"model.{key}={cfg[key]!r} has no Hugging Face equivalent (needs {want!r})")
  if cfg.mlp_type not in config_lib.GATED:
    raise ValueError(f"model.mlp_type={cfg.mlp_type!r} has no Hugging Face equivalent (swiglu or geglu)")
  model_type = family_of(cfg)
  gemma = model_type.startswith("gemma")
  _check_family_extras(cfg, model_type)
  if cfg.mtp_depth and model_type != "deepseek_v3":
    raise ValueError(f"model.mtp_depth={cfg.mtp_depth} has no Hugging Face {model_type} equivalent: only DeepSeek-V3 "
                     "checkpoints hold multi-token-prediction layers")
  kinds = ["sliding" if w else "full" for w in config_lib.layer_windows(cfg)]
  hf = {
      "architectures": [FAMILIES[model_type].architecture], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_activation" if gemma else "hidden_act": "silu" if cfg.mlp_type == "swiglu" else "gelu_pytorch_tanh",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
      "attention_bias": False, "attention_dropout": 0.0,
      "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
      **_windows_to_hf(cfg, model_type, kinds), **_rope_to_hf(cfg, model_type, kinds),
  }
  if gemma:
    hf.update(query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar or cfg.head_dim),
              final_logit_softcapping=cfg.final_logit_softcap or None,
              attn_logit_softcapping=cfg.attn_logit_softcap or None, use_bidirectional_attention=False)
  if model_type == "llama":
    hf["mlp_bias"] = False
  if model_type in _MOE_WRITERS:
    hf.update(_MOE_WRITERS[model_type](cfg))
  return hf


def _require(cfg, model_type: str, wants: Mapping[str, Any]) -> None:
  for key, want in wants.items():
    if cfg[key] != want:
      raise ValueError(f"model.{key}={cfg[key]!r} has no Hugging Face {model_type} equivalent (needs {want!r})")


def _mixtral_to_hf(cfg) -> dict:
  _require(cfg, "Mixtral", {"moe_every": 1, "num_shared_experts": 0, "capacity_factor": 0.0, "router": "topk_softmax",
                            "mlp_type": "swiglu", "first_dense_layers": 0, **_NO_DEEPSEEK_ROUTING})
  return dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, router_jitter_noise=0.0, output_router_logits=False)


def _qwen3_moe_to_hf(cfg) -> dict:
  _require(cfg, "Qwen3-MoE", {"num_shared_experts": 0, "capacity_factor": 0.0, "mlp_type": "swiglu",
                              **_NO_DEEPSEEK_ROUTING})
  if cfg.router not in ("topk_softmax", "softmax_topk"):
    raise ValueError(f"model.router={cfg.router!r} has no Hugging Face Qwen3-MoE equivalent (topk_softmax or "
                     "softmax_topk)")
  if cfg.first_dense_layers and cfg.moe_every != 1:
    raise ValueError("model.first_dense_layers with model.moe_every > 1 has no Hugging Face Qwen3-MoE equivalent")
  return dict(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, decoder_sparse_step=cfg.moe_every,
              mlp_only_layers=list(range(cfg.first_dense_layers)), norm_topk_prob=cfg.router == "topk_softmax",
              output_router_logits=False, router_aux_loss_coef=0.0)


def _deepseek_v3_to_hf(cfg) -> dict:
  _require(cfg, "DeepSeek-V3", {"router": "sigmoid", "capacity_factor": 0.0, "moe_every": 1, "mlp_type": "swiglu",
                                "num_kv_heads": cfg.num_heads, "head_dim": cfg.qk_rope_head_dim})
  if cfg.rope_mscale_all_dim and cfg.rope_scaling != "yarn":
    raise ValueError("model.rope_mscale_all_dim needs model.rope_scaling='yarn' in Hugging Face DeepSeek-V3")
  return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
             moe_intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, n_shared_experts=cfg.num_shared_experts,
             routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.router_groups,
             topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.router_norm_topk,
             first_k_dense_replace=cfg.first_dense_layers, q_lora_rank=cfg.q_lora_rank or None,
             kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
             qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave,
             num_nextn_predict_layers=cfg.mtp_depth)


# Keys of DeepSeek's routing that the softmax families cannot hold, at their off values.
_NO_DEEPSEEK_ROUTING = {"routed_scaling_factor": 1.0, "router_groups": 1, "router_topk_groups": 1}
_MOE_WRITERS = {"mixtral": _mixtral_to_hf, "qwen3_moe": _qwen3_moe_to_hf, "deepseek_v3": _deepseek_v3_to_hf}


def _number(x: float) -> int | float:
  """x as an int when whole (transformers' strict configs type some of these fields int)."""
  return int(x) if float(x).is_integer() else float(x)


def _check_family_extras(cfg, model_type: str) -> None:
  """ValueError for a key the family's config.json has no field for: Gemma's score scale and softcaps (the
  attention softcap is Gemma 2's: transformers' Gemma 3 ignores it), Gemma 3's RoPE base of the sliding layers."""
  gemma = model_type.startswith("gemma")
  fields = {"attn_logit_softcap": model_type == "gemma2", "final_logit_softcap": gemma,
            "query_pre_attn_scalar": gemma or cfg.query_pre_attn_scalar == cfg.head_dim}
  for key, held in fields.items():
    if cfg[key] and not held:
      owners = "Gemma 2's" if key == "attn_logit_softcap" else "Gemma 2's and Gemma 3's"
      raise ValueError(f"model.{key}={cfg[key]} has no field in Hugging Face {model_type}'s config (it is "
                       f"{owners}); set it to 0 or use that family's layout")
  if cfg.rope_local_theta and any(config_lib.layer_windows(cfg)) and model_type != "gemma3_text":
    raise ValueError(f"model.rope_local_theta={cfg.rope_local_theta} has no field in Hugging Face {model_type}'s "
                     "config: only Gemma 3 gives its sliding layers their own RoPE base")
  if model_type == "gemma3_text" and cfg.rope_scaling == "yarn" and not cfg.rope_yarn_truncate:
    raise ValueError("model.rope_yarn_truncate=False has no Hugging Face Gemma 3 equivalent (transformers reads "
                     "`truncate` from the top of rope_parameters, which Gemma 3 nests per layer type)")


def _windows_to_hf(cfg, model_type: str, kinds: Sequence[str]) -> dict:
  """config.json's window fields for per-layer kinds: Mistral/Mixtral hold one window on every layer, Qwen and
  Gemma a layer_types list; Llama and OLMo 2 have no window."""
  windows, sliding = FAMILIES[model_type].windows, "sliding" in kinds
  if windows != "per_layer" and sliding and ("full" in kinds or windows == "none"):
    raise ValueError(f"model.sliding_window={cfg.sliding_window} (layer_types={tuple(cfg.layer_types)}, "
                     f"global_every={cfg.global_every}): Hugging Face {model_type} cannot hold these windows (Llama "
                     "and OLMo 2 have none, Mistral and Mixtral one on every layer; Qwen and Gemma take a "
                     "layer_types list)")
  if windows == "none":
    return {}
  if windows == "uniform":
    out = {"sliding_window": cfg.sliding_window if sliding else None}
    return {**out, "use_sliding_window": sliding} if model_type == "qwen3_moe" else out
  qwen = model_type.startswith("qwen")
  out = {"layer_types": [f"{k}_attention" for k in kinds],
         # Gemma builds the sliding mask even with no sliding layer, so it needs some window.
         "sliding_window": cfg.sliding_window if sliding else None if qwen else cfg.max_seq_len}
  if qwen:  # transformers 4.x's form (layers from max_window_layers on slide)
    out.update(use_sliding_window=sliding, max_window_layers=kinds.index("sliding") if sliding else cfg.num_layers)
  return out


def _rope_dict(cfg) -> dict:
  """transformers' RoPE dict (rope_parameters) for rope_theta and rope_scaling."""
  rope = {"rope_type": cfg.rope_scaling if cfg.rope_scaling != "none" else "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling != "none":
    rope["factor"] = cfg.rope_scaling_factor
  if cfg.rope_scaling == "llama3":
    rope.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_len)
  elif cfg.rope_scaling == "yarn":
    rope.update(original_max_position_embeddings=cfg.rope_original_max_len, beta_fast=cfg.rope_yarn_beta_fast,
                beta_slow=cfg.rope_yarn_beta_slow, truncate=cfg.rope_yarn_truncate)
    if cfg.rope_attention_factor:
      rope["attention_factor"] = cfg.rope_attention_factor
    if cfg.rope_mscale_all_dim:  # DeepSeek's softmax scale (transformers' yarn_apply_mscale)
      rope["mscale_all_dim"] = cfg.rope_mscale_all_dim
  elif cfg.rope_scaling == "dynamic" and cfg.rope_original_max_len != cfg.max_seq_len:
    raise ValueError(f"model.rope_scaling='dynamic' with model.rope_original_max_len={cfg.rope_original_max_len} != "
                     f"model.max_seq_len={cfg.max_seq_len}: transformers' dynamic scaling grows the base past "
                     "max_position_embeddings (written from max_seq_len); set them equal")
  return rope


def _rope_to_hf(cfg, model_type: str, kinds: Sequence[str]) -> dict:
  """config.json's RoPE fields: rope_parameters (and the 4.x rope_theta / rope_scaling); Gemma 3's nested per
  layer type, its sliding layers on rope_local_theta unscaled (or, without it, like the full ones)."""
  rope = _rope_dict(cfg)
  if model_type == "gemma3_text":
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta} if cfg.rope_local_theta else rope
    return {"rope_parameters": {"full_attention": rope, "sliding_attention": dict(local)}}
  out = {"rope_theta": cfg.rope_theta, "rope_parameters": rope}
  if cfg.rope_scaling != "none":
    out["rope_scaling"] = rope
  return out


def _ranges(index: tuple, shape: Sequence[int]) -> list[range]:
  return [range(*sl.indices(n)) for sl, n in zip(index, shape)]


def _flat_index(ranges: Sequence[range], shape: Sequence[int]):
  """Row-major flat positions of the block `ranges` of an array of `shape`, as a slice when contiguous."""
  if not ranges:
    return slice(0, 1)
  flat = np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), tuple(shape)).reshape(-1)
  if flat.size and flat[-1] - flat[0] + 1 == flat.size:
    return slice(int(flat[0]), int(flat[-1]) + 1)
  return flat


class Entry(NamedTuple):
  """One tensor of the two-way name table. `hf` may hold `{i}` (layer) and `{j}` (expert); `path` is the meshlm
  parameter path inside the model (`layers/...` paths: inside one layer; `{j}` entries: one expert's slice).
  `n_in` = 0: the HF tensor has meshlm's layout, or with `flat` is it flattened row-major (Qwen2's q/k/v biases,
  OLMo 2's q/k norms: HF [H*K] for meshlm [H, K]); n_in > 0: meshlm's einsum kernel [n_in input dims..., output
  dims...] is the HF Linear weight [out, in] (the dims of each side flattened row-major)."""
  hf: str
  path: str
  n_in: int
  flat: bool = False

  def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The HF tensor's shape for a meshlm tensor of `shape`."""
    if self.flat:
      return (int(np.prod(shape)),)
    if not self.n_in:
      return tuple(shape)
    return (int(np.prod(shape[self.n_in:])), int(np.prod(shape[:self.n_in])))

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    """meshlm array -> HF tensor."""
    if self.flat:
      return w.reshape(-1)
    return w.reshape(int(np.prod(w.shape[:self.n_in])), -1).T if self.n_in else w

  def read(self, reader: safetensors_io.Reader, name: str, shape: Sequence[int], index: tuple) -> np.ndarray:
    """The block `index` (one slice per dim) of the meshlm tensor of `shape` stored as HF tensor `name`, read
    from the files without reading the rest of the tensor (stored dtype)."""
    ranges = _ranges(index, shape)
    if self.flat:
      return reader.read(name, (_flat_index(ranges, shape),)).reshape([len(r) for r in ranges])
    if not self.n_in:
      return reader.read(name, tuple(slice(r.start, r.stop, r.step) for r in ranges))
    rows = _flat_index(ranges[self.n_in:], shape[self.n_in:])
    cols = _flat_index(ranges[:self.n_in], shape[:self.n_in])
    if isinstance(rows, slice) and isinstance(cols, slice):
      w = reader.read(name, (rows, cols))
    else:
      as_array = lambda ix: np.arange(ix.start, ix.stop) if isinstance(ix, slice) else ix
      w = reader.read(name, np.ix_(as_array(rows), as_array(cols)))
    return w.T.reshape([len(r) for r in ranges])


# Per model.norm_position: (HF norm of each layer, meshlm norm). Llama's post_attention_layernorm is the MLP's
# pre-norm; Gemma's and OLMo 2's normalises the attention output (a post-norm) -- hence one list per position.
_LAYER_NORMS = {
    "pre": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")),
    "sandwich": (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_post_norm"),
                 ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_post_norm")),
    "post": (("post_attention_layernorm", "attn_post_norm"), ("post_feedforward_layernorm", "mlp_post_norm")),
}


class Layout(NamedTuple):
  """Where a checkpoint keeps the decoder: the prefix of its tensors' names and the output projection's name."""
  prefix: str
  head: str


CAUSAL_LM = Layout("model.", "lm_head.weight")  # *ForCausalLM: what `save` writes
# Gemma 3's multimodal checkpoints hold the decoder beside a vision tower, which `load` leaves out: the Hub's (and
# transformers 5's) language_model.model.*, or model.language_model.* as transformers 4.52-4.57 wrote them.
_LAYOUTS = (CAUSAL_LM, Layout("model.language_model.", "lm_head.weight"),
            Layout("language_model.model.", "language_model.lm_head.weight"))


def name_table(cfg, layout: Layout = CAUSAL_LM) -> list[Entry]:
  """The one table from Hugging Face names to meshlm parameters, used by both `load` and `save`.

  Attention is `self_attn.{q,k,v,o}_proj` (+ `.bias` on q/k/v with model.qkv_bias, `self_attn.{q,k}_norm` with
  model.qk_norm), the layer norms by model.norm_position (_LAYER_NORMS). Llama/Mistral MLPs are
  `mlp.{gate,up,down}_proj`; Mixtral's MoE is `block_sparse_moe.gate` (router [E, D]) and
  `block_sparse_moe.experts.{j}.w1/w3/w2` (gate/up [F, D], down [D, F]).
  """
  layer = layout.prefix + "layers.{i}."
  attn = layer + "self_attn."
  table = [
      Entry(layout.prefix + "embed_tokens.weight", "embed/embedding", 0),
      Entry(layout.prefix + "norm.weight", "final_norm/scale", 0),
      *(_mla_entries(cfg, attn) if cfg.attention_type == "mla" else
        [Entry(attn + f"{p}_proj.weight", f"layers/attn/{p}", 1) for p in "qkv"]),
      Entry(attn + "o_proj.weight", "layers/attn/o", 2),
  ]
  table += [Entry(f"{layer}{theirs}.weight", f"layers/{ours}/scale", 0) for theirs, ours in
            _LAYER_NORMS[cfg.norm_position]]
  if cfg.qkv_bias:
    table += [Entry(f"{attn}{p}_proj.bias", f"layers/attn/{p}_bias", 0, flat=True) for p in "qkv"]
  if cfg.qk_norm != "none":  # "head": one [K] scale; "proj": [H, K] / [G, K] over the whole projection
    table += [Entry(f"{attn}{p}_norm.weight", f"layers/attn/{p}_norm/scale", 0, flat=cfg.qk_norm == "proj")
              for p in "qk"]
  if not cfg.tie_embeddings:
    table.append(Entry(layout.head, "unembed", 1))
  if cfg.num_experts and family_of(cfg) == "mixtral":
    moe = layer + "block_sparse_moe"
    table += [Entry(f"{moe}.gate.weight", "layers/moe/router", 1),
              Entry(f"{moe}.experts.{{j}}.w1.weight", "layers/moe/gate", 1),
              Entry(f"{moe}.experts.{{j}}.w3.weight", "layers/moe/up", 1),
              Entry(f"{moe}.experts.{{j}}.w2.weight", "layers/moe/down", 1)]
  elif cfg.num_experts:  # Qwen3-MoE, DeepSeek-V3: mlp.gate (+ its score bias), mlp.experts.{j}.*_proj
    moe = layer + "mlp."
    table += [Entry(f"{moe}gate.weight", "layers/moe/router", 1)]
    table += [Entry(f"{moe}experts.{{j}}.{p}_proj.weight", f"layers/moe/{p}", 1) for p in ("gate", "up", "down")]
    if cfg.router == "sigmoid":
      table.append(Entry(f"{moe}gate.e_score_correction_bias", "layers/moe/score_bias", 0))
    if cfg.num_shared_experts:
      table += [Entry(f"{moe}shared_experts.{p}_proj.weight", f"layers/moe/shared/{p}", 1)
                for p in ("gate", "up", "down")]
  if not cfg.num_experts or config_lib.dense_prefix(cfg) or cfg.moe_every > 1:  # the dense layers' MLPs
    table += [Entry(layer + "mlp.up_proj.weight", "layers/mlp/up", 1),
              Entry(layer + "mlp.down_proj.weight", "layers/mlp/down", 1)]
    if cfg.mlp_type in config_lib.GATED:
      table.append(Entry(layer + "mlp.gate_proj.weight", "layers/mlp/gate", 1))
  return table


def _mla_entries(cfg, attn: str) -> list[Entry]:
  """DeepSeek's MLA projections: q_proj or q_a_proj + q_a_layernorm + q_b_proj, kv_a_proj_with_mqa +
  kv_a_layernorm + kv_b_proj (each Linear [out, in] to meshlm's [in, heads, width] kernels)."""
  if cfg.q_lora_rank:
    q = [Entry(attn + "q_a_proj.weight", "layers/attn/q_a", 1),
         Entry(attn + "q_a_layernorm.weight", "layers/attn/q_a_norm/scale", 0),
         Entry(attn + "q_b_proj.weight", "layers/attn/q_b", 1)]
  else:
    q = [Entry(attn + "q_proj.weight", "layers/attn/q", 1)]
  return q + [Entry(attn + "kv_a_proj_with_mqa.weight", "layers/attn/kv_a", 1),
              Entry(attn + "kv_a_layernorm.weight", "layers/attn/kv_a_norm/scale", 0),
              Entry(attn + "kv_b_proj.weight", "layers/attn/kv_b", 1)]


def layout_of(reader: safetensors_io.Reader) -> Layout:
  """The layout whose embedding the files hold (the plain *ForCausalLM one when none: then named as missing)."""
  return next((lay for lay in _LAYOUTS if lay.prefix + "embed_tokens.weight" in reader), CAUSAL_LM)


# meshlm model keys that fix parameter shapes, with the Hugging Face config field of each.
SHAPE_FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
                "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "mlp_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
                "num_experts": "num_local_experts", "expert_mlp_dim": "intermediate_size",
                # which parameters exist: q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3, OLMo 2), post-norms
                "qkv_bias": "model_type", "qk_norm": "model_type", "norm_position": "model_type",
                # MoE layers and MLA (DeepSeek-V3, Qwen3-MoE)
                "first_dense_layers": "first_k_dense_replace", "num_shared_experts": "n_shared_experts",
                "moe_every": "decoder_sparse_step", "router": "model_type", "attention_type": "model_type",
                "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
                "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
                "mtp_depth": "num_nextn_predict_layers"}


def shape_mismatch(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
  """The shape-determining model keys on which two model configs differ, as 'key: A vs B' strings."""
  return [f"model.{k} ({hf_name}): {want[k]!r} vs {have[k]!r}" for k, hf_name in SHAPE_FIELDS.items()
          if want[k] != have[k]]


def check_compatible(cfg_model: Mapping[str, Any], path: str) -> None:
  """Raises ValueError naming every shape-determining field where `cfg_model` and the Hugging Face directory
  `path`'s config.json disagree (both values), so a mismatch reads as config fields, not tensor shapes."""
  with open(os.path.join(path, "config.json")) as f:
    theirs = config_from_hf(json.load(f))
  diff = shape_mismatch(config_lib.validate(cfg_model), theirs)
  if diff:
    raise ValueError(f"{path}: the Hugging Face model does not fit config.model; differing fields (config.model vs "
                     f"config.json): {'; '.join(diff)}")


def _layer_slots(model, cfg) -> list[tuple[Any, int | None]]:
  """Per layer i: (the module holding layer i's parameters, index into their leading stacked dim or None)."""
  if not cfg.scan_layers:
    return [(block, None) for block in model.layers]
  unit, prefix = config_lib.layers_per_unit(cfg), config_lib.dense_prefix(cfg)
  slots = [(model.dense_layers, i) for i in range(prefix)]
  if unit == 1:
    return slots + [(model.layers, i) for i in range(cfg.num_layers - prefix)]
  return slots + [(model.layers.blocks[i % unit], i // unit) for i in range(cfg.num_layers - prefix)]


def _entries(model, cfg, layout: Layout = CAUSAL_LM):
  """Yields (table entry, HF name, variable, index of the tensor inside the variable) for every HF tensor; the
  index selects the layer in stacked parameters and the expert for `{j}` names (() = the whole variable)."""
  slots = _layer_slots(model, cfg)
  moe = [config_lib.is_moe_layer(cfg, i) for i in range(cfg.num_layers)]
  # DeepSeek's multi-token heads are layers num_layers + d of its checkpoints: a block, then their own tensors
  slots += [(head.block, None) for head in (model.mtp if cfg.mtp_depth else ())]
  moe += [bool(cfg.num_experts)] * cfg.mtp_depth
  for e in name_table(cfg, layout):
    if not e.path.startswith("layers/"):
      yield e, e.hf, _get(model, e.path), ()
      continue
    for i, ((holder, stacked), is_moe) in enumerate(zip(slots, moe)):
      kind = "moe" if "layers/moe/" in e.path else "mlp" if "layers/mlp/" in e.path else None
      if kind and (kind == "moe") != is_moe:  # an MLP entry on an MoE layer or the reverse
        continue
      var = _get(holder, e.path[len("layers/"):])
      index = () if stacked is None else (stacked,)
      if "{j}" in e.hf:
        for j in range(cfg.num_experts):
          yield e, e.hf.format(i=i, j=j), var, index + (j,)
      else:
        yield e, e.hf.format(i=i), var, index
  for d in range(cfg.mtp_depth):
    for e in _mtp_entries(layout, cfg.num_layers + d):
      yield e, e.hf, _get(model.mtp[d], e.path), ()


def _mtp_entries(layout: Layout, i: int) -> list[Entry]:
  """A multi-token head's own tensors at checkpoint layer i (paths inside model.layers.MultiTokenHead): enorm,
  hnorm, eh_proj ([D, 2D]: the embedding's half first) and shared_head.norm. The layer's embed_tokens and
  shared_head.head are copies of the main model's (MTP_SHARED), not read."""
  at = f"{layout.prefix}layers.{i}."
  return [Entry(at + "enorm.weight", "enorm/scale", 0), Entry(at + "hnorm.weight", "hnorm/scale", 0),
          Entry(at + "eh_proj.weight", "proj", 2), Entry(at + "shared_head.norm.weight", "norm/scale", 0)]


MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # an MTP layer's copies of the shared tensors


def _get(tree, path: str):
  for part in path.split("/"):
    tree = getattr(tree, part)
  return tree


def _progress(desc: str, enabled: bool, total: int | None = None) -> Callable[[Iterable], Iterable]:
  """A tqdm bar over an iterable on process 0 when `enabled` and stderr is a terminal."""
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  on = enabled and jax.process_index() == 0
  return lambda it: tqdm(it, desc=desc, unit="tensor", total=total, disable=None if on else True,
                         dynamic_ncols=True)


def _plan_reads(path: str, reader: safetensors_io.Reader, model, cfg) -> dict[int, tuple[Any, list]]:
  """id(variable) -> (variable, [(index inside the variable, table entry, HF name)]) for every parameter,
  checked against the files' headers before any data is read: a missing tensor, a shape that disagrees with
  config.json or a tensor meshlm does not map raises ValueError naming it. Of a multimodal checkpoint only the
  decoder's tensors count (the other towers are not loaded)."""
  plan: dict[int, tuple[Any, list]] = {}
  used = set()
  layout = layout_of(reader)
  for entry, name, var, index in _entries(model, cfg, layout):
    if name not in reader:
      raise ValueError(f"{path}: tensor {name!r} missing from the safetensors files")
    used.add(name)
    want = entry.hf_shape(var.shape[len(index):])
    if tuple(reader.shape(name)) != want:
      fields = ", ".join(f"{h}={cfg[k]}" for k, h in SHAPE_FIELDS.items() if h != "model_type")
      raise ValueError(f"{path}: tensor {name!r} has shape {list(reader.shape(name))} but config.json implies "
                       f"{list(want)} ({fields}); the weights and config.json disagree")
    plan.setdefault(id(var), (var, []))[1].append((index, entry, name))
  decoder = lambda n: layout == CAUSAL_LM or n.startswith(layout.prefix)
  empty = lambda n: not np.prod(reader.shape(n))  # DeepSeek-V3 with n_shared_experts=0 writes [0, D] experts
  shared = {f"{layout.prefix}layers.{cfg.num_layers + d}.{t}" for d in range(cfg.mtp_depth) for t in MTP_SHARED}
  unused = sorted(n for n in set(reader.names()) - used - {layout.head} - shared  # tied: the head may be there
                  if decoder(n) and not empty(n))
  if unused:
    raise ValueError(f"{path}: tensors meshlm does not map: {', '.join(unused[:5])}"
                     f"{' ...' if len(unused) > 5 else ''}")
  return plan


def _read_block(reader, reads, shape, block_index, dtype) -> np.ndarray:
  """The block `block_index` (slices over `shape`) of one meshlm variable, assembled from its HF tensors
  (`reads`: (index of the tensor in the variable's leading layer/expert dims, entry, name)), each converted to
  float32 and then `dtype` slice by slice."""
  lead = len(reads[0][0])
  ranges = _ranges(block_index, shape)
  out = np.empty([len(r) for r in ranges], dtype)
  by_index = {index: (entry, name) for index, entry, name in reads}
  for pos in np.ndindex(*[len(r) for r in ranges[:lead]]):
    entry, name = by_index[tuple(r[p] for r, p in zip(ranges[:lead], pos))]
    w = entry.read(reader, name, shape[lead:], block_index[lead:])
    out[pos] = w.astype(np.float32).astype(dtype)
  return out


def _active_mesh():
  """(mesh, rules) made current by `parallel.activate` (or jax.set_mesh + model.axes.axis_rules); None if none."""
  if not axes.active():
    return None
  mesh = jax.sharding.get_mesh()
  return (mesh, axes.current_rules()) if mesh is not None and not mesh.empty else None


def _sharded(shape: tuple, sharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
  """The global array of `shape` laid out by `sharding`, each local device's block `read(index)` and placed
  before the next is read (unlike jax.make_array_from_callback, which holds every local block on the host
  first); devices holding the same block (replicated axes) share one read."""
  blocks, last = [], (None, None)
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key != last[0]:
      last = (key, read(index))
    blocks.append(jax.device_put(last[1], device))
  return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def load(path: str, dtype: str = "float32", compute_dtype: str | None = None, *, mesh=None, rules=None,
         progress: bool = True, transform: Callable | None = None, **model_overrides) -> Transformer:
  """Reads a Hugging Face directory of a family in FAMILIES (model.safetensors or sharded files + index) into a
  meshlm Transformer; of Gemma 3's multimodal directories, the text decoder.

  dtype: parameter dtype ("float32", "bfloat16"); compute_dtype: activation dtype (default: dtype). Other
  `config.model` keys (scan_layers, attention_impl, moe_impl, ...) may be overridden by keyword.
  mesh, rules (a jax Mesh and logical-axis rules; default: those made current by `parallel.activate`, if any):
  each parameter is built as a global array sharded by the rules, every device's block read from the
  memory-mapped files on its own and placed before the next is read, so host memory holds one block at a time
  besides what the devices hold. Without a mesh the parameters land unsharded on the default device.
  A tensor whose shape disagrees with config.json is refused with the config fields that set that shape; a
  missing or truncated file is named (safetensors_io.FileError, a ValueError).
  transform: `transform(path, shape, read)` for each parameter ("layers/attn/q", its shape, and `read(index)`
  giving any block of it as float32 NumPy, index a tuple of slices); a non-None result is stored instead of the
  parameter, which is then never read whole (QLoRA quantizes its base kernels this way, layer by layer).
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  cfg.update(param_dtype=dtype, dtype=compute_dtype or dtype, **model_overrides)
  cfg = config_lib.validate(cfg)
  reader = safetensors_io.Reader(path)
  mtp_probe = f"{layout_of(reader).prefix}layers.{cfg.num_layers}.eh_proj.weight"
  if cfg.mtp_depth and mtp_probe not in reader and "mtp_depth" not in model_overrides:
    # transformers runs no MTP layers and saves none, but keeps num_nextn_predict_layers in config.json
    logging.warning("%s: config.json has num_nextn_predict_layers=%d but the files hold no MTP layer (%s); "
                    "loading without multi-token heads (model.mtp_depth=0)", path, cfg.mtp_depth, mtp_probe)
    cfg.mtp_depth = 0
  if mesh is None:
    mesh, rules = _active_mesh() or (None, None)
  pdtype = np.dtype(config_lib.DTYPES[cfg.param_dtype])
  if mesh is None:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  else:
    with jax.set_mesh(mesh), axes.axis_rules(rules):
      model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  plan = _plan_reads(path, reader, model, cfg)
  names = {id(node): "/".join(map(str, p)) for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)}
  for var, reads in _progress(f"loading {os.path.basename(os.path.normpath(path))}", progress)(plan.values()):
    shape = tuple(var.shape)
    value = transform and transform(names[id(var)], shape, lambda index, reads=reads, shape=shape: _read_block(
        reader, reads, shape, index, np.float32))
    if value is None and mesh is None:
      value = jnp.asarray(_read_block(reader, reads, shape, tuple(slice(None) for _ in shape), np.float32), pdtype)
    elif value is None:
      value = _sharded(shape, jax.sharding.NamedSharding(mesh, var.get_value().sharding.spec),
                       lambda index, reads=reads, shape=shape: _read_block(reader, reads, shape, index, pdtype))
    var.set_value(value)
  return model


_take = jax.jit(lambda x, index: x[tuple(index)])  # one tensor of a stacked parameter, compiled once per shape


def _host_tensor(x: jax.Array, index: tuple) -> np.ndarray:
  """x[index] (a layer and/or expert of a stacked parameter; () = all of x) on the host, gathered from every
  device and process; only that tensor is copied."""
  if index:
    x = _take(x, jnp.asarray(index, jnp.int32))
  return sharding_lib.to_host(x)


def save(model: Transformer, path: str, dtype: str | None = None, *,
         max_shard_size: int | str = safetensors_io.DEFAULT_SHARD_SIZE, progress: bool = True,
         values: Callable[[tuple], Any] | None = None) -> list[str]:
  """Writes `model` as a Hugging Face directory that transformers loads: config.json and model.safetensors, or
  when the weights exceed `max_shard_size` bytes (int, or "5GB"/"500MB"; default 5 GB) Hugging Face's sharded
  layout `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`. Returns the weight files.

  Tensors are gathered and written one at a time (a layer's or expert's slice of a stacked parameter at a time),
  so host memory holds one tensor; with several processes all take part in the gathers and process 0 writes.
  dtype: stored dtype ("float32", "bfloat16", "float16"; default: the model's param_dtype).
  values(path) -> array, optional: the value of the parameter at `path` (its key path in the model's nnx
  state), for a `model` that holds only shapes (nnx.eval_shape): `train.export` streams a checkpoint through it.
  """
  cfg = ml_collections.ConfigDict(model.cfg.to_dict())
  if not cfg.causal or cfg.parametrization != "sp":
    raise ValueError(f"model.causal={cfg.causal}, model.parametrization={cfg.parametrization!r}: a Hugging Face "
                     "directory holds a causal decoder in the standard parametrization only (the "
                     "encoder's attention and muP's multipliers would be lost)")
  hf = config_to_hf(cfg)
  out_dtype = np.dtype(config_lib.DTYPES[dtype or cfg.param_dtype])
  entries = list(_entries(model, cfg))
  tensors = [(name, entry.hf_shape(var.shape[len(index):]), out_dtype) for entry, name, var, index in entries]
  paths = {id(v): p for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
  cache: dict[int, Any] = {}  # the variable being written (consecutive entries share stacked variables)

  def produce(i):
    entry, _, var, index = entries[i]
    if id(var) not in cache:
      cache.clear()
      cache[id(var)] = values(paths[id(var)]) if values is not None else var.get_value()
    w = _host_tensor(jnp.asarray(cache[id(var)]), index)
    if jax.process_index():
      return None
    w = np.ascontiguousarray(entry.to_hf(w.astype(np.float32, copy=False)))  # copies only to transpose or cast
    return w.astype(out_dtype, copy=False)

  if jax.process_index() == 0:
    os.makedirs(path, exist_ok=True)
    hf["torch_dtype"] = hf["dtype"] = dtype or cfg.param_dtype
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf, f, indent=2)
  return safetensors_io.write(path, tensors, produce, safetensors_io.parse_size(max_shard_size),
                              _progress(f"saving {os.path.basename(os.path.normpath(path))}", progress))
