"""The training step: sharded state, one jitted `(state, batch) -> (state, metrics)`, and a minimal driver.

State (a pytree of jax.Arrays, sharded by the logical-axis rules):
  params     the trainable float32 master weights: the model's nnx.Param tree as a pure dict (with LoRA or an
             objective's extra parameters, a dict holding them; see Trainer)
  frozen     weights the optimizer never touches (the base model under LoRA, a reference model, a distillation
             teacher of its own config); only if any
  opt_state  optax state of `train.core.optimizer.make` over `params` (Adam moments follow the parameters' sharding)
  step       int32 scalar, advances every call (also over skipped non-finite steps)
  rng        uint32[2] base key of the training stream (per-step randomness is fold_in(rng, step)); split from
             the seed apart from the parameter-init key, so it equals none of the keys init draws
  loss_scale {"scale": float32, "good_steps": int32} of dynamic loss scaling (train.core.optimizer.loss_scale_update);
             only with loss scaling (model.dtype=float16 by default, train.loss_scale)

Driver: `python -m train.step [--config=tiny] [--config.train.steps=5 ...]` runs the step on synthetic packed
data and prints one JSON line of metrics per step (the full loop is `python -m train`).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from common.segments import positions_from_segments
from configs import validate as config_validate
import model as model_lib
from model import basequant
from model import lora as lora_lib
from model import mup as mup_lib
from model import moe as moe_lib
from model import attention as attention_lib
import parallel
from parallel import pipeline as pipeline_lib
from parallel import rules as rules_lib
from train.planning import hardware
from train.planning import mfu as mfu_lib
from train import objectives
from train.core import optimizer as optimizer_lib

# XLA options trading run time for compile time (tiny test models compile ~2x faster on CPU).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# XLA options that overlap collectives with compute (train.xla_overlap; docs/pipeline.md): on TPU the
# latency-hiding scheduler, async all-gathers, all-reduces and collective-permutes, and the gradients'
# data-parallel all-reduce overlapped with the backward pass (what MaxText's recipes pass in LIBTPU_INIT_ARGS); on
# GPU the latency-hiding scheduler, pipelined collectives in scanned loops and collective matmul (windowed einsum)
# for tensor parallelism.
OVERLAP_OPTIONS = {
    "tpu": {"xla_tpu_enable_latency_hiding_scheduler": True, "xla_enable_async_all_gather": "true",
            "xla_enable_async_all_reduce": "true", "xla_enable_async_collective_permute": "true",
            "xla_tpu_enable_data_parallel_all_reduce_opt": True,
            "xla_tpu_data_parallel_opt_different_sized_ops": True},
    "gpu": {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_pipelined_all_gather": True,
            "xla_gpu_enable_pipelined_reduce_scatter": True, "xla_gpu_enable_pipelined_all_reduce": True,
            "xla_gpu_enable_while_loop_double_buffering": True, "xla_gpu_multi_streamed_windowed_einsum": True,
            "xla_gpu_threshold_for_windowed_einsum_mib": 0},
}
# Continuation fusion (collectives fused into the compute that consumes them) on TPU v5e only: libtpu 0.0.50
# refuses it elsewhere ("not supported/recommended on platforms other than TPU v5e ... incorrect results, hang").
CONTINUATION_FUSION = {"xla_tpu_enable_async_collective_fusion": True,
                       "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
                       "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
                       "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
                       "xla_tpu_overlap_compute_collective_tc": True}


def overlap_options(device) -> dict[str, Any]:
  """OVERLAP_OPTIONS for `device`'s platform, with CONTINUATION_FUSION on a TPU v5e ("TPU v5 lite")."""
  options = dict(OVERLAP_OPTIONS.get(device.platform, {}))
  chip = hardware.chip_for_device_kind(device.device_kind) if device.platform == "tpu" else None
  if chip is not None and chip.tpu_family == "v5e":
    options.update(CONTINUATION_FUSION)
  return options


STEP_METRICS = ("grad_norm", "param_norm", "lr", "nonfinite")  # reported by every objective's step
EVAL_KEY = 2**31 - 1  # folded into the train rng for `Objective.prepare` of eval batches (steps never reach it)
LORA_DROPOUT_KEY = 1  # folded into a step's key for lora_dropout's masks (the objective's prepare takes the step's key)
LOSS_SCALE_METRICS = ("loss_scale", "overflow")  # added under dynamic loss scaling
MOE_METRICS = model_lib.moe.STATS  # MoE models add these (means over MoE layers and microbatches)
EXPERT_LOAD = "moe_expert_load"  # the [E] vector among them, logged as moe_load/<expert> (share of assignments)
LAYER_LOAD = model_lib.moe.LAYER_LOAD  # [MoE layers, E] (router=sigmoid): what the score-bias update reads


_SAID: set[str] = set()


def _say_once(*lines: str) -> None:
  """Prints each line on stderr (process 0), once per process: Trainers are built many times by a compile search."""
  for line in lines:
    if line not in _SAID and jax.process_index() == 0:
      _SAID.add(line)
      print(line, file=sys.stderr, flush=True)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def _follow_params(opt_state, param_shardings, default, params):
  """Shardings for an optimizer state: a leaf whose key path ends with a parameter's path (Adam's mu/nu, also
  inside masked / multi-transform states) and has its shape takes that parameter's sharding; one with the shape
  less one axis (Adafactor's factored row / column moments) the sharding less that axis; counters, Adafactor's
  (1,) placeholders and the like `default`."""
  by_path = {tuple(path): (s, p.shape) for (path, s), p in zip(jax.tree_util.tree_leaves_with_path(param_shardings),
                                                                 jax.tree.leaves(params))}
  def lookup(path, leaf):
    for i in range(len(path)):
      found = by_path.get(tuple(path[i:]))
      if found is None:
        continue
      s, shape = found
      if tuple(leaf.shape) == tuple(shape):
        return s
      spec = tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
      for axis in range(len(shape)):
        if len(leaf.shape) == len(shape) - 1 and tuple(leaf.shape) == tuple(shape[:axis] + shape[axis + 1:]):
          return NamedSharding(s.mesh, PartitionSpec(*(spec[:axis] + spec[axis + 1:])))
      return default
    return default
  return jax.tree_util.tree_map_with_path(lookup, opt_state)


