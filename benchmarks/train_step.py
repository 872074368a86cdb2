"""Training-step throughput, MFU and compiled memory of meshlm vs a minimal hand-written JAX step, on 1 CPU device.

  JAX_PLATFORMS=cpu python benchmarks/train_step.py [--configs tiny,50m] [--steps 3]

Prints one JSON object. For each config: tokens/s and MFU (against a float32 matmul peak measured in the same
run) of `train.step.Trainer.step_fn` and of a hand-written step of the same model (same parameters, same AdamW,
no framework); their ratio; per-device compiled memory with remat none vs full for both; and the first-step
losses of both (they compute the same function, so these agree). Steps of the two are interleaved so machine
load affects both alike; tokens/s use the fastest step (on a shared machine load only adds time).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import rope  # noqa: E402
from parallel import mesh as mesh_lib  # noqa: E402
import configs  # noqa: E402
from train import mfu as mfu_lib  # noqa: E402
from train import step as step_lib  # noqa: E402

CONFIGS = {
    "tiny": {},  # configs/tiny.py as it is: d 128, 4 layers, seq 128, batch 16 (1.3M parameters)
    "50m": {"model.vocab_size": 16000, "model.d_model": 512, "model.num_layers": 10, "model.num_heads": 8,
            "model.num_kv_heads": 8, "model.head_dim": 64, "model.mlp_dim": 1536, "model.max_seq_len": 256,
            "train.batch_size": 4, "train.seq_len": 256},
}


def matmul_peak_flops(n: int = 1024, reps: int = 10) -> float:
  """Measured float32 matmul FLOP/s of one device (best of 3 runs of `reps` chained n x n products)."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32) / math.sqrt(n)

  @jax.jit
  def chain(x):
    for _ in range(reps):
      x = x @ a
    return x

  chain(a).block_until_ready()
  best = math.inf
  for _ in range(3):
    start = time.perf_counter()
    chain(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n ** 3 * reps / best


# ---- the hand-written step: plain functions over the same parameter dict --------------------------------
def _rms(x, scale, eps):
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * scale


def hand_written_step(config, remat: bool):
  """A minimal Llama-style training step (RMSNorm, RoPE, causal GQA, SwiGLU, AdamW with clipping), jitted."""
  m, t = config.model, config.train
  G, H = m.num_kv_heads, m.num_heads
  inv_freq = rope.inv_frequencies(m)

  def layer(x, p, cos, sin):
    B, L, _ = x.shape
    h = _rms(x, p["attn_norm"]["scale"], m.norm_eps)
    q = rope.apply(jnp.einsum("bld,dhk->blhk", h, p["attn"]["q"]), cos, sin)
    k = rope.apply(jnp.einsum("bld,dgk->blgk", h, p["attn"]["k"]), cos, sin)
    v = jnp.einsum("bld,dgk->blgk", h, p["attn"]["v"])
    q = q.reshape(B, L, G, H // G, m.head_dim)
    s = jnp.einsum("btgrk,bsgk->bgrts", q, k) / math.sqrt(m.head_dim)
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -1e30)
    o = jnp.einsum("bgrts,bsgk->btgrk", jax.nn.softmax(s, -1), v).reshape(B, L, H, m.head_dim)
    x = x + jnp.einsum("blhk,hkd->bld", o, p["attn"]["o"])
    h = _rms(x, p["mlp_norm"]["scale"], m.norm_eps)
    f = jax.nn.silu(h @ p["mlp"]["gate"]) * (h @ p["mlp"]["up"])
    return x + f @ p["mlp"]["down"]

  if remat:
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)

  def loss_fn(params, batch):
    pos = jnp.broadcast_to(jnp.arange(batch["inputs"].shape[1]), batch["inputs"].shape)
    cos, sin = rope.cos_sin(pos, inv_freq)
    x = params["embed"]["embedding"][batch["inputs"]]
    x, _ = jax.lax.scan(lambda x, p: (layer(x, p, cos, sin), None), x, params["layers"])
    logits = _rms(x, params["final_norm"]["scale"], m.norm_eps) @ params["unembed"]
    logz = jax.nn.logsumexp(logits, -1)
    nll = logz - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"]
    return jnp.sum((nll + t.z_loss * logz ** 2) * mask) / jnp.sum(mask), jnp.sum(nll * mask) / jnp.sum(mask)

  def step(state, batch):
    params, mu, nu, count = state
    (_, loss), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, t.clip_norm / norm), g)
    count = count + 1
    mu = jax.tree.map(lambda a, x: t.b1 * a + (1 - t.b1) * x, mu, g)
    nu = jax.tree.map(lambda a, x: t.b2 * a + (1 - t.b2) * x * x, nu, g)
    lr = t.lr

    def update(path, p, a, b):
      u = (a / (1 - t.b1 ** count)) / (jnp.sqrt(b / (1 - t.b2 ** count)) + t.eps)
      name = "/".join(str(k.key) for k in path)
      if not any(s in name for s in t.decay_exclude):
        u = u + t.weight_decay * p
      return p - lr * u

    params = jax.tree_util.tree_map_with_path(update, params, mu, nu)
    return (params, mu, nu, count), loss

  return jax.jit(step, donate_argnums=0)


