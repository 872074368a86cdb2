"""Attention kernels: the ahead-of-time table (splash vs xla on a TPU slice) and interpret-mode parity on the CPU.

  python benchmarks/kernels.py [--configs llama3_8b] [--rows splash,xla] [--topology v5p-128] [--seq_len 8192]
      [--batch_size 64] [--remat full] [--layers N] [--set KEY=VALUE,...] [--skip_aot] [--skip_parity]

Prints one JSON object:
- "aot": for each config and row (a model.attention_impl), the real train step compiled for the topology by
  libtpu on this machine (no TPU attached; `python -m train.compile`'s report): per-chip memory (GiB, fits), compile
  seconds, the predicted step time and MFU (train/planning/predict.py, where the Mosaic kernels are costed by their
  closed forms, model/splash.py), uncosted kernels, and the Mosaic kernels in the HLO by kernel name. Defaults: bf16
  compute, FSDP over every chip, one sequence per chip, remat full, the same for every row. A whole 8B program
  compiles for many minutes on a small machine; `--layers` compiles fewer layers (the MFU is then that model's).
- "parity": on the CPU, the Pallas splash kernel in interpret mode against the xla reference (max |diff| of the
  output and the q, k, v gradients; float32, causal with packed documents, and a window), and the cudnn path's call
  through XLA's implementation against xla (the kernel itself runs on GPUs only: benchmarks/gpu.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs  # noqa: E402
from model import attention, splash  # noqa: E402
from train.planning import compile as aot  # noqa: E402
from train.planning import hardware  # noqa: E402

GIB = 2**30
_MOSAIC = re.compile(r'%([\w\-]+?)(?:\.\d+)?\s*=[^\n]*custom_call_target="tpu_custom_call"')


def mosaic_kernels(hlo_text: str) -> dict[str, int]:
  """Mosaic (Pallas TPU) custom calls of a compiled program by kernel name, e.g. {"splash_mqa_fwd_...": 1}."""
  return dict(sorted(collections.Counter(_MOSAIC.findall(hlo_text)).items()))


def _value(text: str):
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(text.lower(), text)


def aot_row(name: str, impl: str, args, tpu: hardware.TpuSlice, devices: list) -> dict:
  """One row of the table: `name`'s train step with model.attention_impl=`impl`, compiled for `tpu`."""
  overrides = {"model.attention_impl": impl, "model.dtype": "bfloat16", "mesh.data": 1, "mesh.fsdp": -1,
               "train.seq_len": args.seq_len, "train.batch_size": args.batch_size or len(devices),
               "train.remat": args.remat, "train.grad_accum": 1}
  if args.layers:
    overrides["model.num_layers"] = args.layers
  overrides.update({k: _value(v) for k, v in (kv.split("=", 1) for kv in args.set.split(",") if kv)})
  config = configs.load(name, **overrides)
  if config.model.max_seq_len < args.seq_len:
    config.model.max_seq_len = args.seq_len
  start = time.perf_counter()
  try:
    trainer, compiled = aot.compile_trainer(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"impl": impl, "fits": False, "compile_s": round(time.perf_counter() - start, 1),
            "error": str(e).strip().splitlines()[0][:300]}
  report = aot.summarize(config, tpu, trainer, time.perf_counter() - start)
  mem, pred = report["memory"], report["predicted"]
  kernels = mosaic_kernels(compiled.as_text())
  return {
      "impl": impl, "runs": trainer.attention_impl, "mesh": report["mesh"], "batch_size": report["batch_size"],
      "seq_len": report["seq_len"], "remat": report["remat"], "num_layers": config.model.num_layers,
      "compile_s": round(report["compile_seconds"], 1),
      "memory_gib": {k: round(mem[k] / GIB, 2) for k in ("argument_bytes", "temp_bytes", "total_bytes") if k in mem},
      "hbm_gib": round(tpu.chip.hbm_bytes / GIB, 1), "fits": report["fits"],
      "predicted": {k: pred[k] for k in ("step_seconds", "mfu", "tokens_per_sec_per_chip", "compute_seconds",
                                         "memory_bound_seconds", "exposed_collective_seconds",
                                         "hardware_flops_per_chip", "uncosted_kernels")},
      "model_flops_per_chip": report["flops"]["model_per_chip"],
      "mosaic_kernels": kernels, "mosaic_kernel_count": sum(kernels.values()),
  }


def _max_diffs(fn, ref, q, k, v, w) -> float:
  """max |diff| over the output and the three gradients of sum(o * w)."""
  def run(f):
    o, vjp = jax.vjp(f, q, k, v)
    return (o, *vjp(w))
  return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(run(fn), run(ref)))


def parity(T: int = 256, H: int = 4, G: int = 2, K: int = 64, B: int = 2) -> dict:
  """Interpret-mode splash and the cudnn call (through XLA) against xla at one small shape, float32."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, G, G))
  w = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)
  seg = jnp.asarray([[1] * T, [1] * (T // 3) + [2] * (T // 2 - T // 3) + [3] * (T - T // 2 - 7) + [0] * 7],
                    jnp.int32)
  opts = splash.SplashOptions(128, 128, 128, 128, 128, interpret=True)
  out = {"shape": {"batch": B, "seq": T, "heads": H, "kv_heads": G, "head_dim": K, "dtype": "float32"}}
  for window in (0, 32):
    ref = lambda q, k, v: attention.xla_attention(q, k, v, seg, window)
    case = "causal_packed" if window == 0 else f"window_{window}_packed"
    start = time.perf_counter()
    out[f"splash_interpret/{case}"] = _max_diffs(
        jax.jit(lambda q, k, v: splash.splash_attention(q, k, v, seg, window, True, opts)), ref, q, k, v, w)
    out[f"splash_interpret/{case}_seconds"] = round(time.perf_counter() - start, 1)
    out[f"cudnn_call_via_xla/{case}"] = _max_diffs(
        lambda q, k, v: attention.cudnn_attention(q, k, v, seg, window, implementation="xla"), ref, q, k, v, w)
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default="llama3_8b", help="comma-separated presets (configs/)")
  p.add_argument("--rows", default="splash,xla", help="model.attention_impl values to compile (auto too)")
  p.add_argument("--topology", default="v5p-128", help="TPU slice, as python -m train.compile --topology")
  p.add_argument("--seq_len", type=int, default=8192)
  p.add_argument("--batch_size", type=int, default=0, help="global sequences per step (0: one per chip)")
  p.add_argument("--remat", default="full")
  p.add_argument("--layers", type=int, default=0, help="compile this many layers instead (0: the preset's)")
  p.add_argument("--set", default="", help="more overrides, comma-separated KEY=VALUE (e.g. mesh.tensor=4)")
  p.add_argument("--skip_aot", action="store_true")
  p.add_argument("--skip_parity", action="store_true")
  args = p.parse_args()
  result = {"jax": jax.__version__, "host": jax.devices()[0].device_kind, "cpu_count": os.cpu_count()}
  if not args.skip_parity:
    result["parity"] = parity()
    print(json.dumps({"parity": result["parity"]}), file=sys.stderr, flush=True)
  if not args.skip_aot:
    tpu = hardware.tpu_slice(args.topology)
    devices = aot.abstract_devices(tpu)
    result["aot"] = {"topology": args.topology, "chips": len(devices), "chip": tpu.chip.name, "rows": {}}
    for name in args.configs.split(","):
      for impl in args.rows.split(","):
        row = aot_row(name, impl, args, tpu, devices)
        result["aot"]["rows"][f"{name}/{impl}"] = row
        print(json.dumps({f"{name}/{impl}": row}), file=sys.stderr, flush=True)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
