"""Per-device memory of a training run, from the config alone: model state by precision and sharding, and
activations by remat policy. Used by `python -m train.plan` and printed beside the compiled figures by
`python -m train.compile`.

Units: bytes unless a name says otherwise. "Per token" means per token held by one device.
"""
from __future__ import annotations

import functools
import json
import math

import ml_collections

from model import attention
from model import basequant
from model import config as model_config
from model import lora as lora_lib
from model import remat

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Bytes per parameter of (weights, gradients, optimizer state) for AdamW, before any sharding.
PRECISIONS = {
    "fp32": (4, 4, 8),  # fp32 weights and gradients, Adam m and v in fp32
    "bf16_mixed": (2, 2, 12),  # bf16 weights and gradients; fp32 master copy + Adam m, v (ZeRO's K = 12)
    "bf16": (2, 2, 4),  # everything in bf16 (no master copy)
}
SEEDS_EXTRA_BYTES = 20  # the seeds' rule of thumb: training needs the weights plus ~20 bytes per parameter


def state_bytes_per_param(precision: str, weight_dtype: str = "float32") -> dict:
  """Bytes per parameter: {"weights", "gradients", "optimizer", "total"} for a precision name.

  `precision`: "fp32", "bf16_mixed", or "seeds" (weights in `weight_dtype` + SEEDS_EXTRA_BYTES, all of which are
  reported under "optimizer" since the rule does not split them).
  """
  if precision == "seeds":
    w, g, o = BYTES[weight_dtype], 0, SEEDS_EXTRA_BYTES
  elif precision in PRECISIONS:
    w, g, o = PRECISIONS[precision]
  else:
    raise ValueError(f"unknown precision {precision!r}; use one of {', '.join([*PRECISIONS, 'seeds'])}")
  return {"weights": w, "gradients": g, "optimizer": o, "total": w + g + o}


def state_memory(params: float, precision: str = "fp32", *, zero_stage: int = 3, fsdp: int = 1,
                 tensor: int = 1, weight_dtype: str = "float32") -> dict:
  """Per-device bytes of weights, gradients and optimizer state for `params` parameters.

  Tensor parallelism divides everything by `tensor`; data parallelism replicates; ZeRO stage k shards over the
  `fsdp` ranks: 1 the optimizer state, 2 also the gradients, 3 also the weights (meshlm's fsdp axis is stage 3).
  """
  if zero_stage not in (0, 1, 2, 3):
    raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
  per = state_bytes_per_param(precision, weight_dtype)
  div = {"weights": fsdp if zero_stage >= 3 else 1, "gradients": fsdp if zero_stage >= 2 else 1,
         "optimizer": fsdp if zero_stage >= 1 else 1}
  out = {k: params * per[k] / (tensor * div[k]) for k in div}
  out["total"] = sum(out.values())
  return out


@functools.lru_cache(maxsize=64)
def _state_ratio(model_json: str, train_json: str) -> tuple[float, float]:
  import jax
  from flax import nnx
  import model as model_lib
  from train.core import optimizer as optimizer_lib
  model_cfg = ml_collections.ConfigDict(json.loads(model_json))
  train_cfg = ml_collections.ConfigDict(json.loads(train_json))
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(model_cfg, rngs=nnx.Rngs(params=jax.random.key(0))))
  params = nnx.state(abstract, nnx.Param)
  values = nnx.to_pure_dict(params)
  dims = optimizer_lib.muon_dims_of(optimizer_lib.logical_names(params)) if train_cfg.optimizer == "muon" else None
  state = jax.eval_shape(optimizer_lib.make(train_cfg, muon_dims=dims).init, values)
  shapes = {tuple(x.shape) for x in jax.tree.leaves(values)}
  nbytes = lambda leaves: sum(x.size * x.dtype.itemsize for x in leaves)
  like_params = [x for x in jax.tree.leaves(state) if tuple(x.shape) in shapes]
  other = [x for x in jax.tree.leaves(state) if tuple(x.shape) not in shapes]
  return nbytes(like_params) / nbytes(jax.tree.leaves(values)), float(nbytes(other))


