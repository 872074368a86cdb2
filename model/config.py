"""Validation of `config.model`: every bad value fails at construction with a message naming the key."""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import ml_collections

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
GATED = ("swiglu", "geglu")  # mlp_types with a gate projection beside the up projection
CHOICES = {
    "mlp_type": ("swiglu", "geglu", "gelu", "relu"),
    "norm_type": ("rmsnorm", "layernorm"),
    "rope_scaling": ("none", "llama3", "linear", "dynamic", "yarn"),
    "qk_norm": ("none", "head", "proj"),
    "norm_position": ("pre", "sandwich", "post"),
    "block_type": ("sequential", "parallel"),
    "attention_impl": ("auto", "xla", "dot_product", "blockwise", "splash", "cudnn"),
    "context_parallel": ("all_gather", "ring", "ulysses"),
    "context_layout": ("zigzag", "contiguous"),
    "dtype": tuple(DTYPES),
    "param_dtype": tuple(DTYPES),
    "router": ("topk_softmax", "softmax_topk", "sigmoid"),
    "attention_type": ("mha", "mla"),
    "moe_impl": ("auto", "ragged", "tiled", "megablox"),
    "parametrization": ("sp", "mup"),
    "quant": ("none", "int8", "fp8"),
}
QUANT_LAYERS = ("attn", "mlp")
_POSITIVE_INTS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                  "max_seq_len", "attention_block_size", "rope_original_max_len", "mup_base_width", "scan_unroll")
_POSITIVE_FLOATS = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_yarn_beta_fast", "rope_yarn_beta_slow")
# Numbers where 0 means "off" (or "the default rule"), refused below 0.
_OFF_OR_POSITIVE_FLOATS = ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta",
                           "rope_attention_factor", "rope_mscale_all_dim")
_BOOLS = ("qkv_bias", "norm_offset", "embed_scale", "rope_yarn_truncate", "router_norm_topk", "rope_interleave")
LAYER_TYPES = ("sliding", "full")  # entries of model.layer_types

_MOE_KEYS = ("experts_per_token", "moe_every", "num_shared_experts", "expert_mlp_dim", "capacity_factor", "router",
             "moe_impl", "routed_scaling_factor", "router_groups", "router_topk_groups", "first_dense_layers")
# Multi-head Latent Attention (DeepSeek-V2/V3): its projections' widths, read only with attention_type='mla'.
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave")
AUTO_CHOICES = ("splash", "cudnn", "xla")  # what model.attention_impl=auto may run (model.attention.auto_impl)
# Tile sizes of the splash kernel (model/splash.py): tokens, positive multiples of SPLASH_GRANULE.
SPLASH_BLOCK_KEYS = ("splash_block_q", "splash_block_kv", "splash_block_kv_compute", "splash_block_q_bwd",
                     "splash_block_kv_bwd")