# ---- measurement -------------------------------------------------------------------------------------------
def _memory(compiled) -> dict[str, int]:
  ma = compiled.memory_analysis()
  return {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
          "temp_bytes": int(ma.temp_size_in_bytes)}


def bench(name: str, overrides: dict, steps: int, peak: float) -> dict:
  config = configs.load("tiny", **overrides, **{"mesh.data": 1})
  t = config.train
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  out = {"params": step_lib.model_lib.count_params(config.model), "batch": t.batch_size, "seq_len": t.seq_len}
  trainers = {}
  for remat in ("none", "full"):
    config.train.remat = remat
    trainers[remat] = step_lib.Trainer(config, mesh)
  meshlm_mem = {r: trainers[r].memory_analysis() for r in trainers}
  trainer = trainers["none"]
  state = trainer.init()
  batches = [trainer.batch_to_device(step_lib.synthetic_batch(config, i, packed=False)) for i in range(steps + 1)]
  hand = {r: hand_written_step(config, r == "full") for r in ("none", "full")}
  hand_state = (jax.tree.map(jnp.copy, state["params"]), jax.tree.map(jnp.zeros_like, state["params"]),
                jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros((), jnp.int32))
  hand_mem = {r: _memory(hand[r].lower(hand_state, batches[0]).compile()) for r in hand}

  state, m0 = trainer.step_fn(state, batches[0])  # compile + warm-up; also the first-step losses
  hand_state, hand_loss0 = hand["none"](hand_state, batches[0])
  out["first_step_loss"] = {"meshlm": float(m0["loss"]), "hand_written": float(hand_loss0)}
  times = {"meshlm": [], "hand_written": []}
  for batch in batches[1:]:
    start = time.perf_counter()
    state, m = trainer.step_fn(state, batch)
    jax.block_until_ready(m)
    times["meshlm"].append(time.perf_counter() - start)
    start = time.perf_counter()
    hand_state, loss = hand["none"](hand_state, batch)
    jax.block_until_ready(loss)
    times["hand_written"].append(time.perf_counter() - start)

  flops_per_token = mfu_lib.flops_per_token(config.model, t.seq_len)
  tokens = t.batch_size * t.seq_len
  for who, mem in (("meshlm", meshlm_mem), ("hand_written", hand_mem)):
    seconds = min(times[who])  # the least-disturbed step: other processes only ever add time
    out[who] = {"step_time_s": seconds, "step_time_median_s": statistics.median(times[who]),
                "tokens_per_sec": tokens / seconds,
                "mfu_vs_measured_peak": mfu_lib.mfu(tokens / seconds, flops_per_token, 1, peak),
                "memory_remat_none": mem["none"], "memory_remat_full": mem["full"],
                "remat_full_temp_reduction": 1.0 - mem["full"]["temp_bytes"] / max(mem["none"]["temp_bytes"], 1)}
  out["tokens_per_sec_ratio_meshlm_over_hand_written"] = (out["meshlm"]["tokens_per_sec"]
                                                           / out["hand_written"]["tokens_per_sec"])
  out["flops_per_token"] = flops_per_token
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--configs", default="tiny,50m", help="comma-separated subset of " + ",".join(CONFIGS))
  parser.add_argument("--steps", type=int, default=4, help="timed steps per implementation (after a warm-up)")
  args = parser.parse_args()
  peak = matmul_peak_flops()
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "matmul_peak_gflops": peak / 1e9,
            "configs": {name: bench(name, CONFIGS[name], args.steps, peak) for name in args.configs.split(",")}}
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