def optimizer_state_ratio(config: ml_collections.ConfigDict) -> tuple[float, float]:
  """(bytes of train.optimizer's parameter-shaped state per byte of the model's weights, bytes of the rest of its
  state), in train.opt_state_dtype: optax's own init run on the abstract model (jax.eval_shape, nothing
  allocated). The first follows the parameters' sharding; the rest (Adafactor's factored row and column moments,
  counters) is counted whole on every device. adamw: (2, ~0) (m, v); lion: 1; muon: 1 on the matrices and 2
  elsewhere; adafactor: 1 on vectors and unfactored leaves, rows + columns for factored matrices;
  schedule_free_adamw: 2 (z and v); bfloat16 states of float32 weights halve the first."""
  return _state_ratio(json.dumps(config.model.to_dict(), sort_keys=True, default=list),
                      json.dumps(config.train.to_dict(), sort_keys=True, default=list))


def meshlm_state(config: ml_collections.ConfigDict, params: float, sizes: dict[str, int]) -> dict:
  """Per-device state as meshlm's train step holds it: weights, gradients and the optimizer's state (AdamW: m, v)
  in model.param_dtype (the state in train.opt_state_dtype: `optimizer_state_ratio`), sharded over fsdp (ZeRO-3)
  and tensor, replicated over data; MoE expert weights are split over the expert axis as well; the layer stack
  over the pipeline stages (embedding, output projection and final norm are replicated over `stage`)."""
  m = config.model
  precision = {"float32": "fp32"}.get(m.param_dtype, "bf16")
  expert = expert_params(m)
  outside = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model * (2 if m.use_bias else 1)
  stack = params - outside - expert + expert / sizes.get("expert", 1)
  share = (outside + stack / sizes.get("stage", 1)) / params  # of the model's parameters, one device's group
  if config.train.lora_rank:
    return _lora_state(config, params, share, sizes)
  out = state_memory(params * share, precision, zero_stage=3, fsdp=sizes["fsdp"], tensor=sizes["tensor"])
  ratio, unsharded = optimizer_state_ratio(config)
  out["optimizer"] = out["weights"] * ratio + unsharded
  out["total"] = out["weights"] + out["gradients"] + out["optimizer"]
  return out


def _lora_state(config: ml_collections.ConfigDict, params: float, share: float, sizes: dict[str, int]) -> dict:
  """meshlm_state of a LoRA run: the frozen base as weights (QLoRA: its projection kernels at the quantized
  format's bytes per weight), gradients and AdamW m, v for the adapters only."""
  m, t = config.model, config.train
  if t.lora_base_double_quant and t.lora_base_quant != "nf4":
    raise ValueError("config.train.lora_base_double_quant=True quantizes NF4's block constants; it needs "
                     f"train.lora_base_quant='nf4' (got {t.lora_base_quant!r})")
  n = lora_lib.counts(m, lora_lib.check_targets(t.lora_targets), int(t.lora_rank))
  per = BYTES[m.param_dtype]
  kernel = basequant.nbytes_per_param(t.lora_base_quant, double=bool(t.lora_base_double_quant),
                                      dtype=model_config.DTYPES[m.param_dtype])
  scale = share / (sizes["fsdp"] * sizes["tensor"])
  out = {"weights": scale * ((params - n["base_kernels"]) * per + n["base_kernels"] * kernel + n["adapters"] * per),
         "gradients": scale * n["adapters"] * per, "optimizer": scale * 2 * n["adapters"] * per}
  out["total"] = sum(out.values())
  return out


