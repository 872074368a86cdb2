"""The training step: sharded state, one jitted `(state, batch) -> (state, metrics)`, and a minimal driver.

State (a pytree of jax.Arrays, sharded by the logical-axis rules):
  params     nested dict of float32 master weights (the model's nnx.Param tree as a pure dict)
  opt_state  optax state of `train.optimizer.make` (Adam moments follow the parameters' sharding)
  step       int32 scalar, advances every call (also over skipped non-finite steps)
  rng        uint32[2] base key of the training stream (per-step randomness is fold_in(rng, step)); split from
             the seed apart from the parameter-init key, so it equals none of the keys init draws

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
import model as model_lib
import parallel
from parallel import rules as rules_lib
from train import loss as loss_lib
from train import mfu as mfu_lib
from train import optimizer as optimizer_lib

BATCH_KEYS = {"inputs": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32,
              "loss_mask": jnp.float32}
# XLA options trading run time for compile time (tiny test models compile ~2x faster on CPU).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
METRICS = ("loss", "z_loss", "total_loss", "grad_norm", "param_norm", "lr", "tokens", "nonfinite")
MOE_METRICS = model_lib.moe.STATS  # MoE models add these (means over MoE layers and microbatches)
EXPERT_LOAD = "moe_expert_load"  # the [E] vector among them, logged as moe_load/<expert> (share of assignments)


def _tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


class Trainer:
  """Builds the sharded train state and the jitted step for `config` on `mesh` (see module docstring).

  Checks before anything compiles (ValueError naming the key / axis): heads vs the tensor axis, parameter
  dimensions vs their mesh axes, batch_size vs grad_accum and data x fsdp, rows per process (only the batch's
  axes may span processes), seq_len vs the sequence axis.
  """

  def __init__(self, config, mesh: jax.sharding.Mesh, compiler_options: dict[str, Any] | None = None):
    """`compiler_options`: XLA options for every compile of this trainer (e.g. FAST_COMPILE in tests)."""
    self.config, self.mesh = config, mesh
    t = config.train
    self.rules = rules_lib.fit_rules(rules_lib.logical_rules(config.mesh), config.model, mesh)
    self._check_batch()
    self.tx = optimizer_lib.make(t)
    self.lr_fn = optimizer_lib.schedule(t)
    self._replicated = parallel.sharding.replicated(mesh)

    with parallel.activate(mesh, self.rules):
      key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # abstract: no eager op, so AOT on any backend works
      abstract_model = nnx.eval_shape(self._new_model, key)
      self._graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
      param_specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    if jax.tree.leaves(rest):
      raise ValueError("train.step keeps only nnx.Param state; the model has other variables: "
                       f"{jax.tree.map(lambda x: x.shape, rest)}")
    rules_lib.check_divisible(param_specs, nnx.to_pure_dict(abstract_params), mesh)
    self.param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), param_specs,
                                        is_leaf=lambda x: isinstance(x, PartitionSpec))
    abstract = jax.eval_shape(self._init_state, key)
    opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract["opt_state"], self.param_shardings,
        transform_non_params=lambda _: self._replicated)
    self.state_shardings = {"params": self.param_shardings, "opt_state": opt_shardings,
                            "step": self._replicated, "rng": self._replicated}
    self._abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, self.state_shardings)
    self.batch_sharding = parallel.sharding.logical_sharding(mesh, self.rules, ("batch", "length"))
    batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
    self.metric_names = METRICS
    if config.model.num_experts:
      self.metric_names += tuple(k for k in MOE_METRICS if k != EXPERT_LOAD)
      self.metric_names += tuple(f"moe_load/{e}" for e in range(config.model.num_experts))
    metric_shardings = {k: self._replicated for k in self.metric_names}
    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    self._init_fn = jit(self._init_state, out_shardings=self.state_shardings)
    self.step_fn = jit(self._step, in_shardings=(self.state_shardings, batch_shardings),
                       out_shardings=(self.state_shardings, metric_shardings), donate_argnums=0)
    self.eval_fn = jit(self._eval, in_shardings=(self.state_shardings, batch_shardings),
                       out_shardings={"loss_sum": self._replicated, "tokens": self._replicated})
    self._compiled = None

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

  # ---- state --------------------------------------------------------------------------------------------
  def _new_model(self, key) -> model_lib.Transformer:
    return model_lib.Transformer(self.config.model, rngs=nnx.Rngs(params=key), remat=self.config.train.remat)

  @staticmethod
  def init_keys(key) -> tuple[jax.Array, jax.Array]:
    """(parameter-init key, training-stream key) from the seed's key: two independent halves of one split."""
    params_key, train_key = jax.random.split(key)
    return params_key, train_key

  def _init_state(self, key) -> dict[str, Any]:
    params_key, train_key = self.init_keys(key)
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      params = nnx.to_pure_dict(nnx.state(self._new_model(params_key), nnx.Param))
    return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": train_key}

  def init(self, seed: int | None = None) -> dict[str, Any]:
    """A fresh state from `seed` (default config.train.seed), created directly sharded on the mesh."""
    seed = self.config.train.seed if seed is None else seed
    return self._init_fn(jax.random.PRNGKey(seed))

  def abstract_state(self) -> dict[str, Any]:
    """The state as ShapeDtypeStructs carrying their shardings (orbax restore targets, AOT compilation)."""
    return self._abstract_state

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """One global batch as ShapeDtypeStructs: [batch_size, seq_len] each, rows over data+fsdp."""
    t = self.config.train
    return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dt, sharding=self.batch_sharding)
            for k, dt in BATCH_KEYS.items()}

  def model(self, state: dict[str, Any]) -> model_lib.Transformer:
    """An nnx Transformer holding `state`'s parameters (shared buffers, not copies)."""
    return self._merge(state["params"])

  def _merge(self, params) -> model_lib.Transformer:
    return nnx.merge(self._graphdef, params)

  # ---- step ---------------------------------------------------------------------------------------------
  def _sums(self, params, batch, tokens=1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """((ce + z) sums / tokens + MoE losses, {ce, z, tokens, MoE statistics} sums) for one (micro)batch;
    `tokens` = the global batch's.

    MoE: + moe_aux_loss * balance + router_z_loss * z_router, each a mean over MoE layers of this microbatch
    (model.moe.router_stats), divided by grad_accum so the accumulated objective averages the microbatches.
    """
    model = self._merge(params)
    t = self.config.train
    logits_BLV, aux = model(batch["inputs"], batch["segment_ids"], batch["positions"], return_aux=True)
    sums = loss_lib.loss_sums(logits_BLV, batch["targets"], batch["loss_mask"], t.z_loss)
    objective = (sums["ce"] + sums["z"]) / tokens
    if aux:
      sums.update({k: aux[k] / t.grad_accum for k in MOE_METRICS})
      objective += t.moe_aux_loss * sums["moe_aux_loss"] + t.router_z_loss * sums["router_z_loss"]
    return objective, sums

  def _microbatches(self, batch):
    """[B, L] -> [A, B/A, L] with microbatch a = rows a, a+A, ...: each device keeps its own rows (no
    communication) and the sum over microbatches equals the full-batch sum."""
    A = self.config.train.grad_accum
    spec = model_lib.axes.spec((None, "batch", "length"), self.rules)
    def split(x_BL):
      x_ABL = jnp.swapaxes(x_BL.reshape(x_BL.shape[0] // A, A, *x_BL.shape[1:]), 0, 1)
      return jax.lax.with_sharding_constraint(x_ABL, NamedSharding(self.mesh, spec))
    return jax.tree.map(split, batch)

  def _grads(self, params, batch, tokens):
    """Gradient of the mean loss over the whole batch's tokens, summed over microbatches, and the loss sums."""
    grad_fn = jax.grad(self._sums, has_aux=True)
    if self.config.train.grad_accum == 1:
      return grad_fn(params, batch, tokens)
    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), self.param_shardings)
    m = self.config.model
    zero_sums = {k: jnp.zeros((m.num_experts,) if k == EXPERT_LOAD else (), jnp.float32)
                 for k in ("ce", "z", "tokens") + (MOE_METRICS if m.num_experts else ())}
    def body(carry, microbatch):
      grads, sums = grad_fn(params, microbatch, tokens)
      grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
      return (_tree_add(carry[0], grads), _tree_add(carry[1], sums)), None
    (grads, sums), _ = jax.lax.scan(body, (zeros, zero_sums), self._microbatches(batch))
    return grads, sums

  def _step(self, state, batch):
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      params, step = state["params"], state["step"]
      # Dividing by the whole batch's token count inside every microbatch's loss makes the accumulated
      # gradient exactly that of the large batch's mean loss.
      tokens = jnp.maximum(jnp.sum(batch["loss_mask"].astype(jnp.float32)), 1.0)
      grads, sums = self._grads(params, batch, tokens)
      grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
      loss, z_loss = sums["ce"] / tokens, sums["z"] / tokens
      grad_norm = optax.tree.norm(grads)
      lr = self.lr_fn(step)
      finite = jnp.isfinite(loss) & jnp.isfinite(z_loss) & jnp.isfinite(grad_norm)

      def update(operands):
        params, opt_state, grads = operands
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optimizer_lib.apply_lr(params, updates, lr), opt_state

      # A conditional, not a select: no second copy of parameters and moments is kept for the skip case.
      new_params, opt_state = jax.lax.cond(finite, update, lambda operands: operands[:2],
                                           (params, state["opt_state"], grads))
      metrics = {"loss": loss, "z_loss": z_loss, "total_loss": loss + z_loss, "grad_norm": grad_norm,
                 "param_norm": optax.tree.norm(new_params), "lr": lr, "tokens": sums["tokens"],
                 "nonfinite": 1.0 - finite.astype(jnp.float32)}
      if self.config.model.num_experts:
        metrics.update({k: sums[k] for k in MOE_METRICS if k != EXPERT_LOAD})
        metrics.update({f"moe_load/{e}": load for e, load in enumerate(sums[EXPERT_LOAD])})
        t = self.config.train
        metrics["total_loss"] += t.moe_aux_loss * sums["moe_aux_loss"] + t.router_z_loss * sums["router_z_loss"]
      new_state = {"params": new_params, "opt_state": opt_state, "step": step + 1, "rng": state["rng"]}
      return new_state, {k: v.astype(jnp.float32) for k, v in metrics.items()}

  def _eval(self, state, batch):
    with parallel.activate(self.mesh, self.rules, inside_jit=True):
      _, sums = self._sums(state["params"], batch)
    return {"loss_sum": sums["ce"], "tokens": sums["tokens"]}

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
    local = {k: np.asarray(local_batch[k], dtype=dt) for k, dt in BATCH_KEYS.items()}
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
  count gives the same numbers. Adds step_time_s, tokens_per_sec and (where the peak is known) mfu.
  """
  config = trainer.config
  t = config.train
  flops_per_token = mfu_lib.flops_per_token(config.model, t.seq_len)
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
    util = mfu_lib.mfu(line["tokens_per_sec"], flops_per_token, jax.device_count(), peak)
    if util is not None:
      line["mfu"] = util
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