SPLASH_GRANULE = 128  # the TPU's lane width: the kernel's key blocks are multiples of it
# Tile bounds of the megablox grouped matmuls (model/megablox.py): rows and columns, positive multiples of
# MEGABLOX_GRANULE.
MEGABLOX_TILE_KEYS = ("megablox_tile_m", "megablox_tile_k", "megablox_tile_n")
MEGABLOX_GRANULE = 128  # the TPU's lane width: the kernels' tiles are multiples of it
_LLAMA3_ROPE_KEYS = ("rope_low_freq_factor", "rope_high_freq_factor")
_YARN_ROPE_KEYS = ("rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_attention_factor", "rope_yarn_truncate")
# Keys that act only under a condition: (key, condition, acts(model config) -> bool, or None when the platform
# decides: model.attention_impl=auto, which the Trainer checks once it is known; why). The config checks
# (configs/validate.py, which reads this table: the model imports nothing from configs) refuse one set away from
# its default where it cannot act. Not part of `validate`: models read from Hugging Face may carry such values.
CONDITIONAL_KEYS = (
    *((k, "model.num_experts > 0", lambda c: c.num_experts > 0, "a dense model (num_experts=0) has no experts")
      for k in _MOE_KEYS),
    *((k, "model.rope_scaling='llama3'", lambda c: c.rope_scaling == "llama3", "a parameter of Llama 3.1 scaling")
      for k in _LLAMA3_ROPE_KEYS),
    *((k, "model.attention_type='mla'", lambda c: c.attention_type == "mla", "a width of Multi-head Latent "
       "Attention") for k in MLA_KEYS),
    ("router_norm_topk", "model.router='sigmoid'", lambda c: c.num_experts > 0 and c.router == "sigmoid",
     "the softmax routers fix the normalisation (topk_softmax: renormalised, softmax_topk: not)"),
    ("rope_mscale_all_dim", "model.rope_scaling='yarn'", lambda c: c.rope_scaling == "yarn",
     "it scales the attention scores by YaRN's mscale of the scaling factor"),
    ("rope_scaling_factor", "model.rope_scaling is llama3, linear, dynamic or yarn",
     lambda c: c.rope_scaling != "none", "the factor of RoPE scaling"),
    ("rope_original_max_len", "model.rope_scaling is llama3, dynamic or yarn",
     lambda c: c.rope_scaling in ("llama3", "dynamic", "yarn"), "the context length RoPE scaling extends"),
    *((k, "model.rope_scaling='yarn'", lambda c: c.rope_scaling == "yarn", "a parameter of YaRN scaling")
      for k in _YARN_ROPE_KEYS),
    ("rope_local_theta", "some layer has a window (model.sliding_window > 0, and a 'sliding' entry in "
     "model.layer_types when set)", lambda c: any(layer_windows(c)), "it is the RoPE base of the sliding layers"),
    ("mup_base_width", "model.parametrization='mup'", lambda c: c.parametrization == "mup",
     "standard parametrization has no base width"),
    ("attention_block_size", "model.attention_impl='blockwise' or model.context_parallel='ring'",
     lambda c: c.attention_impl == "blockwise" or c.context_parallel == "ring",
     "only the blockwise attention and the ring's steps work in blocks"),
    ("context_layout", "model.context_parallel='ring'", lambda c: c.context_parallel == "ring",
     "only the ring balances its causal work by the token layout (Ulysses sees whole sequences)"),
    ("attention_query_block", "model.attention_impl='xla' (or 'auto' resolving to it) and model.causal=True",
     lambda c: _runs_attention(c, "xla") if c.causal else False, "only causal xla attention splits the queries"),
    ("global_every", "model.sliding_window > 0", lambda c: c.sliding_window > 0,
     "without a window every layer attends globally"),
    ("quant_layers", "model.quant != 'none'", lambda c: c.quant != "none",
     "it picks the layers model.quant applies to"),
    ("scan_unroll", "model.scan_layers=True", lambda c: c.scan_layers, "it unrolls the layer scan"),
    *((k, "model.attention_impl='splash' (or 'auto' on TPU)", lambda c: _runs_attention(c, "splash"),
       "a tile size of the splash kernel") for k in SPLASH_BLOCK_KEYS),
    *((k, "model.moe_impl='megablox' (or 'auto' on TPU) and model.num_experts > 0",
       lambda c: _runs_moe(c, "megablox"), "a tile bound of the megablox kernels")
      for k in MEGABLOX_TILE_KEYS),
    ("pallas_interpret", "model.attention_impl='splash' or model.moe_impl='megablox'", lambda c: uses_pallas(c),
     "it runs the Pallas kernels in interpret mode, and only splash attention and megablox experts are ones"),
)


def _runs_attention(c, impl: str) -> bool | None:
  """Whether model.attention_impl runs `impl`; None (decided by the platform, not known here) under "auto" when its
  choice may be `impl` (model.attention.auto_impl: splash, cudnn or xla)."""
  if c.attention_impl == "auto":
    return None if impl in AUTO_CHOICES else False
  return c.attention_impl == impl


def _runs_moe(c, impl: str) -> bool | None:
  """Whether the experts run `impl` (False for a dense model); None under model.moe_impl=auto, which the platform
  decides (model.moe.resolve_impl: megablox, ragged or tiled)."""
  if not c.num_experts:
    return False
  return None if c.moe_impl == "auto" else c.moe_impl == impl


