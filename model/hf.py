"""Hugging Face interchange for Llama, Mistral and Mixtral: `load(path)`, `save(model, path)`, `config_from_hf`.

A Hugging Face directory holds config.json and model.safetensors (or shards listed in model.safetensors.index.json).
Weights map one to one through one two-way name table (`name_table`): HF Linear weights are [out, in] and are
transposed/reshaped into meshlm's einsum kernels; Mixtral's per-expert matrices stack into [E, D, F] kernels;
RoPE uses the same rotate-half convention, so q/k need no permutation. Fields meshlm cannot represent are refused
with a ValueError naming them. Neither torch nor transformers is needed.

Both directions stream (docs/hf.md): `load` with a mesh builds every parameter sharded, each device's block read
alone from the memory-mapped files (`model.safetensors_io`); `save` gathers and writes one tensor at a time into
Hugging Face's sharded layout.
"""
from __future__ import annotations

import json
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
  `n_in` = 0: the HF tensor has meshlm's layout; n_in > 0: meshlm's einsum kernel [n_in input dims..., output
  dims...] is the HF Linear weight [out, in] (the dims of each side flattened row-major)."""
  hf: str
  path: str
  n_in: int

  def hf_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The HF tensor's shape for a meshlm tensor of `shape`."""
    if not self.n_in:
      return tuple(shape)
    return (int(np.prod(shape[self.n_in:])), int(np.prod(shape[:self.n_in])))

  def to_hf(self, w: np.ndarray) -> np.ndarray:
    """meshlm array -> HF tensor."""
    return w.reshape(int(np.prod(w.shape[:self.n_in])), -1).T if self.n_in else w

  def read(self, reader: safetensors_io.Reader, name: str, shape: Sequence[int], index: tuple) -> np.ndarray:
    """The block `index` (one slice per dim) of the meshlm tensor of `shape` stored as HF tensor `name`, read
    from the files without reading the rest of the tensor (stored dtype)."""
    ranges = _ranges(index, shape)
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


def name_table(cfg) -> list[Entry]:
  """The one table from Hugging Face names to meshlm parameters, used by both `load` and `save`.

  Llama/Mistral MLPs are `mlp.{gate,up,down}_proj`; Mixtral's MoE is `block_sparse_moe.gate` (router [E, D]) and
  `block_sparse_moe.experts.{j}.w1/w3/w2` (gate/up [F, D], down [D, F]).
  """
  table = [
      Entry("model.embed_tokens.weight", "embed/embedding", 0),
      Entry("model.norm.weight", "final_norm/scale", 0),
      Entry("model.layers.{i}.self_attn.q_proj.weight", "layers/attn/q", 1),
      Entry("model.layers.{i}.self_attn.k_proj.weight", "layers/attn/k", 1),
      Entry("model.layers.{i}.self_attn.v_proj.weight", "layers/attn/v", 1),
      Entry("model.layers.{i}.self_attn.o_proj.weight", "layers/attn/o", 2),
      Entry("model.layers.{i}.input_layernorm.weight", "layers/attn_norm/scale", 0),
      Entry("model.layers.{i}.post_attention_layernorm.weight", "layers/mlp_norm/scale", 0),
  ]
  if not cfg.tie_embeddings:
    table.append(Entry("lm_head.weight", "unembed", 1))
  if cfg.num_experts:
    moe = "model.layers.{i}.block_sparse_moe"
    table += [Entry(f"{moe}.gate.weight", "layers/moe/router", 1),
              Entry(f"{moe}.experts.{{j}}.w1.weight", "layers/moe/gate", 1),
              Entry(f"{moe}.experts.{{j}}.w3.weight", "layers/moe/up", 1),
              Entry(f"{moe}.experts.{{j}}.w2.weight", "layers/moe/down", 1)]
  else:
    table += [Entry("model.layers.{i}.mlp.up_proj.weight", "layers/mlp/up", 1),
              Entry("model.layers.{i}.mlp.down_proj.weight", "layers/mlp/down", 1)]
    if cfg.mlp_type != "gelu":
      table.append(Entry("model.layers.{i}.mlp.gate_proj.weight", "layers/mlp/gate", 1))
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
  config.json or a tensor meshlm does not map raises ValueError naming it."""
  plan: dict[int, tuple[Any, list]] = {}
  used = set()
  for entry, name, var, index in _entries(model, cfg):
    if name not in reader:
      raise ValueError(f"{path}: tensor {name!r} missing from the safetensors files")
    used.add(name)
    want = entry.hf_shape(var.shape[len(index):])
    if tuple(reader.shape(name)) != want:
      fields = ", ".join(f"{h}={cfg[k]}" for k, h in SHAPE_FIELDS.items())
      raise ValueError(f"{path}: tensor {name!r} has shape {list(reader.shape(name))} but config.json implies "
                       f"{list(want)} ({fields}); the weights and config.json disagree")
    plan.setdefault(id(var), (var, []))[1].append((index, entry, name))
  unused = sorted(set(reader.names()) - used - {"lm_head.weight"})
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
         progress: bool = True, **model_overrides) -> Transformer:
  """Reads a Hugging Face Llama/Mistral/Mixtral directory (model.safetensors or sharded files + index) into a
  meshlm Transformer.

  dtype: parameter dtype ("float32", "bfloat16"); compute_dtype: activation dtype (default: dtype). Other
  `config.model` keys (scan_layers, attention_impl, moe_impl, ...) may be overridden by keyword.
  mesh, rules (a jax Mesh and logical-axis rules; default: those made current by `parallel.activate`, if any):
  each parameter is built as a global array sharded by the rules, every device's block read from the
  memory-mapped files on its own and placed before the next is read, so host memory holds one block at a time
  besides what the devices hold. Without a mesh the parameters land unsharded on the default device.
  A tensor whose shape disagrees with config.json is refused with the config fields that set that shape; a
  missing or truncated file is named (safetensors_io.FileError, a ValueError).
  """
  with open(os.path.join(path, "config.json")) as f:
    cfg = config_from_hf(json.load(f))
  cfg.update(param_dtype=dtype, dtype=compute_dtype or dtype, **model_overrides)
  cfg = config_lib.validate(cfg)
  reader = safetensors_io.Reader(path)
  if mesh is None:
    mesh, rules = _active_mesh() or (None, None)
  pdtype = np.dtype(config_lib.DTYPES[cfg.param_dtype])
  if mesh is None:
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  else:
    with jax.set_mesh(mesh), axes.axis_rules(rules):
      model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  plan = _plan_reads(path, reader, model, cfg)
  for var, reads in _progress(f"loading {os.path.basename(os.path.normpath(path))}", progress)(plan.values()):
    shape = tuple(var.shape)
    if mesh is None:
      value = jnp.asarray(_read_block(reader, reads, shape, tuple(slice(None) for _ in shape), np.float32), pdtype)
    else:
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
  if not x.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


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
                     "Llama/Mistral directory holds a causal decoder in the standard parametrization only (the "
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
