"""MoE vs dense training steps with equal active parameters, and the grouped expert matmul vs a per-expert loop.

  JAX_PLATFORMS=cpu python benchmarks/moe.py [--steps 3] [--devices 1,8]

Prints one JSON object. For each device count (1: one CPU device; 8: eight simulated CPU devices as mesh
data=2 x expert=4): step time and tokens/s of `train.core.step.Trainer.step_fn` for a dense model (MLP 1024 wide) and a
top-2-of-8 MoE (experts 512 wide, so 1024 active hidden units per token: the same active parameters up to the
router) with `moe_impl` ragged and tiled (tiled is what `auto` runs on CPUs), a DeepSeek-style fine-grained MoE
(top 8 of 64 experts 128 wide plus 1 shared, sigmoid routing, default moe_impl) against a dense MLP 1152 wide, and
each MoE / dense step-time ratio (target <= 1.3). On one device it
also times one MoE feed-forward layer, forward + backward: the two grouped-matmul paths against a per-expert loop
(each expert applied to every token, masked by the routing: the dense one-hot formulation).
Times are the fastest of the timed steps (load on the shared machine only adds time).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _setup(devices: int) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


MODEL = {"model.vocab_size": 2048, "model.d_model": 256, "model.num_layers": 4, "model.num_heads": 4,
         "model.num_kv_heads": 4, "model.head_dim": 64, "model.max_seq_len": 256, "train.batch_size": 8,
         "train.seq_len": 256}
VARIANTS = {
    "dense": {"model.mlp_dim": 1024},
    "moe_ragged": {"model.mlp_dim": 1024, "model.num_experts": 8, "model.experts_per_token": 2,
                   "model.expert_mlp_dim": 512, "model.moe_impl": "ragged"},
    "moe_tiled": {"model.mlp_dim": 1024, "model.num_experts": 8, "model.experts_per_token": 2,
                  "model.expert_mlp_dim": 512, "model.moe_impl": "tiled"},
    # DeepSeek-style fine-grained experts: top 8 of 64, 128 wide, plus one shared expert (9 x 128 = 1152 active
    # hidden units per token), sigmoid routing with the score-bias update, against a dense MLP 1152 wide.
    "dense_1152": {"model.mlp_dim": 1152},
    "finegrained_auto": {"model.mlp_dim": 1152, "model.num_experts": 64, "model.experts_per_token": 8,
                         "model.expert_mlp_dim": 128, "model.num_shared_experts": 1, "model.router": "sigmoid",
                         "train.router_bias_update_rate": 0.001},
}
RATIOS = {"moe_ragged": "dense", "moe_tiled": "dense", "finegrained_auto": "dense_1152"}  # MoE row -> its dense row


def _best(fn, steps):
  import jax
  jax.block_until_ready(fn())  # compile / warm up
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def bench_steps(devices: int, steps: int) -> dict:
  import jax
  import configs
  import model
  from parallel import mesh as mesh_lib
  from train.core import step as step_lib
  mesh_over = {"mesh.data": 1} if devices == 1 else {"mesh.data": 2, "mesh.expert": 4}
  out = {}
  for name, over in VARIANTS.items():
    config = configs.load("tiny", **MODEL, **over, **mesh_over)
    trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, jax.devices()[:devices]))
    state = trainer.init()
    batch = trainer.batch_to_device(step_lib.synthetic_batch(config, 0))
    holder = {"state": state}

    def one():
      holder["state"], m = trainer.step_fn(holder["state"], batch)
      return m
    seconds = _best(one, steps)
    counts = model.count_params(config.model)
    out[name] = {"step_time_s": seconds, "tokens_per_sec": config.train.batch_size * config.train.seq_len / seconds,
                 "active_params": counts.get("active", counts["total"]), "total_params": counts["total"]}
  for moe_row, dense_row in RATIOS.items():
    out[f"step_time_ratio_{moe_row}_over_{dense_row}"] = out[moe_row]["step_time_s"] / out[dense_row]["step_time_s"]
  return out


def bench_layer(steps: int, tokens: int = 2048, d: int = 256, f: int = 512, e: int = 8, k: int = 2) -> dict:
  """Forward + backward of one MoE feed-forward on `tokens` tokens: grouped (ragged, tiled) vs per-expert loop."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from model import experts as experts_lib
  from model import moe
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
  w = [jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
  weights, experts = moe.route(jnp.asarray(rng.normal(size=(1, tokens, e)), jnp.float32), k, "topk_softmax")
  weights, experts = weights[0], experts[0]
  keep = jnp.ones((tokens, k), bool)

  def loop(x, gate, up, down):
    out = jnp.zeros_like(x)
    for j in range(e):
      coef = jnp.sum(weights * (experts == j), axis=1)
      out = out + coef[:, None] * ((jax.nn.silu(x @ gate[j]) * (x @ up[j])) @ down[j])
    return out

  fns = {impl: (lambda impl: lambda x, g, u, dn: experts_lib.expert_ffn(x, experts, weights, keep, g, u, dn, 0,
                                                                 jax.nn.silu, impl))(impl)
         for impl in ("ragged", "tiled")}
  fns["per_expert_loop"] = loop
  out = {"tokens": tokens, "d_model": d, "expert_mlp_dim": f, "experts": e, "top_k": k}
  for name, fn in fns.items():
    grad = jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))
    out[f"{name}_fwd_bwd_s"] = _best(lambda: grad(x, *w), steps)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after a warm-up)")
  parser.add_argument("--devices", default="1,8", help="device counts to run (1 and/or 8)")
  parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:  # one device count per process: the device count is fixed when jax starts
    _setup(args.child)
    result = {"steps": bench_steps(args.child, args.steps)}
    if args.child == 1:
      result["layer"] = bench_layer(args.steps)
    print(json.dumps(result))
    return
  result = {}
  for n in (int(s) for s in args.devices.split(",")):
    proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--steps", str(args.steps)],
                          capture_output=True, text=True, check=True)
    key = "one_device" if n == 1 else f"{n}_devices_data2_expert4"
    result[key] = json.loads(proc.stdout.strip().splitlines()[-1])
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
