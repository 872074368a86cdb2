"""GPU attention and throughput: cuDNN flash attention against xla, bf16 training steps, decode speed.

  python benchmarks/gpu.py [--models meshlm_125m,meshlm_1b] [--impls xla,cudnn] [--remat none,full]
      [--seq_len 2048] [--batch 8] [--steps 10] [--decode_batches 1,32] [--dry_run_cpu]

Prints one JSON object. Without a GPU it prints {"gpu": null, "reason": ...} and exits 0, claiming no figures.
On a GPU (all local GPUs, data parallel):
- "cudnn_check": `model.attention_impl=cudnn` (cuDNN flash attention through jax.nn.dot_product_attention) against
  xla in bfloat16, both against a float32 xla reference on the same bf16-rounded inputs: max |diff| of the output
  and of the q, k, v gradients of sum(o * w), for causal attention over packed documents (the mask cudnn builds from
  segment ids), a 256-token window and bidirectional attention, at [4, 2048] x 16 query / 8 kv heads of 128.
  Tolerance (bf16): cuDNN's error against the reference at most twice xla-bf16's plus 1e-2 (`passed`).
- "train": per model, attention and remat, bf16 compute (float32 master weights) training steps at --seq_len of
  --batch sequences per GPU, packed documents: tokens/s (median of --steps after two warm-up steps), MFU and
  mfu_full_attention against the chip's table peak (train/planning/hardware.py), the compiled step's memory
  (arguments, temporaries, total) and the device's peak bytes in use so far (cumulative over rows: the
  allocator's high-water mark).
- "decode": per model and batch, greedy decoding with the KV cache (model.generate.sample, attention auto):
  decode tokens/s = batch x (new tokens - 1) / decode seconds, after a warm-up call.
`--dry_run_cpu` runs the same code on the CPU with the tiny model, xla's implementation in place of the cuDNN
kernel and a few steps: a check of the script, not figures.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

GIB = 2**30


def gpus() -> tuple[list, str]:
  """(the local GPU devices, why there are none)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError as e:
    return [], f"no GPU backend in this JAX ({str(e).splitlines()[0]})"
  return (devices, "") if devices else ([], "no GPU devices")


# ---- cuDNN vs xla ---------------------------------------------------------------------------------------------
def _grads(fn, q, k, v, w):
  o, vjp = jax.vjp(fn, q, k, v)
  return (o, *vjp(w))


