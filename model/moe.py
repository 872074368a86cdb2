"""Mixture-of-Experts feed-forward: a float32 top-k router (softmax or sigmoid scores, group-limited selection, a
selection-only score bias), dropless or capacity-limited assignments, and the per-layer statistics the training
losses read. The experts' computation and its all-to-all dispatch over the mesh are model/experts.py.

Shapes: B batch, L length, D model width, E experts, F expert hidden width, K experts per token (top-k),
C capacity per sequence.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model import axes
from model import dense
from model import experts
from model import megablox
from model import remat
from model.axes import BATCH, EMBED, EXPERTS, LENGTH, MLP
from model.config import DTYPES

# moe_impl=auto on CPUs: tiled. One MoE layer forward + backward over 2048 tokens on the 2-core CPU machine
# (benchmarks/moe.py): tiled 0.068 s against ragged 0.40 s (XLA's CPU ragged_dot multiplies every group with every
# row); a training step of the MoE benchmark model 0.63 s vs 1.85 s (docs/moe.md).
AUTO_CPU = "tiled"
STATS = ("moe_aux_loss", "router_z_loss", "moe_load_max_mean", "moe_dropped_frac", "moe_expert_load")
# [MoE layers, E]: each MoE layer's expert shares, in layer order, then the multi-token heads' when they run
# (model(..., return_aux=True) adds it for router=sigmoid, outside pipelines); the score-bias update reads it.
LAYER_LOAD = "moe_layer_load"


def _top_k(x_BL_, k: int) -> tuple[jax.Array, jax.Array]:
  """jax.lax.top_k over the last axis of a selection score (no gradient), each device on its own tokens: XLA's
  SPMD partitioner replicates a TopK, so a batch split over the mesh would be gathered and ranked whole on every
  device."""
  x_BL_ = jax.lax.stop_gradient(x_BL_)
  if not axes.active():
    return jax.lax.top_k(x_BL_, k)
  spec = axes.spec((BATCH, LENGTH) + (None,) * (x_BL_.ndim - 2))
  return jax.shard_map(lambda a: tuple(jax.lax.top_k(a, k)), in_specs=spec, out_specs=(spec, spec),
                       check_vma=False)(x_BL_)


def route(logits_BLE: jax.Array, k: int, kind: str, bias_E: jax.Array | None = None, groups: int = 1,
          topk_groups: int = 1, norm_topk: bool = True, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Top-k routing in float32 -> (weights_BLK float32, experts_BLK int32).

  topk_softmax (Mixtral): the k largest logits, softmax over those k (= softmax over all E, keep the top k and
  renormalise them to sum 1). softmax_topk (Switch, DeepSeek-V2): softmax over all E, keep the k largest
  probabilities without renormalising. sigmoid (DeepSeek-V3 sec. 2.1.2): scores s = sigmoid(logits); experts are
  chosen by s + bias_E (the load-balancing bias, selection only: no gradient reaches it) and weighted by their
  own s, renormalised to sum 1 when norm_topk.

  Group-limited routing (groups > 1, DeepSeek's n_group / topk_group): the E experts form `groups` equal groups,
  each ranked by the sum of its two best selection scores; a token chooses only among the experts of its
  `topk_groups` best groups. The weights are then multiplied by `scale` (routed_scaling_factor).
  """
  logits_BLE = logits_BLE.astype(jnp.float32)
  if kind == "sigmoid":
    scores_BLE = jax.nn.sigmoid(logits_BLE)
  elif kind in ("topk_softmax", "softmax_topk"):
    scores_BLE = jax.nn.softmax(logits_BLE, axis=-1)
  else:
    raise ValueError(f"model.router={kind!r} is not one of topk_softmax, softmax_topk, sigmoid")
  choice_BLE = scores_BLE if bias_E is None else scores_BLE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
  if groups > 1:
    B, L, E = choice_BLE.shape
    grouped_BLGE = choice_BLE.reshape(B, L, groups, E // groups)
    group_BLG = jnp.sum(_top_k(grouped_BLGE, 2)[0], axis=-1)
    _, best_BLT = _top_k(group_BLG, topk_groups)
    allowed_BLG = jnp.sum(jax.nn.one_hot(best_BLT, groups, dtype=jnp.int32), axis=-2) > 0
    choice_BLE = jnp.where(jnp.repeat(allowed_BLG, E // groups, axis=-1), choice_BLE, -jnp.inf)
  _, experts_BLK = _top_k(choice_BLE, k)
  if kind == "topk_softmax":  # the renormalised top k of the softmax = the softmax of the k chosen logits
    weights_BLK = jax.nn.softmax(jnp.take_along_axis(logits_BLE, experts_BLK, axis=-1), axis=-1)
  else:
    weights_BLK = jnp.take_along_axis(scores_BLE, experts_BLK, axis=-1)
  if kind == "sigmoid" and norm_topk:  # DeepSeek-V3's 1e-20 keeps it finite where every chosen score underflows
    weights_BLK = weights_BLK / (jnp.sum(weights_BLK, axis=-1, keepdims=True) + 1e-20)
  if scale != 1.0:
    weights_BLK = weights_BLK * jnp.float32(scale)
  return weights_BLK, experts_BLK.astype(jnp.int32)


def capacity(capacity_factor: float, k: int, seq_len: int, num_experts: int) -> int:
  """Assignments an expert takes per sequence: ceil(capacity_factor * k * seq_len / E); 0 = unlimited."""
  if capacity_factor <= 0:
    return 0
  return max(1, math.ceil(capacity_factor * k * seq_len / num_experts))


def keep_mask(experts_BLK: jax.Array, valid_BL: jax.Array, num_experts: int, cap: int) -> jax.Array:
  """bool [B, L, K]: which assignments an expert accepts under capacity `cap` per sequence (0 = all).

  Priority (GShard): every token's first choice before any token's second choice, then token order; padding
  (valid 0) never takes a place. The mask depends only on each sequence's own routing, so it is the same on any
  mesh and under gradient accumulation.
  """
  keep_BLK = jnp.broadcast_to(valid_BL[..., None], experts_BLK.shape)
  if not cap:
    return keep_BLK
  B, L, K = experts_BLK.shape
  onehot_BLKE = jax.nn.one_hot(experts_BLK, num_experts, dtype=jnp.int32) * keep_BLK[..., None]
  onehot_BKLE = jnp.swapaxes(onehot_BLKE, 1, 2).reshape(B, K * L, num_experts)
  before_BKLE = jnp.cumsum(onehot_BKLE, axis=1) - onehot_BKLE  # assignments ahead in the expert's queue
  place_BLK = jnp.swapaxes(jnp.sum(before_BKLE * onehot_BKLE, -1).reshape(B, K, L), 1, 2)
  return keep_BLK & (place_BLK < cap)


def router_stats(logits_BLE: jax.Array, experts_BLK: jax.Array, keep_BLK: jax.Array,
                 valid_BL: jax.Array, kind: str = "topk_softmax") -> dict[str, jax.Array]:
  """Float32 statistics of one MoE layer over the valid (non-padding) tokens (scalars, and one [E] vector).

    moe_aux_loss      E * sum_e f_e * P_e (Switch Transformer eq. 4-6 with top-k counting, as transformers'
                      `load_balancing_loss_func`): f_e = assignments to e per token (sums to k over e),
                      P_e = mean router probability of e (router=sigmoid: each token's sigmoid scores
                      normalised to sum 1, DeepSeek-V3's balance loss over the batch). Equals k at uniform
                      routing.
    router_z_loss     mean over tokens of logsumexp(router logits)^2 (ST-MoE).
    moe_load_max_mean max_e n_e / mean_e n_e with n_e the assignments to expert e (1 = balanced).
    moe_dropped_frac  assignments dropped by the capacity limit / all assignments.
    moe_expert_load   [E]: n_e / sum_e n_e, each expert's share of the assignments (before drops).
  """
  E = logits_BLE.shape[-1]
  K = experts_BLK.shape[-1]
  logits_BLE = logits_BLE.astype(jnp.float32)
  valid_BL = valid_BL.astype(jnp.float32)
  tokens = jnp.maximum(jnp.sum(valid_BL), 1.0)
  if kind == "sigmoid":
    scores_BLE = jax.nn.sigmoid(logits_BLE)
    probs_BLE = scores_BLE / jnp.sum(scores_BLE, -1, keepdims=True)
  else:
    probs_BLE = jax.nn.softmax(logits_BLE, -1)
  probs_E = jnp.sum(probs_BLE * valid_BL[..., None], axis=(0, 1)) / tokens
  load_E = jnp.sum(jax.nn.one_hot(experts_BLK, E) * valid_BL[..., None, None], axis=(0, 1, 2))
  z_BL = jax.nn.logsumexp(logits_BLE, -1)
  return {
      "moe_aux_loss": E * jnp.sum(load_E / tokens * probs_E),
      "router_z_loss": jnp.sum(jnp.square(z_BL) * valid_BL) / tokens,
      "moe_load_max_mean": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9),
      "moe_dropped_frac": 1.0 - jnp.sum(keep_BLK.astype(jnp.float32)) / (tokens * K),
      "moe_expert_load": load_E / (tokens * K),
  }


def update_score_bias(params, layer_load_NE: jax.Array, rate: float):
  """DeepSeek-V3's auxiliary-loss-free balancing (sec. 2.1.2) on a pure-dict parameter tree: every MoE layer's
  `score_bias` b [E] becomes b + rate * sign(mean_e load - load_e) from that layer's expert load over the step's
  global batch (layer_load_NE, rows in layer order: the order the tree's `score_bias` leaves flatten in, one row per
  layer of a stacked leaf). Overloaded experts' biases fall, underloaded ones' rise; the gradient never moves them."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  is_bias = lambda path: getattr(path[-1], "key", None) == "score_bias"
  biases = [leaf for path, leaf in flat if is_bias(path)]
  E = layer_load_NE.shape[-1]
  rows = [leaf.size // E for leaf in biases]
  if sum(rows) != layer_load_NE.shape[0]:
    raise ValueError(f"{sum(rows)} MoE layers' score biases but loads for {layer_load_NE.shape[0]}")
  load_NE = layer_load_NE.astype(jnp.float32)
  delta_NE = jnp.float32(rate) * jnp.sign(jnp.mean(load_NE, axis=-1, keepdims=True) - load_NE)
  deltas = iter(jnp.split(delta_NE, [sum(rows[:i]) for i in range(1, len(rows))]))
  def bump(path, leaf):
    if not is_bias(path):
      return leaf
    return (leaf.astype(jnp.float32) + next(deltas).reshape(leaf.shape)).astype(leaf.dtype)
  return jax.tree_util.tree_map_with_path(bump, params)


def resolve_impl(cfg, platform: str) -> str:
  """The grouped matmul a model config's experts run on `platform` ("cpu", "gpu", "tpu"): for model.moe_impl=auto,
  megablox on TPUs (the Pallas kernels), ragged on GPUs (`jax.lax.ragged_dot`, XLA's grouped GEMM), tiled on CPUs
  (AUTO_CPU, measured); else model.moe_impl itself once it is known to run there (ValueError naming the key for
  megablox off TPU without model.pallas_interpret). "none" for a dense model."""
  if not cfg.num_experts:
    return "none"
  impl = cfg.moe_impl
  if impl == "auto":
    return {"tpu": "megablox", "gpu": "ragged"}.get(platform, AUTO_CPU)
  if impl == "megablox":
    megablox.check_platform(cfg.pallas_interpret, platform)
  return impl


class MoE(nnx.Module):
  """Routed experts (plus optional shared experts) replacing a block's MLP.

  `moe(x_BLD, valid_BL) -> (y_BLD, stats)`: valid_BL marks real tokens (padding neither counts in the statistics
  nor takes an expert's capacity); stats are `router_stats`' float32 scalars.
  """

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    D, E, F = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim or cfg.mlp_dim
    self.k, self.kind, self.cf = cfg.experts_per_token, cfg.router, cfg.capacity_factor
    # route()'s group, normalisation and scale options (a tuple: static module attributes must be hashable)
    self.routing = (cfg.router_groups, cfg.router_topk_groups, cfg.router_norm_topk, float(cfg.routed_scaling_factor))
    self.impl = cfg.moe_impl  # an explicit kernel is checked where it is traced (megablox.gmm): the mesh decides
    if self.impl == "auto":
      self.impl = resolve_impl(cfg, megablox.target_platform())
    if self.impl == "megablox":  # the kernels' static settings (tiles, interpret mode) travel with the impl
      self.impl = megablox.options(cfg)
    self.num_experts, self.dtype = E, DTYPES[cfg.dtype]
    self.act = jax.nn.silu if cfg.mlp_type == "swiglu" else lambda g: jax.nn.gelu(g, approximate=True)
    self.router = dense.param(rngs, (D, E), (EMBED, None), cfg)
    if cfg.router == "sigmoid":  # DeepSeek-V3's e_score_correction_bias: moves selection only, never gets gradient
      self.score_bias = dense.param(rngs, (E,), (None,), cfg, "zeros")
    self.gate = dense.param(rngs, (E, D, F), (EXPERTS, EMBED, MLP), cfg)
    self.up = dense.param(rngs, (E, D, F), (EXPERTS, EMBED, MLP), cfg)
    self.down = dense.param(rngs, (E, F, D), (EXPERTS, MLP, EMBED), cfg)
    if cfg.num_shared_experts:
      shared_cfg = cfg.copy_and_resolve_references()
      shared_cfg.mlp_dim = cfg.num_shared_experts * F  # N shared experts = one MLP N times as wide
      self.shared = dense.Mlp(shared_cfg, rngs=rngs)

  def __call__(self, x_BLD: jax.Array, valid_BL: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    dt = self.dtype
    logits_BLE = jnp.einsum("bld,de->ble", x_BLD.astype(jnp.float32), self.router[...].astype(jnp.float32))
    bias_E = self.score_bias[...] if hasattr(self, "score_bias") else None
    weights_BLK, experts_BLK = route(logits_BLE, self.k, self.kind, bias_E, *self.routing)
    cap = capacity(self.cf, self.k, x_BLD.shape[1], self.num_experts)
    keep_BLK = keep_mask(experts_BLK, valid_BL, self.num_experts, cap)
    y_BLD = experts.dispatch(x_BLD, experts_BLK, weights_BLK, keep_BLK, self.gate[...].astype(dt), self.up[...].astype(dt),
                     self.down[...].astype(dt), self.act, self.impl)
    if hasattr(self, "shared"):
      y_BLD = y_BLD + self.shared(x_BLD)
    y_BLD = remat.tag(axes.constrain(y_BLD.astype(dt), (BATCH, LENGTH, EMBED)), remat.MLP_OUT)
    return y_BLD, router_stats(logits_BLE, experts_BLK, keep_BLK, valid_BL, self.kind)