def uses_pallas(c) -> bool | None:
  """Whether the model runs a Pallas kernel (what model.pallas_interpret applies to); None where model.*_impl=auto
  leaves it to the platform (the kernels are what auto runs on TPUs, where interpret mode has no use)."""
  attention, experts = _runs_attention(c, "splash"), _runs_moe(c, "megablox")
  if attention or experts:
    return True
  return None if None in (attention, experts) else False


def default_model_config() -> ml_collections.ConfigDict:
  """Every model key with its default (a Llama-2-7B-shaped model); `configs/base.py` takes its `model` section
  from here, so this is the one place model keys and their defaults are defined."""
  c = ml_collections.ConfigDict()
  c.vocab_size = 32000  # tokens in the embedding table (tokenizer vocabulary, possibly padded)
  c.d_model = 4096  # residual stream width
  c.num_layers = 32  # transformer blocks
  c.num_heads = 32  # query heads
  c.num_kv_heads = 32  # key/value heads: == num_heads MHA, 1 MQA, otherwise GQA (must divide num_heads)
  c.head_dim = 128  # per-head width, independent of d_model / num_heads
  c.mlp_dim = 11008  # hidden width of the feed-forward block
  c.mlp_type = "swiglu"  # swiglu | geglu (gated) | gelu | relu (one input projection)
  c.norm_type = "rmsnorm"  # rmsnorm | layernorm (pre-norm in both cases)
  c.norm_eps = 1e-5  # epsilon inside the normalisation
  c.use_bias = False  # biases on every projection (off in Llama-style models; on only for comparison)
  c.qkv_bias = False  # biases on the q, k, v projections only (Qwen2/2.5; params q_bias, k_bias, v_bias)
  c.qk_norm = "none"  # none | head (RMSNorm of each q/k head over head_dim, one [K] scale: Qwen3, Gemma 3) | proj
  # (RMSNorm over the whole q and k projections, scales [H, K] and [G, K]: OLMo 2); after the biases, before RoPE
  c.norm_offset = False  # every norm multiplies by (1 + scale), scales initialised to 0 (Gemma)
  c.norm_position = "pre"  # pre: x + f(norm x) | sandwich: x + post_norm(f(norm x)) (Gemma 2/3) | post:
  # x + post_norm(f(x)) (OLMo 2); for both sublayers; the final norm stays in all three
  c.embed_scale = False  # embedding output times sqrt(d_model), the constant in the compute dtype (Gemma)
  c.attn_logit_softcap = 0.0  # > 0: attention scores cap * tanh(scores / cap), after scaling (Gemma 2); 0 = off
  c.final_logit_softcap = 0.0  # > 0: output logits cap * tanh(logits / cap), float32 (Gemma 2); 0 = off
  c.query_pre_attn_scalar = 0.0  # > 0: scores scaled by 1/sqrt(this) instead of 1/sqrt(head_dim) (Gemma 2/3)
  c.rope_theta = 10000.0  # RoPE base frequency
  c.rope_scaling = "none"  # none | llama3 (Llama 3.1) | linear (frequencies / factor) | dynamic (NTK: the base
  # grows once the input is longer than rope_original_max_len) | yarn (YaRN); model/rope.py, parameters below
  c.rope_scaling_factor = 8.0  # llama3, linear, dynamic, yarn scaling: factor
  c.rope_low_freq_factor = 1.0  # llama3 scaling: low_freq_factor
  c.rope_high_freq_factor = 4.0  # llama3 scaling: high_freq_factor
  c.rope_original_max_len = 8192  # llama3, yarn: original_max_position_embeddings; dynamic: the length past which
  # the base grows (Hugging Face's max_position_embeddings)
  c.rope_yarn_beta_fast = 32.0  # yarn: beta_fast (rotations where the ramp to interpolation starts)
  c.rope_yarn_beta_slow = 1.0  # yarn: beta_slow (rotations where it ends)
  c.rope_attention_factor = 0.0  # yarn: factor on cos and sin; 0 = YaRN's 0.1 * ln(rope_scaling_factor) + 1
  c.rope_yarn_truncate = True  # yarn: round the ramp's ends to whole dimensions (Hugging Face's `truncate`)
  c.rope_mscale_all_dim = 0.0  # yarn, > 0: attention scores times mscale^2, mscale = 0.1 * this * ln(factor) + 1
  # (DeepSeek-V2/V3's softmax scale; transformers' mscale_all_dim); 0 = off
  c.rope_local_theta = 0.0  # > 0: RoPE base of the layers with a window, unscaled (Gemma 3: 10000); 0 = every layer
  # uses rope_theta and rope_scaling
  c.attention_type = "mha"  # mha (multi-head / grouped-query / multi-query) | mla (Multi-head Latent Attention,
  # DeepSeek-V2/V3: low-rank q and kv projections, a decoupled RoPE key; the KV cache holds the latent; docs/moe.md)
  c.q_lora_rank = 0  # mla: rank of the query's low-rank projection (with its RMSNorm); 0 = one full q projection
  c.kv_lora_rank = 512  # mla: width of the compressed key/value latent (what the KV cache holds per token)
  c.qk_nope_head_dim = 128  # mla: per-head query/key width without RoPE
  c.qk_rope_head_dim = 64  # mla: per-head query width with RoPE, and of the one RoPE key shared by the heads
  c.v_head_dim = 128  # mla: per-head value width
  c.rope_interleave = False  # mla: RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's weights)
  c.max_seq_len = 4096  # longest sequence the model is configured for (HF max_position_embeddings)
  c.sliding_window = 0  # attention window in tokens (a token sees itself and window-1 before it); 0 = full causal; < 0 invalid
  c.global_every = 0  # with a window: every k-th layer (k-1, 2k-1, ...) attends globally; 0 = all layers windowed
  c.layer_types = ()  # () = sliding_window / global_every decide; else "sliding" | "full" per layer, the tuple
  # repeated over the layers (its length divides num_layers): sliding layers attend within sliding_window
  c.block_type = "sequential"  # sequential | parallel (GPT-J/PaLM: x + attn(norm x) + mlp(norm x))
  c.tie_embeddings = False  # share the input embedding with the output projection
  c.scan_layers = True  # stack layer parameters and lax.scan over them (compile time independent of depth)
  c.attention_impl = "auto"  # auto (splash on TPU, cudnn on GPU in bf16/fp16, else xla; model.attention.resolve_impl)
  # | xla (reference) | dot_product (jax.nn.dot_product_attention, cuDNN if it takes the call on GPU) | blockwise
  # | splash (the Pallas TPU kernel; model/splash.py) | cudnn (cuDNN flash attention: GPU, bf16/fp16)
  c.attention_block_size = 512  # query/key block length of the blockwise (flash-style) attention and of ring steps
  c.context_parallel = "all_gather"  # attention over mesh.sequence > 1: all_gather (K/V gathered on every device)
  # | ring (K/V blocks passed around the devices, blockwise math per step) | ulysses (all-to-all to head-split whole
  # sequences and back; the query heads per tensor shard must divide by mesh.sequence); docs/parallel.md
  c.context_layout = "zigzag"  # ring: zigzag (device i holds chunks i and 2n-1-i of 2n: equal causal work per
  # device; the sequence must divide by 2 * mesh.sequence) | contiguous (device i holds chunk i)
  c.splash_block_q = 512  # splash: query rows per tile of the forward kernel (clipped to the padded length)
  c.splash_block_kv = 512  # splash: keys per tile of the forward kernel
  c.splash_block_kv_compute = 512  # splash: keys per inner step of the forward kernel (divides splash_block_kv)
  c.splash_block_q_bwd = 512  # splash: query rows per tile of the backward kernels (dq and dk/dv)
  c.splash_block_kv_bwd = 512  # splash: keys per tile of the backward kernels
  c.pallas_interpret = False  # run the Pallas kernels (attention_impl=splash, moe_impl=megablox) in interpret mode: on
  # CPU, for tests
  c.attention_query_block = 128  # xla attention, causal, T > this: query blocks of about this length, each against
  # the keys up to its end only (the masked score blocks above the diagonal are skipped); 0 = the whole square
  c.dtype = "float32"  # computation dtype (bfloat16 on accelerators); logits and softmax statistics stay float32
  c.param_dtype = "float32"  # parameter (master weight) dtype
  c.init_std = 0.02  # standard deviation of the normal initialiser for weights
  c.num_experts = 0  # routed experts per Mixture-of-Experts layer; 0 = dense feed-forward in every layer
  c.experts_per_token = 2  # top-k: routed experts per token
  c.moe_every = 1  # layers k-1, 2k-1, ... are MoE and the rest dense (1 = all); num_layers must be a multiple
  c.num_shared_experts = 0  # always-on experts (DeepSeekMoE), each expert_mlp_dim wide, beside the routed ones
  c.expert_mlp_dim = 0  # hidden width of each expert; 0 = mlp_dim
  c.capacity_factor = 0.0  # 0 = dropless; > 0: an expert takes at most ceil(cf * k * seq / E) tokens per sequence
  c.router = "topk_softmax"  # topk_softmax (Mixtral: softmax over the k best logits) | softmax_topk (top k of
  # softmax) | sigmoid (DeepSeek-V3: sigmoid scores, chosen with a load-balancing bias; model/moe.py route)
  c.router_norm_topk = True  # sigmoid router: the k chosen scores renormalised to sum 1 (norm_topk_prob)
  c.routed_scaling_factor = 1.0  # routed experts' weights times this (DeepSeek-V3: 2.5)
  c.router_groups = 1  # group-limited routing: experts in this many groups (n_group; 1 = off)
  c.router_topk_groups = 1  # group-limited routing: a token picks its experts from this many groups (topk_group),
  # the groups ranked by the sum of their two best scores
  c.mtp_depth = 0  # multi-token prediction (DeepSeek-V3 sec. 2.2): modules predicting token t+1+d, d = 1..depth,
  # trained with train.mtp_loss_weight, not run by generation; 0 = off
  c.first_dense_layers = 0  # the first k layers keep a dense MLP (mlp_dim wide; DeepSeek's first_k_dense_replace)
  c.moe_impl = "auto"  # grouped expert matmul: auto (megablox on TPU, ragged on GPU, tiled on CPU; model.moe.resolve_impl)
  # | ragged (jax.lax.ragged_dot) | tiled (loops over experts and row tiles; CPU) | megablox (Pallas TPU kernels)
  c.megablox_tile_m = 512  # megablox: most rows (token-expert assignments) per tile; multiple of 128
  c.megablox_tile_k = 1024  # megablox: most contraction columns per tile (a divisor of both padded widths)
  c.megablox_tile_n = 1024  # megablox: most output columns per tile (a divisor of both padded widths)
  c.causal = True  # causal self-attention (decoder); False = bidirectional within each document (masked-LM encoder)
  c.parametrization = "sp"  # sp (standard) | mup (maximal update: width-scaled init, lr and output; model/mup.py)
  c.mup_base_width = 256  # mup: the d_model at which muP's init and learning rates equal SP's
  c.quant = "none"  # none | int8 (per-channel, int32 sums) | fp8 (e4m3 fwd, e5m2 grads, current scaling); model/quant.py
  c.quant_layers = ("attn", "mlp")  # layer types whose projections `quant` applies to: attn (q k v o), mlp (gate up down)
  c.scan_unroll = 1  # with scan_layers: layers per scan iteration; >= num_layers: a loop over the stack's slices
  # (faster steps, longer compile; docs/throughput.md)
  return c