class Trainer:
  """Builds the sharded train state and the jitted step of `config.train.objective` on `mesh` (module docstring).

  The objective (train/objectives/) declares its batch arrays, loss and metric sums, extra trainable parameters
  and frozen models; the Trainer owns the rest: shardings, jit, accumulation, clipping, non-finite skipping, the
  optimizer over the trainable parameters only, and the state checkpoints save. With train.lora_rank > 0 the
  model's weights are frozen and LoRA adapters on train.lora_targets are trained instead (model/lora.py).

  State layout: `params` is what the optimizer trains, `frozen` (present only when non-empty) what it does not:
    plain:  params = the model's parameter tree
    LoRA:   params = {"lora": adapters, **extras}, frozen = {"model": model tree, ...}
    extras: params = {"model": model tree, **extras} (objective heads)
  plus frozen[name] = a copy of the starting model for each of the objective's `frozen_models`, and a model of its
  own config for each of its `frozen_configs` (a distillation teacher: its own graphdef, its parameters sharded by
  the same rules on the same mesh; random until train/core/setup.py loads its weights).

  Checks before anything compiles (ValueError naming the key / axis): heads vs the tensor axis, parameter
  dimensions vs their mesh axes, batch_size vs grad_accum and data x fsdp, rows per process (only the batch's
  axes may span processes), seq_len vs the sequence axis, and with mesh.stage > 1 the pipeline schedule (layers
  per stage, microbatches >= stages, rows per microbatch; parallel.pipeline.check).
  """

  def __init__(self, config, mesh: jax.sharding.Mesh, compiler_options: dict[str, Any] | None = None):
    """`compiler_options`: XLA options for every compile of this trainer (e.g. FAST_COMPILE in tests), on top of
    overlap_options(the mesh's devices) when config.train.xla_overlap is set."""
    self.config, self.mesh = config, mesh
    t = config.train
    if t.xla_overlap:
      compiler_options = {**overlap_options(mesh.devices.flat[0]), **(compiler_options or {})}
    self._make_objective()
    self.rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh)
    self._check_batch()  # first: it reads only the devices' processes, which a planning search fakes
    self._check_conditional_keys()
    self.pipeline = self._pipeline_schedule()
    if t.router_bias_update_rate and not self._layer_loads():
      raise ValueError(f"config.train.router_bias_update_rate={t.router_bias_update_rate} with mesh.stage > 1: the "
                       "pipeline averages its stages' expert loads, so no per-layer load reaches the score-bias "
                       "update; use mesh.stage=1 or router_bias_update_rate=0")
    self.lr_fn = optimizer_lib.schedule(t)
    self.loss_scaling = optimizer_lib.uses_loss_scaling(config)
    self._replicated = parallel.sharding.replicated(mesh)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # abstract: no eager op, so AOT on any backend works
    param_specs, model_params = self._abstract_model(key)
    self._abstract_frozen_configs()
    self._place_state(key, param_specs, model_params)
    self._jit(compiler_options)
    self._compiled = None

  def _check_conditional_keys(self) -> None:
    """configs.validate's conditional keys that read the mesh (platform, stage count): ConfigError (a ValueError)
    naming the key, or a warning on stderr (train.xla_overlap off TPU/GPU); and that a Pallas TPU kernel
    (model.attention_impl=splash, model.moe_impl=megablox) compiles for the mesh's platform (ValueError naming the
    key). Sets `attention_impl` and `moe_impl`: the kernels the step runs (auto resolved; said once; `runtime`)."""
    facts = {"platform": self.mesh.devices.flat[0].platform, "stage": self.mesh.shape["stage"]}
    m = self.config.model
    self.attention_impl = attention_lib.resolve_impl(m, facts["platform"])
    self.moe_impl = moe_lib.resolve_impl(m, facts["platform"])
    auto = [f"model.{key}=auto runs {impl} on {facts['platform']}" for key, impl in
            (("attention_impl", self.attention_impl), ("moe_impl", self.moe_impl)) if m[key] == "auto" and
            impl != "none"]
    if auto:
      _say_once(f"kernels: {'; '.join(auto)}", *attention_lib.auto_inert_keys(
          m, {"attention_impl": self.attention_impl, "moe_impl": self.moe_impl}))
    for warning in config_validate.check_conditional(self.config, **facts):
      if jax.process_index() == 0:
        print(f"warning: {warning}", file=sys.stderr, flush=True)

  def runtime(self) -> dict[str, Any]:
    """What this step runs, for config.json's "runtime" record: the platform, device count, the attention and
    expert kernels (model.*_impl with auto resolved; moe_impl "none" for a dense model) and jax's version."""
    return {"platform": self.mesh.devices.flat[0].platform, "devices": int(self.mesh.devices.size),
            "attention_impl": self.attention_impl, "moe_impl": self.moe_impl, "jax": jax.__version__}

  def _make_objective(self) -> None:
    """The objective and the LoRA settings, checked against config.model (ValueError naming the key)."""
    config, t = self.config, self.config.train
    self.objective = objectives.make(config)
    if self.objective.causal != config.model.causal:
      need = "True (a decoder: the model must not see the tokens it predicts)" if self.objective.causal else \
          "False (a bidirectional encoder)"
      raise ValueError(f"config.train.objective={t.objective!r} needs model.causal={need}; got "
                       f"model.causal={config.model.causal}")
    self.batch_keys = dict(self.objective.batch_keys)
    self.lora_rank = int(t.lora_rank)
    if self.lora_rank < 0:
      raise ValueError(f"config.train.lora_rank={self.lora_rank} must be >= 0 (0 = full fine-tuning)")
    self.lora_targets = lora_lib.check_targets(t.lora_targets) if self.lora_rank else ()
    self.lora_scale = lora_lib.scale(t.lora_alpha, self.lora_rank, t.lora_rslora) if self.lora_rank else 0.0
    self.lora_dropout = float(t.lora_dropout) if self.lora_rank else 0.0
    if not 0.0 <= self.lora_dropout < 1.0:
      raise ValueError(f"config.train.lora_dropout={t.lora_dropout} must be in [0, 1)")
    self.base_quant, self.base_double_quant = str(t.lora_base_quant), bool(t.lora_base_double_quant)
    if self.base_quant not in basequant.KINDS:
      raise ValueError(f"config.train.lora_base_quant={t.lora_base_quant!r} is not one of {', '.join(basequant.KINDS)}")
    if self.base_quant != "none" and self.objective.frozen_models:
      raise ValueError(f"config.train.lora_base_quant={self.base_quant!r} with train.objective={t.objective!r}: its "
                       f"frozen {', '.join(self.objective.frozen_models)} would be a float copy of the weights the "
                       "quantized base only approximates (their log-probabilities would differ at step 0); use "
                       "lora_base_quant='none' for this objective")
    if self.base_double_quant and self.base_quant != "nf4":
      raise ValueError("config.train.lora_base_double_quant=True quantizes NF4's block constants; it needs "
                       f"train.lora_base_quant='nf4' (got {self.base_quant!r})")

  def _abstract_model(self, key) -> tuple[Any, Any]:
    """(partition specs, abstract parameters) of the model's parameter tree, checked against the mesh; sets the
    graphdef and, under muP, the optimizer with its per-parameter learning-rate multipliers."""
    with parallel.activate(self.mesh, self.rules):
      abstract_model = nnx.eval_shape(self._new_model, key)
      self._graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
      param_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    if jax.tree.leaves(rest):
      raise ValueError("train.step keeps only nnx.Param state; the model has other variables: "
                       f"{jax.tree.map(lambda x: x.shape, rest)}")
    model_params = nnx.to_pure_dict(abstract_params)
    rules_lib.check_divisible(param_specs, model_params, self.mesh)
    self.tx = self._optimizer(abstract_params, param_specs)
    if self.lora_rank and not lora_lib.kernels(model_params, self.lora_targets):
      raise ValueError(f"config.train.lora_targets={self.lora_targets!r} matches no parameter of the model")
    # QLoRA: every projection kernel of the frozen base is stored quantized, adapted or not (as the QLoRA paper
    # quantizes all linear layers); embeddings, norms and the output projection stay in param_dtype.
    self._base_kernels = ({path: (lead, n_in) for path, (_, lead, n_in) in
                           lora_lib.kernels(model_params, tuple(lora_lib.TARGETS)).items()}
                          if self.lora_rank and self.base_quant != "none" else {})
    self._base_templates = basequant.templates(model_params, self._base_kernels, self.base_quant,
                                               self.base_double_quant)
    return param_specs, model_params

  def _abstract_frozen_configs(self) -> None:
    """For each of the objective's `frozen_configs` (a model of its own config, e.g. a distillation teacher): its
    graphdef, its parameters' partition specs under this run's rules (checked against the mesh) and their abstract
    values. ValueError naming the key that gave the model where it cannot be sharded like the run's model."""
    self._frozen_graphdefs, self._frozen_config_specs, self._abstract_frozen = {}, {}, {}
    is_spec = lambda x: isinstance(x, PartitionSpec)
    for name, frozen in self.objective.frozen_configs.items():
      where = f"config.{frozen.key}={frozen.path!r} (the {name})"
      if self.pipeline is not None:
        raise ValueError(f"{where} with mesh.stage > 1: a frozen model of its own config runs outside the pipeline "
                         "schedule; use mesh.stage=1")
      try:
        rules = rules_lib.fit_rules(rules_lib.logical_rules(self.config.mesh), frozen.model, self.mesh)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      if rules != self.rules:  # the step runs under one set of rules
        raise ValueError(f"{where}: its num_kv_heads={frozen.model.num_kv_heads} is sharded otherwise than "
                         f"model.num_kv_heads={self.config.model.num_kv_heads} on this mesh (K/V heads replicated "
                         "in one, split in the other); choose mesh.tensor dividing both")
      with parallel.activate(self.mesh, self.rules):
        abstract = nnx.eval_shape(lambda cfg=frozen.model: model_lib.Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
        specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
      params = nnx.to_pure_dict(params)
      try:
        rules_lib.check_divisible(specs, params, self.mesh)
      except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
      self._frozen_graphdefs[name], self._frozen_config_specs[name] = graphdef, specs
      self._abstract_frozen[name] = jax.tree.map(
          lambda p, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, p)), specs, params,
          is_leaf=is_spec)

  def _optimizer(self, abstract_params, param_specs) -> optax.GradientTransformation:
    """train.optimizer over the trainable parameters: under muP with its per-parameter learning-rate multipliers
    (1 for objective heads), for Muon with each model matrix's dimension numbers (objective heads on AdamW)."""
    config, t = self.config, self.config.train
    names = optimizer_lib.logical_names(abstract_params)
    with_extras = lambda tree, extra: ({"model": tree, **{name: extra for name in self.objective.extra_params}}
                                       if self.objective.extra_params else tree)
    multipliers = muon_dims = muon_layouts = None
    if t.optimizer == "muon":
      if self.lora_rank or mup_lib.enabled(config.model):
        raise ValueError("config.train.optimizer=muon orthogonalises the model's own matrices with its own width "
                         "scaling (train.muon_rms); it is not combined with "
                         + ("LoRA adapters (train.lora_rank > 0)" if self.lora_rank else
                            "muP's Adam learning-rate multipliers (model.parametrization='mup')")
                         + "; use adamw there")
      muon_dims = with_extras(optimizer_lib.muon_dims_of(names), None)
      shapes = nnx.to_pure_dict(jax.tree.map(lambda v: v.shape, abstract_params,
                                             is_leaf=lambda x: isinstance(x, nnx.Variable)))
      muon_layouts = with_extras(jax.tree.map(
          lambda n, shape, spec: optimizer_lib.muon_layout(n, shape, NamedSharding(self.mesh, spec)),
          names, shapes, param_specs, is_leaf=optimizer_lib.is_names), None)
    if t.optimizer == "schedule_free_adamw" and t.router_bias_update_rate:
      raise ValueError("config.train.router_bias_update_rate > 0 with train.optimizer=schedule_free_adamw: the "
                       "score biases are updated outside the optimizer, which schedule-free's averaged and "
                       "gradient-point sequences would not see; use router_bias_update_rate=0 or another optimizer")
    if mup_lib.enabled(config.model):
      if self.lora_rank:
        raise ValueError("config.train.lora_rank > 0 with model.parametrization='mup': muP's learning-rate "
                         "multipliers are defined for the model's own weights; fine-tune LoRA under sp")
      multipliers = with_extras(jax.tree.map(lambda n: mup_lib.lr_multiplier(config.model, n), names,
                                             is_leaf=optimizer_lib.is_names), 1.0)
    self._muon_layouts = muon_layouts
    return optimizer_lib.with_frozen(optimizer_lib.make(t, multipliers, muon_dims, muon_layouts), tuple(t.freeze))

  def _place_state(self, key, param_specs, model_params) -> None:
    """The shardings of the model's parameters and of the whole train state, and their abstract values."""
    mesh = self.mesh
    extra_specs = {name: model_lib.axes.spec(names, self.rules)
                   for name, (_, names) in self.objective.extra_params.items()}
    adapter_specs = (lora_lib.specs(param_specs, model_params, self.lora_targets) if self.lora_rank else {})
    is_spec = lambda x: isinstance(x, PartitionSpec)
    to_sharding = lambda tree: jax.tree.map(lambda p: NamedSharding(mesh, p), tree, is_leaf=is_spec)
    self.param_shardings = to_sharding(param_specs)  # the model's parameter tree
    self._abstract_model_params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                               model_params, self.param_shardings)
    base_specs = basequant.spec_tree(param_specs, self._base_kernels, self._base_templates, dict(mesh.shape))
    trainable_specs, frozen_specs = self._compose(param_specs, extra_specs, adapter_specs, base_specs)
    frozen_specs = {**frozen_specs, **self._frozen_config_specs}
    trainable_shardings, frozen_shardings = to_sharding(trainable_specs), to_sharding(frozen_specs)
    abstract = jax.eval_shape(self._init_state, key)
    opt_shardings = _follow_params(abstract["opt_state"], trainable_shardings, self._replicated, abstract["params"])
    if self._muon_layouts is not None:
      opt_shardings = optimizer_lib.place_muon_state(abstract["opt_state"], opt_shardings, self._muon_layouts)
    self.state_shardings = {"params": trainable_shardings, "opt_state": opt_shardings,
                            "step": self._replicated, "rng": self._replicated}
    if frozen_specs:
      self.state_shardings["frozen"] = frozen_shardings
    if self.loss_scaling:
      self.state_shardings["loss_scale"] = {"scale": self._replicated, "good_steps": self._replicated}
    self._abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, self.state_shardings)

  def _jit(self, compiler_options: dict[str, Any] | None) -> None:
    """The jitted init, step and eval functions with their shardings, and the step's metric keys."""
    config = self.config
    self.batch_sharding = parallel.sharding.logical_sharding(self.mesh, self.rules, ("batch", "length"))
    batch_shardings = {k: self.batch_sharding for k in self.batch_keys}
    self.metric_keys = tuple(self.objective.metric_keys) + STEP_METRICS
    if self.loss_scaling:
      self.metric_keys += LOSS_SCALE_METRICS
    if config.model.num_experts:
      self.metric_keys += tuple(k for k in MOE_METRICS if k != EXPERT_LOAD)
      self.metric_keys += tuple(f"moe_load/{e}" for e in range(config.model.num_experts))
    metric_shardings = {k: self._replicated for k in self.metric_keys}
    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    self._init_fn = jit(self._init_state, out_shardings=self.state_shardings)
    self.step_fn = jit(self._step, in_shardings=(self.state_shardings, batch_shardings),
                       out_shardings=(self.state_shardings, metric_shardings), donate_argnums=0)
    self.eval_fn = jit(self._eval, in_shardings=(self.state_shardings, batch_shardings),
                       out_shardings={k: self._replicated for k in self.objective.eval_keys})

  # ---- checks -------------------------------------------------------------------------------------------
  def _check_batch(self):
    t, shape = self.config.train, self.mesh.shape
    rows = rules_lib.axis_size(self.mesh, dict(self.rules)["batch"])
    if t.grad_accum < 1 or t.batch_size % t.grad_accum:
      raise ValueError(f"config.train.grad_accum={t.grad_accum} must be >= 1 and divide "
                       f"config.train.batch_size={t.batch_size}")
    micro = t.batch_size // t.grad_accum
    if micro % rows:
      raise ValueError(f"microbatch of {micro} rows (config.train.batch_size={t.batch_size} / grad_accum="
                       f"{t.grad_accum}) is not divisible by the {rows} batch shards (mesh axes "
                       f"{dict(self.rules)['batch']}, data x fsdp x expert = {shape['data']} x {shape['fsdp']} x "
                       f"{shape['expert']} by default); change the batch size, grad_accum or config.mesh")
    row_axes = model_lib.axes.spec(("batch",), self.rules)[0] or ()
    parallel.sharding.check_rows_per_process(self.mesh, (row_axes,) if isinstance(row_axes, str) else row_axes)
    if t.seq_len % shape["sequence"]:
      raise ValueError(f"config.train.seq_len={t.seq_len} is not divisible by mesh axis sequence="
                       f"{shape['sequence']}; change config.mesh.sequence or the sequence length")
    m = self.config.model
    if (shape["sequence"] > 1 and m.context_parallel == "ring" and m.context_layout == "zigzag"
        and t.seq_len % (2 * shape["sequence"])):
      raise ValueError(f"config.train.seq_len={t.seq_len}: the ring's zigzag layout cuts it into 2 x mesh.sequence="
                       f"{2 * shape['sequence']} equal chunks; choose a multiple of {2 * shape['sequence']} or "
                       "model.context_layout='contiguous'")

  def _pipeline_schedule(self) -> pipeline_lib.Schedule | None:
    """The pipeline schedule for mesh.stage > 1 (None without stages); ValueError naming the key when it cannot
    work. The pipeline's microbatches split each grad_accum microbatch further (the two compose)."""
    t, m, S = self.config.train, self.config.model, self.mesh.shape["stage"]
    if S == 1:  # pipeline keys set without stages were refused with the conditional keys (__init__)
      return None
    if not m.scan_layers:
      raise ValueError("config.mesh.stage > 1 needs config.model.scan_layers=True: stages split the scanned stack")
    if model_lib.config.dense_prefix(m):
      raise ValueError(f"config.model.first_dense_layers={m.first_dense_layers} with config.mesh.stage={S}: the "
                       "pipeline splits one stack of identical layers; use first_dense_layers=0 or mesh.stage=1")
    if dict(self.rules)["layers"] != pipeline_lib.AXIS:
      raise ValueError(f"config.mesh.stage={S} but config.mesh.rules maps 'layers' to {dict(self.rules)['layers']!r};"
                       " pipeline stages need the default ('layers', 'stage')")
    schedule = pipeline_lib.Schedule(S, int(t.pipeline_microbatches) or S, int(t.pipeline_repeats),
                                     bool(t.pipeline_remat))
    unit = model_lib.config.layers_per_unit(m)
    pipeline_lib.check(schedule, m.num_layers // unit, t.batch_size // t.grad_accum,
                       rules_lib.axis_size(self.mesh, dict(self.rules)["batch"]),
                       what_units=f"config.model.num_layers={m.num_layers}" + (
                           f" / moe_every={unit}" if unit > 1 else ""),
                       what_rows=f"config.train.batch_size / grad_accum = {t.batch_size} / {t.grad_accum}")
    return schedule

  # ---- state --------------------------------------------------------------------------------------------
  def _new_model(self, key) -> model_lib.Transformer:
    return model_lib.Transformer(self.config.model, rngs=nnx.Rngs(params=key), remat=self.config.train.remat,
                                 pipeline=self.pipeline)

  @staticmethod
  def init_keys(key) -> tuple[jax.Array, jax.Array]:
    """(parameter-init key, training-stream key) from the seed's key: two independent halves of one split."""
    params_key, train_key = jax.random.split(key)
    return params_key, train_key

  def _compose(self, model_params, extras, adapters, base=None) -> tuple[Any, dict[str, Any]]:
    """(trainable, frozen) trees from the model's parameters, the objective's extras and the LoRA adapters;
    `base`: the frozen base LoRA trains on (QLoRA: its kernels quantized; default model_params)."""
    frozen = {name: model_params for name in self.objective.frozen_models}
    if adapters:
      return {"lora": adapters, **extras}, dict(frozen, model=model_params if base is None else base)
    if extras:
      return {"model": model_params, **extras}, frozen
    return model_params, frozen

  def _decompose(self, params, frozen, key=None, merged=False) -> tuple[Any, dict[str, Any]]:
    """(model parameters for the forward pass, the objective's extras): inverse of `_compose`. LoRA: the adapted
    kernels as side paths (lora_lib.SideKernel; `key` draws lora_dropout's masks, None = none), or with `merged`
    W + scale A B as plain arrays (generation, export)."""
    if self.lora_rank:
      extras = {k: v for k, v in params.items() if k != "lora"}
      if merged:
        return lora_lib.merge(self.base_params(frozen["model"]), params["lora"], self.lora_scale), extras
      base = basequant.attach(frozen["model"], self._base_templates)
      return lora_lib.side(base, params["lora"], self.lora_scale, self.lora_dropout, key), extras
    if self.objective.extra_params:
      return params["model"], {k: v for k, v in params.items() if k != "model"}
    return params, {}

  def _init_state(self, key) -> dict[str, Any]:
    params_key, train_key = self.init_keys(key)
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      model_params = nnx.to_pure_dict(nnx.state(self._new_model(params_key), nnx.Param))
      std = self.config.model.init_std
      extras = {name: std * jax.random.normal(jax.random.fold_in(params_key, 2 + i), shape, jnp.float32)
                for i, (name, (shape, _)) in enumerate(sorted(self.objective.extra_params.items()))}
      adapters = (lora_lib.init(jax.random.fold_in(params_key, 3), model_params, self.lora_targets,
                                self.lora_rank) if self.lora_rank else {})
    base = basequant.quantize_params(model_params, self._base_kernels, self.base_quant, self.base_double_quant)
    params, frozen = self._compose(model_params, extras, adapters, base)
    frozen = {**frozen, **self._init_frozen_configs(params_key)}
    state = {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": train_key}
    if frozen:
      state["frozen"] = frozen
    if self.loss_scaling:
      state["loss_scale"] = optimizer_lib.loss_scale_init(self.config.train)
    return state

  def init(self, seed: int | None = None) -> dict[str, Any]:
    """A fresh state from `seed` (default config.train.seed), created directly sharded on the mesh."""
    seed = self.config.train.seed if seed is None else seed
    return self._init_fn(jax.random.PRNGKey(seed))

  def with_model_params(self, state: dict[str, Any], model_params: Any) -> dict[str, Any]:
    """`state` with the model's weights replaced by `model_params` (sharded like `param_shardings`) wherever the
    layout keeps them: trained, frozen under LoRA, and as every frozen copy (init_from)."""
    state = dict(state)
    frozen = dict(state.get("frozen", {}))
    for name in self.objective.frozen_models:  # own buffers: the step donates the state, each buffer once
      frozen[name] = self._copy_params(model_params)
    if self.lora_rank:
      frozen["model"] = self._quantize_base(model_params)
    elif self.objective.extra_params:
      state["params"] = dict(state["params"], model=model_params)
    else:
      state["params"] = model_params
    if frozen:
      state["frozen"] = frozen
    return state

  def _quantize_base(self, model_params: Any) -> Any:
    """The frozen base of a LoRA run from the model's weights: as they are, or (QLoRA) with the projection
    kernels quantized on the devices, each to its shards (state_shardings["frozen"]["model"])."""
    if not self._base_templates:
      return model_params
    quantize = lambda tree: basequant.quantize_params(tree, self._base_kernels, self.base_quant,
                                                      self.base_double_quant)
    return jax.jit(quantize, out_shardings=self.state_shardings["frozen"]["model"])(model_params)

  def base_params(self, base: Any) -> Any:
    """A LoRA run's frozen base (state["frozen"]["model"]) as the model's parameter tree: QLoRA's quantized
    kernels dequantized to model.param_dtype (what the adapters were trained against)."""
    return basequant.dequantize_params(base, self._base_templates)

  def _copy_params(self, model_params: Any) -> Any:
    """A copy of the model's parameter tree in new device buffers, sharded like `param_shardings`."""
    return jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), out_shardings=self.param_shardings)(model_params)

  def abstract_state(self) -> dict[str, Any]:
    """The state as ShapeDtypeStructs carrying their shardings (orbax restore targets, AOT compilation)."""
    return self._abstract_state

  def abstract_model_params(self) -> Any:
    """The model's parameter tree as ShapeDtypeStructs with their shardings (whatever the state layout)."""
    return self._abstract_model_params

  def abstract_frozen_params(self, name: str) -> Any:
    """The parameter tree of the objective's frozen model `name` of its own config (`frozen_configs`) as
    ShapeDtypeStructs with their shardings: what its weights are loaded onto."""
    return self._abstract_frozen[name]

  def with_frozen_params(self, state: dict[str, Any], name: str, params: Any) -> dict[str, Any]:
    """`state` with the `frozen_configs` model `name`'s parameters replaced by `params` (sharded like
    `abstract_frozen_params(name)`)."""
    return dict(state, frozen={**state["frozen"], name: params})

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch as ShapeDtypeStructs: [batch_size, seq_len] each, rows over data+fsdp."""
    t = self.config.train
    return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dt, sharding=self.batch_sharding)
            for k, dt in self.batch_keys.items()}

  def model(self, state: dict[str, Any]) -> model_lib.Transformer:
    """An nnx Transformer holding `state`'s model parameters (LoRA adapters merged into the weights)."""
    model_params, _ = self._decompose(state["params"], state.get("frozen", {}), merged=True)
    return self._merge(model_params)

  def _merge(self, params) -> model_lib.Transformer:
    return nnx.merge(self._graphdef, params)

  def _frozen_models(self, frozen) -> dict[str, model_lib.Transformer]:
    """The objective's frozen models from the state's `frozen` trees: the copies of the starting model
    (`frozen_models`) and the models of their own config (`frozen_configs`)."""
    models = {name: self._merge(frozen[name]) for name in self.objective.frozen_models}
    models.update({name: nnx.merge(graphdef, frozen[name]) for name, graphdef in self._frozen_graphdefs.items()})
    return models

  def _init_frozen_configs(self, params_key) -> dict[str, Any]:
    """Random parameters of each `frozen_configs` model, from its own initializer: placeholders of the right shapes
    and shardings until a fresh run loads its weights (train/core/setup.py)."""
    out = {}
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      for i, name in enumerate(sorted(self.objective.frozen_configs)):
        key = jax.random.fold_in(params_key, 100 + i)  # apart from the extras' (2 + i) and the adapters' (3) keys
        model = model_lib.Transformer(self.objective.frozen_configs[name].model, rngs=nnx.Rngs(params=key))
        out[name] = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return out

  # ---- step ---------------------------------------------------------------------------------------------
  def _sums(self, params, frozen, batch, normalizer=1.0, scale=1.0, key=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(scale * (objective loss / normalizer + MoE losses), the objective's sums) for one (micro)batch;
    `normalizer` = the global batch's, `scale` the loss scale (1 without loss scaling), `key` lora_dropout's.

    MoE: + moe_aux_loss * balance + router_z_loss * z_router, each a mean over MoE layers of this microbatch
    (model.moe.router_stats, returned by `Objective.forward` divided by grad_accum so the accumulated objective
    averages the microbatches).
    """
    model_params, extras = self._decompose(params, frozen, key)
    frozen_models = self._frozen_models(frozen)
    sums = self.objective.sums(self._merge(model_params), batch, extras, frozen_models)
    loss = self.objective.loss(sums) / normalizer
    if self.config.model.num_experts:
      t = self.config.train
      loss += t.moe_aux_loss * sums["moe_aux_loss"] + t.router_z_loss * sums["router_z_loss"]
    # Scaling the loss scales every cotangent of the backward pass, lifting small float16 gradients above
    # float16's underflow; the step divides the (float32) parameter gradients by the same scale.
    return loss * scale, sums

  def _microbatches(self, batch):
    """[B, L] -> [A, B/A, L] with microbatch a = rows a, a+A, ...: each device keeps its own rows (no
    communication) and the sum over microbatches equals the full-batch sum."""
    A = self.config.train.grad_accum
    spec = model_lib.axes.spec((None, "batch", "length"), self.rules)
    def split(x_BL):
      x_ABL = jnp.swapaxes(x_BL.reshape(x_BL.shape[0] // A, A, *x_BL.shape[1:]), 0, 1)
      return jax.lax.with_sharding_constraint(x_ABL, NamedSharding(self.mesh, spec))
    return jax.tree.map(split, batch)

  def _grads(self, params, frozen, batch, normalizer, scale=1.0, key=None):
    """Gradient of `scale` x the objective over the whole batch (w.r.t. the trainable parameters), summed over
    microbatches, and the objective's sums; microbatch a draws lora_dropout from fold_in(key, a)."""
    grad_fn = jax.grad(self._sums, has_aux=True)
    trainable_shardings = self.state_shardings["params"]
    if self.config.train.grad_accum == 1:
      return grad_fn(params, frozen, batch, normalizer, scale, key)
    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), trainable_shardings)
    m = self.config.model
    zero_sums = {k: jnp.zeros((m.num_experts,) if k == EXPERT_LOAD else (), jnp.float32)
                 for k in tuple(self.objective.sum_keys) + (MOE_METRICS if m.num_experts else ())}
    if self._layer_loads():
      moe_layers = sum(model_lib.config.is_moe_layer(m, i) for i in range(m.num_layers)) + m.mtp_depth
      zero_sums[LAYER_LOAD] = jnp.zeros((moe_layers, m.num_experts), jnp.float32)
    def body(carry, xs):
      microbatch, a = xs
      grads, sums = grad_fn(params, frozen, microbatch, normalizer, scale,
                            None if key is None else jax.random.fold_in(key, a))
      grads = jax.lax.with_sharding_constraint(grads, trainable_shardings)
      return (_tree_add(carry[0], grads), _tree_add(carry[1], sums)), None
    xs = (self._microbatches(batch), jnp.arange(self.config.train.grad_accum))
    (grads, sums), _ = jax.lax.scan(body, (zeros, zero_sums), xs)
    return grads, sums

  def _layer_loads(self) -> bool:
    """Whether the model hands out per-layer expert loads (model.moe.LAYER_LOAD): the sigmoid router outside a
    pipeline (whose stages average their layers' statistics)."""
    m = self.config.model
    return bool(m.num_experts) and m.router == "sigmoid" and self.mesh.shape["stage"] == 1

  def _step(self, state, batch):
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      params, step, frozen = state["params"], state["step"], state.get("frozen", {})
      batch = self.objective.prepare(batch, jax.random.fold_in(state["rng"], step))
      # Dividing by the whole batch's normalizer (e.g. loss tokens) inside every microbatch's loss makes the
      # accumulated gradient exactly that of the large batch's mean loss.
      normalizer = self.objective.normalizer(batch)
      scale = state["loss_scale"]["scale"] if self.loss_scaling else 1.0
      # lora_dropout's masks: a function of (seed, step) like the objective's, apart from its stream.
      key = jax.random.fold_in(jax.random.fold_in(state["rng"], step), LORA_DROPOUT_KEY) if self.lora_dropout else None
      # Schedule-free keeps the averaged parameters x in the state and takes the gradient at y (otherwise y = x).
      point = optimizer_lib.gradient_point(params, state["opt_state"])
      grads, sums = self._grads(point, frozen, batch, normalizer, scale, key)
      if self.loss_scaling:
        grads = jax.tree.map(lambda g: g / scale, grads)
      grads = jax.lax.with_sharding_constraint(grads, self.state_shardings["params"])
      reported = self.objective.metrics(sums, normalizer)
      grad_norm = optax.tree.norm(grads)
      lr = self.lr_fn(step)
      finite_metrics = jnp.bool_(True)
      for value in reported.values():
        finite_metrics &= jnp.isfinite(value)
      finite = finite_metrics & jnp.isfinite(grad_norm)

      def update(operands):
        params, opt_state, grads = operands
        updates, opt_state = self.tx.update(grads, opt_state, point)
        params = optimizer_lib.averaged(
            optimizer_lib.apply_lr(point, updates, lr, optimizer_lib.brings_lr(self.config.train)), opt_state)
        if self.config.train.router_bias_update_rate:  # the biases have no gradient: their own rule, after the update
          params = model_lib.moe.update_score_bias(params, sums[LAYER_LOAD], self.config.train.router_bias_update_rate)
        return params, opt_state

      # A conditional, not a select: no second copy of parameters and moments is kept for the skip case.
      new_params, opt_state = jax.lax.cond(finite, update, lambda operands: operands[:2],
                                           (params, state["opt_state"], grads))
      nonfinite = ~finite
      new_state = dict(state, params=new_params, opt_state=opt_state, step=step + 1)
      if self.loss_scaling:
        # A gradient overflow with a finite loss is the loss scale's business (halve it, skip the step), not a
        # diverging run; it counts as non-finite (the halt rule) only once the scale cannot fall any further.
        overflow = finite_metrics & ~finite
        nonfinite = ~finite_metrics | (overflow & (scale <= optimizer_lib.MIN_LOSS_SCALE))
        new_state["loss_scale"] = optimizer_lib.loss_scale_update(state["loss_scale"], finite, self.config.train)
      metrics = {**reported, "grad_norm": grad_norm, "param_norm": optax.tree.norm(new_params), "lr": lr,
                 "nonfinite": nonfinite.astype(jnp.float32)}
      if self.loss_scaling:
        metrics.update(loss_scale=scale, overflow=overflow.astype(jnp.float32))
      if self.config.model.num_experts:
        metrics.update({k: sums[k] for k in MOE_METRICS if k != EXPERT_LOAD})
        metrics.update({f"moe_load/{e}": load for e, load in enumerate(sums[EXPERT_LOAD])})
        t = self.config.train
        if "total_loss" in metrics:
          metrics["total_loss"] += t.moe_aux_loss * sums["moe_aux_loss"] + t.router_z_loss * sums["router_z_loss"]
      return new_state, {k: v.astype(jnp.float32) for k, v in metrics.items()}

  def _eval(self, state, batch):
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      frozen = state.get("frozen", {})
      # A fixed key: every evaluation corrupts a given held-out batch the same way.
      batch = self.objective.prepare(batch, jax.random.fold_in(state["rng"], EVAL_KEY))
      model_params, extras = self._decompose(state["params"], frozen)
      frozen_models = self._frozen_models(frozen)
      return self.objective.eval_sums(self._merge(model_params), batch, extras, frozen_models)

  # ---- compiled facts -----------------------------------------------------------------------------------
  def compiled(self):
    """The step compiled for the abstract state and batch (cached)."""
    if self._compiled is None:
      self._compiled = self.step_fn.lower(self.abstract_state(), self.abstract_batch()).compile()
    return self._compiled

  def memory_analysis(self) -> dict[str, int]:
    """Per-device bytes of the compiled step: arguments, outputs, temporaries, aliased, and total.

    total = arguments + outputs + temporaries - aliased (donated state buffers are reused for the outputs).
    """
    ma = self.compiled().memory_analysis()
    out = {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
           "temp_bytes": int(ma.temp_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes)}
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out

  def batch_to_device(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows of a batch -> the global sharded batch (`parallel.sharding.global_batch`).

    Global rows = local rows x process count (train batches: config.train.batch_size; eval batches may differ).
    """
    local = {k: np.asarray(local_batch[k], dtype=dt) for k, dt in self.batch_keys.items()}
    return parallel.sharding.global_batch(local, self.batch_sharding)


def synthetic_batch(config, seed: int, rows: int | None = None, packed: bool = True) -> dict[str, np.ndarray]:
  """A deterministic batch of random tokens [rows, seq_len] (default config.train.batch_size rows).

  With `packed`, each row holds 2-3 documents (segment ids 1, 2, 3; positions restart per document; targets
  are the next token inside a document) followed by a little padding (segment 0, loss mask 0).
  """
  t, V = config.train, config.model.vocab_size
  rows = t.batch_size if rows is None else rows
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, size=(rows, t.seq_len + 1), dtype=np.int32)
  segment_ids = np.ones((rows, t.seq_len), np.int32)
  if packed:
    L = t.seq_len
    for r in range(rows):
      cuts = np.sort(rng.choice(np.arange(2, L - 2), size=2, replace=False))
      end = L - int(rng.integers(0, max(L // 8, 1)))
      segment_ids[r, cuts[0]:cuts[1]] = 2
      segment_ids[r, cuts[1]:] = 3
      segment_ids[r, end:] = 0
  positions = positions_from_segments(segment_ids)
  same_doc_next = np.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1], np.zeros((rows, 1), bool)], axis=1)
  loss_mask = ((segment_ids > 0) & same_doc_next).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids,
          "positions": positions.astype(np.int32), "loss_mask": loss_mask}


def run_synthetic(trainer: Trainer, steps: int, seed: int = 0) -> list[dict[str, float]]:
  """Runs `steps` steps from a fresh state on `synthetic_batch(config, seed + i)`; returns metrics per step.

  Every process builds the same global batch and feeds its own consecutive block of rows, so any process
  count gives the same numbers. Adds step_time_s, tokens_per_sec and (where the peak is known) mfu and
  mfu_full_attention (`train.planning.mfu.utilisation`).
  """
  config = trainer.config
  t = config.train
  peak = mfu_lib.peak_flops_per_device(jax.devices(), t.peak_tflops)
  rows = t.batch_size // jax.process_count()
  mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
  state = trainer.init()
  lines = []
  for i in range(steps):
    batch = trainer.batch_to_device({k: v[mine] for k, v in synthetic_batch(config, seed + i).items()})
    start = time.perf_counter()
    state, metrics = trainer.step_fn(state, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    seconds = time.perf_counter() - start
    line = {"step": i + 1, **metrics, "step_time_s": seconds,
            "tokens_per_sec": t.batch_size * t.seq_len / seconds}
    line.update(mfu_lib.utilisation(line["tokens_per_sec"], config.model, t.seq_len, jax.device_count(), peak))
    lines.append(line)
  return lines


def main(argv=None) -> int:
  """`python -m train.step`: prints the mesh, parameter counts and compiled memory, then one line per step."""
  from parallel import mesh as mesh_lib
  import configs
  parser = argparse.ArgumentParser(prog="python -m train.step", description=__doc__.split("\n")[0])
  parser.add_argument("--fast_compile", action="store_true", help="XLA options that compile faster, run slower")
  try:
    config, args = configs.parse(sys.argv[1:] if argv is None else argv, parser)
  except configs.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  parallel.distributed.initialize(config.distributed)
  mesh = mesh_lib.make_mesh(config.mesh)
  trainer = Trainer(config, mesh, FAST_COMPILE if args.fast_compile else None)
  leader = jax.process_index() == 0
  if leader:
    print(json.dumps({"mesh": mesh_lib.describe(mesh), "processes": jax.process_count(),
                      "params": model_lib.count_params(config.model),
                      "memory_per_device": trainer.memory_analysis()}), flush=True)
  for line in run_synthetic(trainer, config.train.steps):
    if leader:
      print(json.dumps(line), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
