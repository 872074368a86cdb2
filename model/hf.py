"""Hugging Face interchange for Llama, Mistral and Mixtral: `load(path)`, `save(model, path)`, `config_from_hf`.

A Hugging Face directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
Weights map one to one through one two-way name table (`name_table`): HF Linear weights are [out, in] and are
transposed/reshaped into meshlm's einsum kernels; Mixtral's per-expert matrices stack into [E, D, F] kernels;
RoPE uses the same rotate-half convention, so q/k need no permutation. Fields meshlm cannot represent are refused
with a ValueError naming them. Neither torch nor transformers is needed.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from model import config as config_lib
from model.transformer import Transformer

_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
_SUPPORTED_TYPES = ("llama", "mistral", "mixtral")


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
    _refuse("model_type", model_type, f"meshlm reads {', '.join(_SUPPORTED_TYPES)}")
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
  window = hf.get("sliding_window") if model_type in ("mistral", "mixtral") else None
  if model_type == "mixtral":
    if hf.get("router_jitter_noise", 0.0):
      _refuse("router_jitter_noise", hf["router_jitter_noise"], "meshlm's router has no jitter")
    cfg.update(num_experts=int(hf.get("num_local_experts", 8)), experts_per_token=int(hf.get("num_experts_per_tok", 2)),
               expert_mlp_dim=int(hf["intermediate_size"]), moe_every=1, num_shared_experts=0, capacity_factor=0.0,
               router="topk_softmax")
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
  """The config.json dict (Llama; Mistral when a sliding window is set; Mixtral with experts) for a model config."""
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
  if cfg.num_experts:
    mixtral = {"moe_every": 1, "num_shared_experts": 0, "capacity_factor": 0.0, "router": "topk_softmax",
               "mlp_type": "swiglu"}
    for key, want in mixtral.items():
      if cfg[key] != want:
        raise ValueError(f"model.{key}={cfg[key]!r} has no Hugging Face Mixtral equivalent (needs {want!r})")
  model_type = "mixtral" if cfg.num_experts else "mistral" if cfg.sliding_window else "llama"
  hf = {
      "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "mixtral": "MixtralForCausalLM"}[model_type]],
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
  if model_type == "llama":
    hf["mlp_bias"] = False
  else:
    hf["sliding_window"] = cfg.sliding_window or None
  if model_type == "mixtral":
    hf.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
              intermediate_size=cfg.expert_mlp_dim or cfg.mlp_dim, router_jitter_noise=0.0,
              output_router_logits=False)
  return hf


class Entry(NamedTuple):
  """One tensor of the two-way name table. `hf` may hold `{i}` (layer) and `{j}` (expert); `path` is the meshlm
  parameter path inside the model (`layers/...` paths: inside one layer; `{j}` entries: one expert's slice).
  `to_hf(w)` turns meshlm's array into the HF tensor; `from_hf(w, shape)` the HF tensor into meshlm's `shape`."""
  hf: str
  path: str
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray, tuple], np.ndarray]


def _linear(n_in: int) -> tuple[Callable, Callable]:
  """A meshlm einsum kernel [in dims (n_in of them)..., out dims...] <-> an HF Linear weight [out, in]."""
  return (lambda w: w.reshape(int(np.prod(w.shape[:n_in])), -1).T,
          lambda w, shape: w.T.reshape(shape))


_SAME = (lambda w: w, lambda w, shape: w.reshape(shape))


def name_table(cfg) -> list[Entry]:
  """The one table from Hugging Face names to meshlm parameters, used by both `load` and `save`.

  Llama/Mistral MLPs are `mlp.{gate,up,down}_proj`; Mixtral's MoE is `block_sparse_moe.gate` (router [E, D]) and
  `block_sparse_moe.experts.{j}.w1/w3/w2` (gate/up [F, D], down [D, F]).
  """
  table = [
      Entry("model.embed_tokens.weight", "embed/embedding", *_SAME),
      Entry("model.norm.weight", "final_norm/scale", *_SAME),
      Entry("model.layers.{i}.self_attn.q_proj.weight", "layers/attn/q", *_linear(1)),
      Entry("model.layers.{i}.self_attn.k_proj.weight", "layers/attn/k", *_linear(1)),
      Entry("model.layers.{i}.self_attn.v_proj.weight", "layers/attn/v", *_linear(1)),
      Entry("model.layers.{i}.self_attn.o_proj.weight", "layers/attn/o", *_linear(2)),
      Entry("model.layers.{i}.input_layernorm.weight", "layers/attn_norm/scale", *_SAME),
      Entry("model.layers.{i}.post_attention_layernorm.weight", "layers/mlp_norm/scale", *_SAME),
  ]
  if not cfg.tie_embeddings:
    table.append(Entry("lm_head.weight", "unembed", *_linear(1)))
  if cfg.num_experts:
    moe = "model.layers.{i}.block_sparse_moe"
    table += [Entry(f"{moe}.gate.weight", "layers/moe/router", *_linear(1)),
              Entry(f"{moe}.experts.{{j}}.w1.weight", "layers/moe/gate", *_linear(1)),
              Entry(f"{moe}.experts.{{j}}.w3.weight", "layers/moe/up", *_linear(1)),
              Entry(f"{moe}.experts.{{j}}.w2.weight", "layers/moe/down", *_linear(1))]
  else:
    table += [Entry("model.layers.{i}.mlp.up_proj.weight", "layers/mlp/up", *_linear(1)),
              Entry("model.layers.{i}.mlp.down_proj.weight", "layers/mlp/down", *_linear(1))]
    if cfg.mlp_type != "gelu":
      table.append(Entry("model.layers.{i}.mlp.gate_proj.weight", "layers/mlp/gate", *_linear(1)))
  return table


# meshlm model keys that fix parameter shapes, with the Hugging Face config field of each.
SHAPE_FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
                "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                "mlp_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
                "num_experts": "num_local_experts", "expert_mlp_dim": "intermediate_size"}


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
  unit = config_lib.layers_per_unit(cfg)
  if unit == 1:
    return [(model.layers, i) for i in range(cfg.num_layers)]
  return [(model.layers.blocks[i % unit], i // unit) for i in range(cfg.num_layers)]


def _entries(model, cfg):
  """Yields (table entry, HF name, variable, index of the tensor inside the variable) for every HF tensor; the
  index selects the layer in stacked parameters and the expert for `{j}` names (() = the whole variable)."""
  slots = _layer_slots(model, cfg)
  for e in name_table(cfg):
    if not e.path.startswith("layers/"):
      yield e, e.hf, _get(model, e.path), ()
      continue
    for i in range(cfg.num_layers):
      holder, stacked = slots[i]
      if "layers/moe/" in e.path and not config_lib.is_moe_layer(cfg, i):
        continue
      if "layers/mlp/" in e.path and config_lib.is_moe_layer(cfg, i):
        continue
      var = _get(holder, e.path[len("layers/"):])
      index = () if stacked is None else (stacked,)
      if "{j}" in e.hf:
        for j in range(cfg.num_experts):
          yield e, e.hf.format(i=i, j=j), var, index + (j,)
      else:
        yield e, e.hf.format(i=i), var, index


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
  """Reads a Hugging Face Llama/Mistral/Mixtral directory into a meshlm Transformer.

  dtype: parameter dtype ("float32", "bfloat16"); compute_dtype: activation dtype (default: dtype). Other
  `config.model` keys (scan_layers, attention_impl, moe_impl, ...) may be overridden by keyword. A tensor whose
  shape disagrees with config.json is refused with the config fields that set that shape.
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  cfg.update(param_dtype=dtype, dtype=compute_dtype or dtype, **model_overrides)
  cfg = config_lib.validate(cfg)
  tensors = _read_safetensors(path)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  pdtype = config_lib.DTYPES[cfg.param_dtype]
  values: dict[int, tuple[Any, np.ndarray]] = {}  # id(variable) -> (variable, float32 value being filled)
  used = set()
  for entry, name, var, index in _entries(model, cfg):
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name!r} missing from the safetensors files")
    used.add(name)
    if id(var) not in values:
      values[id(var)] = (var, np.zeros(var.shape, np.float32))
    target = values[id(var)][1]
    shape = target[index].shape
    w = np.asarray(tensors[name].astype(jnp.float32))
    want = entry.to_hf(np.zeros(shape, np.float32)).shape
    if w.shape != want:
      fields = ", ".join(f"{h}={cfg[k]}" for k, h in SHAPE_FIELDS.items())
      raise ValueError(f"{path}: tensor {name!r} has shape {list(w.shape)} but config.json implies {list(want)} "
                       f"({fields}); the weights and config.json disagree")
    target[index] = entry.from_hf(w, shape)
  for var, value in values.values():
    var.set_value(jnp.asarray(value, pdtype))
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
  if not cfg.causal or cfg.parametrization != "sp":
    raise ValueError(f"model.causal={cfg.causal}, model.parametrization={cfg.parametrization!r}: a Hugging Face "
                     "Llama/Mistral directory holds a causal decoder in the standard parametrization only (the "
                     "encoder's attention and muP's multipliers would be lost)")
  hf = config_to_hf(cfg)
  out_dtype = config_lib.DTYPES[dtype or cfg.param_dtype]
  host: dict[int, np.ndarray] = {}
  tensors = {}
  for entry, name, var, index in _entries(model, cfg):
    if id(var) not in host:
      host[id(var)] = np.asarray(jax.device_get(var.get_value()), np.float32)
    tensors[name] = jnp.asarray(np.ascontiguousarray(entry.to_hf(host[id(var)][index])), out_dtype)
  os.makedirs(path, exist_ok=True)
  hf["torch_dtype"] = hf["dtype"] = dtype or cfg.param_dtype
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