def validate(cfg: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Checks a model config (ConfigDict or dict with the keys of `default_model_config`); returns it as a ConfigDict.

  Raises ValueError naming the offending key (`model.<key>`) and how to fix it.
  """
  defaults = default_model_config()
  keys = set(cfg.keys())
  unknown = sorted(keys - set(defaults.keys()))
  if unknown:
    raise ValueError(f"unknown model config key(s) {', '.join('model.' + k for k in unknown)}; "
                     f"known keys are listed in model/config.py (default_model_config)")
  missing = sorted(set(defaults.keys()) - keys)
  if missing:
    raise ValueError(f"model config lacks key(s) {', '.join('model.' + k for k in missing)}; "
                     "start from model.config.default_model_config() (or configs/base.py get_config().model)")
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
  if not isinstance(c.attention_query_block, int) or isinstance(c.attention_query_block, bool) or (
      c.attention_query_block < 0):
    raise ValueError(f"model.attention_query_block={c.attention_query_block!r} must be >= 1 tokens, or 0 to "
                     "compute the whole score square")
  _validate_splash(c)
  if not isinstance(c.global_every, int) or c.global_every < 0:
    raise ValueError(f"model.global_every={c.global_every!r} must be >= 0 (0 = every layer windowed)")
  _validate_families(c)
  if c.rope_scaling == "llama3" and c.rope_high_freq_factor <= c.rope_low_freq_factor:
    raise ValueError(f"model.rope_high_freq_factor={c.rope_high_freq_factor} must exceed "
                     f"model.rope_low_freq_factor={c.rope_low_freq_factor} for llama3 rope scaling")
  if c.init_std < 0:
    raise ValueError(f"model.init_std={c.init_std} must be >= 0")
  bad = [x for x in tuple(c.quant_layers) if x not in QUANT_LAYERS]
  if bad or isinstance(c.quant_layers, str):
    raise ValueError(f"model.quant_layers={c.quant_layers!r} must be a tuple of {', '.join(QUANT_LAYERS)}")
  if c.parametrization == "mup" and c.tie_embeddings:
    raise ValueError("model.tie_embeddings=True with model.parametrization='mup': muP treats the input embedding "
                     "and the output projection differently; untie them (tie_embeddings=False)")
  if not isinstance(c.causal, bool):
    raise ValueError(f"model.causal={c.causal!r} must be True or False")
  if not c.causal and c.sliding_window:
    raise ValueError(f"model.sliding_window={c.sliding_window} with model.causal=False: the window is causal "
                     "(a token sees window-1 tokens before it); use sliding_window=0 for a bidirectional encoder")
  _validate_moe(c)
  _validate_mla(c)
  if not isinstance(c.mtp_depth, int) or isinstance(c.mtp_depth, bool) or c.mtp_depth < 0:
    raise ValueError(f"model.mtp_depth={c.mtp_depth!r} must be an integer >= 0 (0 = no multi-token prediction)")
  if c.mtp_depth and not c.causal:
    raise ValueError(f"model.mtp_depth={c.mtp_depth} with model.causal=False: multi-token prediction is a "
                     "decoder's objective")
  return c


def _validate_mla(c: ml_collections.ConfigDict) -> None:
  for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive integer")
  if not isinstance(c.q_lora_rank, int) or isinstance(c.q_lora_rank, bool) or c.q_lora_rank < 0:
    raise ValueError(f"model.q_lora_rank={c.q_lora_rank!r} must be an integer >= 0 (0 = a full q projection)")
  if c.attention_type != "mla":
    return
  if c.qk_rope_head_dim % 2:
    raise ValueError(f"model.qk_rope_head_dim={c.qk_rope_head_dim} must be even: RoPE rotates pairs of dimensions")
  for key, bad, why in (("qk_norm", c.qk_norm != "none", "MLA normalises its latents instead"),
                        ("qkv_bias", c.qkv_bias or c.use_bias, "MLA's projections have no biases here"),
                        ("causal", not c.causal, "MLA is a decoder's attention"),
                        ("rope_local_theta", bool(c.rope_local_theta), "MLA layers share one RoPE"),
                        ("quant", c.quant != "none" and "attn" in c.quant_layers,
                         "MLA's projections are not quantised; set quant_layers=('mlp',)")):
    if bad:
      raise ValueError(f"model.{key}={c[key]!r} with model.attention_type='mla': {why}")


def _validate_families(c: ml_collections.ConfigDict) -> None:
  """The keys that make the one transformer a Qwen, Gemma or OLMo model (softcaps, qk norms, layer types...)."""
  for k in _OFF_OR_POSITIVE_FLOATS:
    if not isinstance(c[k], (int, float)) or isinstance(c[k], bool) or not c[k] >= 0:
      raise ValueError(f"model.{k}={c[k]!r} must be a number >= 0 (0 = off)")
  for k in _BOOLS:
    if not isinstance(c[k], bool):
      raise ValueError(f"model.{k}={c[k]!r} must be True or False")
  types = c.layer_types
  if isinstance(types, str) or not isinstance(types, (tuple, list)) or any(t not in LAYER_TYPES for t in types):
    raise ValueError(f"model.layer_types={types!r} must be a tuple of {' / '.join(LAYER_TYPES)} entries (or () "
                     "to let model.sliding_window and model.global_every decide)")
  if types:
    if c.num_layers % len(types):
      raise ValueError(f"model.layer_types has {len(types)} entries, which do not divide model.num_layers="
                       f"{c.num_layers}: the tuple is repeated over the layers (give one entry per layer, or a "
                       "pattern whose length divides num_layers)")
    if c.global_every:
      raise ValueError(f"model.layer_types with model.global_every={c.global_every}: both choose the global layers; "
                       "mark them 'full' in layer_types and leave global_every=0")
    if "sliding" in types and not c.sliding_window:
      raise ValueError("model.layer_types has 'sliding' layers but model.sliding_window=0: set the window they "
                       "attend within (tokens)")
  if c.attn_logit_softcap and c.attention_impl in ("cudnn", "dot_product"):
    raise ValueError(f"model.attn_logit_softcap={c.attn_logit_softcap} with model.attention_impl="
                     f"{c.attention_impl!r}: jax.nn.dot_product_attention (and cuDNN through it) cannot cap scores; "
                     "use auto (xla on GPUs then), xla, blockwise or splash")
  if c.query_pre_attn_scalar and c.parametrization == "mup":
    raise ValueError(f"model.query_pre_attn_scalar={c.query_pre_attn_scalar} with model.parametrization='mup': "
                     "both set the score scale (muP: 1/head_dim); drop one")
  if c.norm_position != "pre" and c.block_type == "parallel":
    raise ValueError(f"model.norm_position={c.norm_position!r} with model.block_type='parallel': the parallel block "
                     "shares one pre-norm; use norm_position='pre' or block_type='sequential'")
  if c.rope_scaling == "yarn" and c.rope_yarn_beta_fast < c.rope_yarn_beta_slow:
    raise ValueError(f"model.rope_yarn_beta_fast={c.rope_yarn_beta_fast} must be >= model.rope_yarn_beta_slow="
                     f"{c.rope_yarn_beta_slow}: the ramp runs from the fast to the slow boundary")
  if c.rope_scaling == "dynamic" and c.head_dim == 2:
    raise ValueError("model.rope_scaling='dynamic' with model.head_dim=2: the NTK exponent head_dim/(head_dim-2) "
                     "is undefined; use a larger head_dim")


def _validate_splash(c: ml_collections.ConfigDict) -> None:
  for k in SPLASH_BLOCK_KEYS:
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1 or c[k] % SPLASH_GRANULE:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive multiple of {SPLASH_GRANULE} tokens (the TPU's lane "
                       "width)")
  if c.splash_block_kv % c.splash_block_kv_compute:
    raise ValueError(f"model.splash_block_kv_compute={c.splash_block_kv_compute} must divide "
                     f"model.splash_block_kv={c.splash_block_kv}")
  if not isinstance(c.pallas_interpret, bool):
    raise ValueError(f"model.pallas_interpret={c.pallas_interpret!r} must be True or False")


def _validate_moe(c: ml_collections.ConfigDict) -> None:
  for k in ("num_experts", "num_shared_experts", "expert_mlp_dim"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 0:
      raise ValueError(f"model.{k}={c[k]!r} must be an integer >= 0")
  for k in ("experts_per_token", "moe_every"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive integer")
  if not isinstance(c.capacity_factor, (int, float)) or c.capacity_factor < 0:
    raise ValueError(f"model.capacity_factor={c.capacity_factor!r} must be >= 0 (0 = dropless)")
  for k in MEGABLOX_TILE_KEYS:
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1 or c[k] % MEGABLOX_GRANULE:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive multiple of {MEGABLOX_GRANULE} (the TPU's lane "
                       "width)")
  if not c.num_experts:
    return
  if c.router == "sigmoid" and c.capacity_factor:
    raise ValueError(f"model.capacity_factor={c.capacity_factor} with model.router='sigmoid': DeepSeek's routing is "
                     "dropless (its load is balanced by the score bias); use capacity_factor=0")
  if c.experts_per_token > c.num_experts:
    raise ValueError(f"model.experts_per_token={c.experts_per_token} exceeds model.num_experts={c.num_experts}")
  if not isinstance(c.routed_scaling_factor, (int, float)) or isinstance(c.routed_scaling_factor, bool) or not (
      c.routed_scaling_factor > 0):
    raise ValueError(f"model.routed_scaling_factor={c.routed_scaling_factor!r} must be a positive number")
  for k in ("router_groups", "router_topk_groups"):
    if not isinstance(c[k], int) or isinstance(c[k], bool) or c[k] < 1:
      raise ValueError(f"model.{k}={c[k]!r} must be a positive integer (1 = no group limit)")
  if c.num_experts % c.router_groups:
    raise ValueError(f"model.router_groups={c.router_groups} must divide model.num_experts={c.num_experts}")
  if c.router_topk_groups > c.router_groups:
    raise ValueError(f"model.router_topk_groups={c.router_topk_groups} exceeds model.router_groups="
                     f"{c.router_groups}")
  if c.router_groups > 1 and c.num_experts // c.router_groups < 2:
    raise ValueError(f"model.router_groups={c.router_groups}: a group ranks by its two best scores, so it needs >= 2 "
                     f"experts (num_experts={c.num_experts})")
  if c.experts_per_token > c.router_topk_groups * (c.num_experts // c.router_groups):
    raise ValueError(f"model.experts_per_token={c.experts_per_token} exceeds the experts of the "
                     f"router_topk_groups={c.router_topk_groups} groups a token may pick from")
  dense = c.first_dense_layers
  if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < c.num_layers:
    raise ValueError(f"model.first_dense_layers={dense!r} must be >= 0 and below model.num_layers={c.num_layers}")
  if (c.num_layers - dense) % c.moe_every:
    raise ValueError(f"model.num_layers={c.num_layers} less model.first_dense_layers={dense} is not a multiple of "
                     f"model.moe_every={c.moe_every}: the layer scan repeats groups of moe_every layers")
  if c.mlp_type not in GATED:
    raise ValueError(f"model.mlp_type={c.mlp_type!r} with model.num_experts > 0: experts are gated (swiglu or geglu)")
  if c.block_type != "sequential":
    raise ValueError(f"model.block_type={c.block_type!r} with model.num_experts > 0: MoE layers are sequential")
  if c.use_bias:
    raise ValueError("model.use_bias=True with model.num_experts > 0: experts and router have no biases")


def is_moe_layer(c: ml_collections.ConfigDict, i: int) -> bool:
  """Layer i (0-based) has a Mixture-of-Experts feed-forward: after the first_dense_layers, every moe_every-th
  (layers f + moe_every - 1, f + 2 * moe_every - 1, ... with f = first_dense_layers)."""
  f = c.first_dense_layers if c.num_experts else 0
  return bool(c.num_experts) and i >= f and (i - f + 1) % c.moe_every == 0


def dense_prefix(c: ml_collections.ConfigDict) -> int:
  """Layers before the repeated units: model.first_dense_layers of an MoE model (a stack of their own), else 0."""
  return c.first_dense_layers if c.num_experts else 0


def attention_dims(c: ml_collections.ConfigDict) -> tuple[int, int, int]:
  """(query/key width per head, value width per head, rotated width per head) of the model's attention."""
  if c.attention_type == "mla":
    return c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.qk_rope_head_dim
  return c.head_dim, c.head_dim, c.head_dim


def layers_per_unit(c: ml_collections.ConfigDict) -> int:
  """Layers in one repeated unit of the layer stack (what the layer scan iterates over)."""
  return c.moe_every if c.num_experts else 1


def layer_windows(c: ml_collections.ConfigDict) -> tuple[int, ...]:
  """Attention window per layer in tokens (0 = global/full causal): sliding_window on the "sliding" layers of
  layer_types (repeated over the layers) when set, else on every layer but the global_every-th ones."""
  if c.layer_types:
    types = tuple(c.layer_types) * (c.num_layers // len(c.layer_types))
    return tuple(c.sliding_window if t == "sliding" else 0 for t in types)

  def window(i):
    if c.sliding_window == 0 or (c.global_every and (i + 1) % c.global_every == 0):
      return 0
    return c.sliding_window
  return tuple(window(i) for i in range(c.num_layers))