def pipeline_schedule(config: ml_collections.ConfigDict, sizes: dict[str, int]) -> dict | None:
  """{"stages" S, "microbatches" M, "repeats" R, "iterations" T = R*M + S - 1, "bubble" (S-1)/T, "remat" (stage
  visits recomputed: train.pipeline_remat, always with R > 1), "layers_per_stage"} of a pipelined config (mesh
  stage > 1), None otherwise (parallel/pipeline.py)."""
  S = sizes.get("stage", 1)
  if S == 1:
    return None
  t = config.train
  M, R = int(t.pipeline_microbatches) or S, int(t.pipeline_repeats)
  T = R * M + S - 1
  return {"stages": S, "microbatches": M, "repeats": R, "iterations": T, "bubble": (S - 1) / T,
          "remat": bool(t.pipeline_remat) or R > 1, "layers_per_stage": config.model.num_layers // S}


def expert_params(m: ml_collections.ConfigDict) -> int:
  """Parameters of the routed experts (3 * D * expert_mlp_dim each, E per MoE layer); 0 for dense models."""
  if not m.num_experts:
    return 0
  return (m.num_layers // m.moe_every) * m.num_experts * 3 * m.d_model * (m.expert_mlp_dim or m.mlp_dim)


def batch_shards(sizes: dict[str, int]) -> int:
  """Devices the batch is split over (the default rules' batch axes: data x fsdp x expert)."""
  return sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)


def mesh_sizes(config: ml_collections.ConfigDict, num_devices: int | None = None) -> dict[str, int]:
  """Axis sizes (ICI x DCN) of `config.mesh` on `num_devices` devices (default: -1 axes become 1)."""
  from parallel import mesh as mesh_lib  # local: only config-based estimates need it
  dcn = math.prod(int(config.mesh[f"dcn_{a}"]) for a in mesh_lib.DCN_AXES)
  if num_devices is None:
    fixed = math.prod(max(int(config.mesh[a]), 1) for a in mesh_lib.AXES)
    num_devices = fixed * max(dcn, 1)
  ici, dcn_sizes = mesh_lib.mesh_shape(config.mesh, num_devices, max(dcn, 1))
  return {a: ici[a] * dcn_sizes[a] for a in mesh_lib.AXES}


FLASH_ATTENTION = ("blockwise", "splash", "cudnn")  # implementations that never keep [T, S] scores


def attention_impl(m: ml_collections.ConfigDict, platform: str) -> str:
  """The attention a model config runs on `platform` ("cpu", "gpu", "tpu"): model.attention_impl, "auto" resolved
  (model.attention.auto_impl); an explicit choice is taken as it is (the Trainer refuses one that cannot run)."""
  if m.attention_impl == "auto":
    return attention.auto_impl(platform, m.dtype, m.head_dim, m.attn_logit_softcap)
  return m.attention_impl


def _layer_bytes(m: ml_collections.ConfigDict, kv_len: int, tensor: int, expert: int = 1,
                 sequence: int = 1, impl: str | None = None) -> dict[str, float]:
  """Bytes per token of what one layer (model/layers.py) keeps for its backward pass, as one device holds it
  (head and mlp widths divided by `tensor`), grouped by what the remat policies can choose to save.

  Counted from the residuals jax saves without remat (`jax.ad_checkpoint.saved_residuals` of a layer):
  six D-wide tensors (layer input, the float32 normalisation intermediates and normalised inputs of both norms,
  the residual after attention), q (grouped), k, v and the attention context, and six F-wide MLP tensors
  (gate, up, the activation's intermediates, their product). The reference attention keeps one float32 [H, S]
  tensor per query, the probabilities (its softmax's backward needs nothing else), and the boolean mask, over the
  keys it computes (`model.attention_query_block`; the whole square under sequence parallelism, `sequence` > 1).
  """
  c = BYTES[m.dtype]
  h, g, k, f, d = m.num_heads / tensor, m.num_kv_heads / tensor, m.head_dim, m.mlp_dim / tensor, m.d_model
  qkv, context = (h + 2 * g) * k, h * k
  if m.attention_type == "mla":
    # Latent attention (model.layers.LatentAttention): q, k and v expanded per head at one width W (the kernels'),
    # plus the latents it differentiates through: the q LoRA product and its RMSNorm (raw, float32 intermediates,
    # normalised), the joint kv product [C + R], the normalised latent with its norm's, the rotated key.
    qk, vd, _ = model_config.attention_dims(m)
    Q, C, R = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    qkv = 3 * h * max(qk, vd) + 3 * Q + (C + R) + 3 * C + R
    context = h * vd
  if m.num_experts:
    # An MoE layer holds F-wide rows for the k choices of every token of its expert group (the all-to-all's
    # worst-case receive buffer; an upper bound, each device computes only its own experts' share) plus shared
    # experts; averaged with the dense layers of each moe_every group.
    fe = m.expert_mlp_dim or m.mlp_dim
    moe_f = (m.experts_per_token * expert + m.num_shared_experts) * fe / tensor
    f = ((m.moe_every - 1) * f + moe_f) / m.moe_every
  mlp_inputs = 2 if m.mlp_type in ("swiglu", "geglu") else 1
  impl = impl or m.attention_impl
  if impl in FLASH_ATTENTION:
    # flash-style kernels (blockwise's custom VJP, splash's and cuDNN's residuals): float32 statistics per query
    # head; cuDNN also keeps the packed-document mask as a [T, S] bias in the compute dtype (model/attention.py)
    scores = 2 * h * 4 + (kv_len * c if impl == "cudnn" else 0)
  else:
    keys = kv_len  # per query; causal query blocks (xla, length not split) only those up to their block's end
    edges = attention.query_blocks(kv_len, m.attention_query_block) if (
        impl == "xla" and m.causal and sequence == 1) else None
    if edges:
      keys = sum((e - a) * e for a, e in zip(edges[:-1], edges[1:])) / kv_len
    scores = h * keys * (4 + 1)
  return {
      "input": d * c,  # the layer input (the scan carry), kept by every policy
      "norms": 5 * d * c,
      "qkv": qkv * c,
      "context": context * c,
      "scores": scores,
      "attn_out": d * c,  # only the dot-saving policies keep it; without remat it is folded into `norms`
      "mlp_in": mlp_inputs * f * c,
      "mlp_other": (6 - mlp_inputs) * f * c,
      "mlp_out": d * c,
  }


# Which groups each remat policy keeps: a view of model/remat.py's one policy table.
SAVED_BY_POLICY = {name: policy.keeps for name, policy in remat.POLICIES.items()}
# Which groups each policy keeps in host memory instead (the offload_* policies).
OFFLOADED_BY_POLICY = {name: policy.offloads for name, policy in remat.POLICIES.items()}


_ATTENTION = ("norms", "qkv", "context", "scores", "attn_out")  # live while attention is differentiated


def _context_bytes(m: ml_collections.ConfigDict, context: str, sizes: dict[str, int]) -> float:
  """Bytes per local token that attention over a split sequence (model.context_parallel, mesh.sequence = n > 1)
  holds beside the layer's own tensors while it is differentiated. all_gather: the whole sequence's K and V and
  their gradients before the reduce-scatter (n times the local tokens'). ring (parallel/context.py): two K/V blocks
  (the one in use and the one arriving) and two float32 dK/dV accumulators (the one being added to and the one
  arriving). ulysses: q, k, v and the context again in the head-split layout of the all-to-all."""
  n = sizes["sequence"]
  if n == 1 or m.attention_type == "mla":
    return 0.0
  c, k = BYTES[m.dtype], m.head_dim
  h, g = m.num_heads / sizes["tensor"], max(m.num_kv_heads / sizes["tensor"], 1)
  if context == "ring":
    return 2 * 2 * g * k * (c + 4)
  if context == "ulysses":
    return (2 * h + 2 * g) * k * c
  return 2 * 2 * g * k * c * n
_MLP = ("mlp_in", "mlp_other", "mlp_out")


def activation_memory(config: ml_collections.ConfigDict, micro_batch: int, *, remat: str | None = None,
                      sizes: dict[str, int] | None = None, platform: str = "cpu") -> dict:
  """Per-device activation bytes of one micro-batch of `micro_batch` sequences (global) of config.train.seq_len.

  The peak has every layer's saved tensors live, plus the float32 logits and their gradient (two V-wide float32
  tensors per token; softmax and the one-hot targets fuse into the gradient), plus the last layer's backward
  working set: the larger half of its recomputed intermediates (the MLP's are freed before the attention's are
  differentiated) and the float32 gradient of its attention scores. The last two are added, not maxed: XLA may
  recompute the last layer before the loss gradient is done, since the recomputation depends only on saved inputs.

  Pipelined (mesh stage S > 1, parallel/pipeline.py; M microbatches, R repeats, T = R*M + S - 1 iterations):
  a device runs L/(S*R) layers per iteration on micro_batch/M sequences and keeps what they save for all T
  iterations, i.e. num_layers/S layers' worth times T/(R*M); with train.pipeline_remat only each iteration's
  stage input (one D-wide tensor) is kept and one stage visit's layers are recomputed at a time. The loop buffer
  (the whole micro-batch's D-wide residual stream) and the logits are replicated over stages.

  Offloading policies (model/remat.py `offload_*`) keep their groups in host memory: not in `total`, reported as
  `host` (every layer's), and part of the backward working set again when the last layer fetches them back.

  Returns bytes: {"per_layer_saved", "layers" (= per_layer_saved * num_layers; pipelined: what the stage keeps
  over its iterations), "recompute_peak", "logits", "total", "host", "tokens_per_device"}. `platform` ("cpu", "gpu",
  "tpu"): where the step runs, which decides model.attention_impl=auto (`attention_impl`).
  """
  m, t = config.model, config.train
  impl = attention_impl(m, platform)
  sizes = sizes or mesh_sizes(config)
  context = m.get("context_parallel", "all_gather") if sizes["sequence"] > 1 else "all_gather"
  if context == "ring":  # every ring step runs the blockwise kernel's math
    impl = "blockwise"
  remat = t.remat if remat is None else remat
  if remat not in SAVED_BY_POLICY:
    raise ValueError(f"remat={remat!r}: no activation model for it; known: {', '.join(SAVED_BY_POLICY)}")
  tokens = micro_batch * t.seq_len / (batch_shards(sizes) * sizes["sequence"])
  per_token = _layer_bytes(m, t.seq_len, sizes["tensor"], sizes.get("expert", 1), sizes["sequence"], impl)

  def nbytes(names):
    return sum(per_token[n] for n in names) * tokens

  kept = set(SAVED_BY_POLICY[remat])
  saved = nbytes(kept)
  # the scores' gradient: float32, mask-free (flash-style kernels recompute it per block instead)
  score_grad = per_token["scores"] * 4 / 5 if impl not in FLASH_ATTENTION else 0.0
  attention = nbytes(set(_ATTENTION) - kept) + (score_grad + _context_bytes(m, context, sizes)) * tokens
  mlp = nbytes(set(_MLP) - kept)
  logits = 2 * 4 * m.vocab_size / sizes["tensor"] * tokens
  layers = saved * m.num_layers
  recompute = max(attention, mlp)
  pipe = pipeline_schedule(config, sizes)
  if pipe:
    S, M, R, T = pipe["stages"], pipe["microbatches"], pipe["repeats"], pipe["iterations"]
    per_visit = m.num_layers // (S * R)
    boundary = per_token["input"] * tokens / M  # one stage input (microbatch) per iteration
    if pipe["remat"]:
      layers = boundary * T + saved / M * per_visit
    else:
      layers = saved / M * per_visit * T
    layers += per_token["input"] * tokens * (1 + S / M)  # loop buffer and the stage-to-stage shift state
    recompute = recompute / M
  host = nbytes(OFFLOADED_BY_POLICY[remat]) * m.num_layers
  return {"per_layer_saved": saved, "layers": layers, "recompute_peak": recompute, "logits": logits,
          "total": layers + logits + recompute, "host": host, "tokens_per_device": tokens}


def max_micro_batch(config: ml_collections.ConfigDict, hbm_bytes: float, state_bytes: float, *,
                    remat: str | None = None, sizes: dict[str, int] | None = None, platform: str = "cpu") -> int:
  """The largest global micro-batch (sequences, a multiple of the data-parallel ranks) whose activations fit in
  `hbm_bytes` per device beside `state_bytes` of model state; 0 when not even one sequence per rank fits
  (`platform` as activation_memory's)."""
  sizes = sizes or mesh_sizes(config)
  ranks = batch_shards(sizes)
  per_step = activation_memory(config, ranks, remat=remat, sizes=sizes, platform=platform)["total"]  # 1 per rank
  return max(int((hbm_bytes - state_bytes) // per_step), 0) * ranks