def _max_abs(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def cudnn_check(implementation: str = "cudnn", B=4, T=2048, H=16, G=8, K=128) -> dict:
  """cudnn vs xla (bf16) vs a float32 reference: values and gradients, three masks (module docstring)."""
  from model import attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.bfloat16) for n in (H, G, G))
  w = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.bfloat16)
  seg = np.ones((B, T), np.int32)
  seg[1, T // 3:] = 2  # packed documents and trailing padding
  seg[2, T // 2:] = 2
  seg[2, T - 64:] = 0
  seg = jnp.asarray(seg)
  out = {"shape": [B, T, H, G, K], "tolerance": "cudnn_error <= 2 * xla_bf16_error + 1e-2"}
  f32 = lambda x: x.astype(jnp.float32)
  for case, window, causal in (("causal_packed", 0, True), ("window_256_packed", 256, True),
                               ("bidirectional_packed", 0, False)):
    cud = jax.jit(lambda q, k, v, w: _grads(lambda q, k, v: attention.cudnn_attention(
        q, k, v, seg, window, causal, implementation=implementation), q, k, v, w))
    xla = jax.jit(lambda q, k, v, w: _grads(lambda q, k, v: attention.xla_attention(q, k, v, seg, window, causal),
                                            q, k, v, w))
    got, bf16, ref = cud(q, k, v, w), xla(q, k, v, w), xla(f32(q), f32(k), f32(v), f32(w))
    names = ("out", "dq", "dk", "dv")
    err = {n: _max_abs(a, r) for n, a, r in zip(names, got, ref)}
    err_xla = {n: _max_abs(a, r) for n, a, r in zip(names, bf16, ref)}
    out[case] = {"cudnn_error": err, "xla_bf16_error": err_xla,
                 "passed": all(err[n] <= 2 * err_xla[n] + 1e-2 for n in names)}
  out["passed"] = all(out[c]["passed"] for c in ("causal_packed", "window_256_packed", "bidirectional_packed"))
  return out


# ---- training steps -------------------------------------------------------------------------------------------
def train_row(name: str, impl: str, remat: str, args, devices) -> dict:
  """Tokens/s, MFU and memory of `name`'s bf16 training step with model.attention_impl=`impl`."""
  import configs  # pylint: disable=g-import-not-at-top
  from parallel import mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from train.core import step as step_lib  # pylint: disable=g-import-not-at-top
  from train.planning import hardware, mfu as mfu_lib  # pylint: disable=g-import-not-at-top
  config = configs.load(name, **{"model.attention_impl": impl, "model.dtype": "bfloat16", "mesh.data": -1,
                                 "train.seq_len": args.seq_len, "train.batch_size": args.batch * len(devices),
                                 "train.remat": remat, "train.grad_accum": 1})
  config.model.max_seq_len = max(config.model.max_seq_len, args.seq_len)
  t = config.train
  try:
    trainer = step_lib.Trainer(config, mesh_lib.make_mesh(config.mesh, devices=devices))
    memory = {k: round(v / GIB, 3) for k, v in trainer.memory_analysis().items()}
    state = trainer.init()
    batches = [trainer.batch_to_device(step_lib.synthetic_batch(config, i)) for i in range(2)]
    times = []
    for i in range(args.steps + 2):
      start = time.perf_counter()
      state, metrics = trainer.step_fn(state, batches[i % 2])
      loss = float(metrics["loss"])  # waits for the step
      if i >= 2:
        times.append(time.perf_counter() - start)
  except Exception as e:  # noqa: BLE001 -- an out-of-memory row is reported, the others still run
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  finally:
    state = batches = None
    gc.collect()
  tokens_per_sec = t.batch_size * t.seq_len / statistics.median(times)
  peak = hardware.peak_flops_per_device(devices[0].device_kind)
  stats = devices[0].memory_stats() or {}
  return {"runs": trainer.attention_impl, "batch": t.batch_size, "seq_len": t.seq_len, "loss": loss,
          "step_seconds_median": statistics.median(times), "step_seconds_min": min(times),
          "tokens_per_sec": tokens_per_sec,
          **mfu_lib.utilisation(tokens_per_sec, config.model, t.seq_len, len(devices), peak),
          "compiled_memory_gib": memory,
          "device_peak_gib_so_far": round(stats.get("peak_bytes_in_use", 0) / GIB, 3) or None}


# ---- decoding -------------------------------------------------------------------------------------------------
def decode_row(name: str, batch: int, args) -> dict:
  """Greedy decode tokens/s of `name` (bf16 compute, random weights) at `batch` rows."""
  import configs  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from model import generate as gen  # pylint: disable=g-import-not-at-top
  from model.transformer import Transformer  # pylint: disable=g-import-not-at-top
  cfg = configs.load(name, **{"model.dtype": "bfloat16"}).model
  m = Transformer(cfg, rngs=nnx.Rngs(0))
  prompts = np.random.default_rng(batch).integers(3, cfg.vocab_size, size=(batch, args.prompt_len)).tolist()
  gen.sample(m, prompts, args.new_tokens)  # compiles
  s = gen.sample(m, prompts, args.new_tokens).stats
  return {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "prefill_tokens_per_sec": batch * args.prompt_len / s["prefill_seconds"],
          "decode_tokens_per_sec": batch * (args.new_tokens - 1) / s["decode_seconds"]}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="meshlm_125m,meshlm_1b")
  p.add_argument("--impls", default="xla,cudnn", help="model.attention_impl values to time")
  p.add_argument("--remat", default="none,full")
  p.add_argument("--seq_len", type=int, default=2048)
  p.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--decode_batches", default="1,32")
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--new_tokens", type=int, default=128)
  p.add_argument("--dry_run_cpu", action="store_true", help="check the script on the CPU (tiny sizes, no figures)")
  args = p.parse_args()
  devices, reason = gpus()
  implementation = "cudnn"
  if args.dry_run_cpu:
    devices, implementation = jax.devices("cpu")[:1], "xla"
    args.models, args.impls, args.seq_len, args.batch, args.steps = "tiny", "xla,dot_product", 128, 2, 2
    args.decode_batches, args.prompt_len, args.new_tokens = "1,2", 16, 8
  elif not devices:
    print(json.dumps({"gpu": None, "reason": reason}))
    return 0
  result = {"gpu": devices[0].device_kind, "gpus": len(devices), "jax": jax.__version__,
            "dry_run_cpu": args.dry_run_cpu}
  from train.planning import hardware  # pylint: disable=g-import-not-at-top
  chip = hardware.chip_for_device_kind(devices[0].device_kind)
  result["peak_tflops"] = chip.peak_tflops if chip else None
  result["cudnn_check"] = cudnn_check(implementation, *((3, 256, 4, 2, 32) if args.dry_run_cpu else ()))
  print(json.dumps({"cudnn_check": result["cudnn_check"]}), file=sys.stderr, flush=True)
  result["train"] = {}
  for name in args.models.split(","):
    for impl in args.impls.split(","):
      for remat in args.remat.split(","):
        result["train"][f"{name}/{impl}/{remat}"] = row = train_row(name, impl, remat, args, devices)
        print(json.dumps({f"{name}/{impl}/{remat}": row}), file=sys.stderr, flush=True)
  result["decode"] = {f"{name}/batch{b}": decode_row(name, int(b), args)
                      for name in args.models.split(",") for b in args.decode_batches.split(",")}
  print(json.dumps(result, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
