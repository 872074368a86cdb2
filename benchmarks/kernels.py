"""Accelerator kernels: the ahead-of-time table (splash vs xla attention, megablox vs ragged experts, on a TPU slice)
and interpret-mode parity on the CPU.

  python benchmarks/kernels.py [--configs llama3_8b] [--rows splash,xla] [--moe_configs mixtral_8x7b]
      [--moe_rows megablox,ragged] [--expert 8] [--topology v5p-128] [--seq_len 8192] [--batch_size 64]
      [--remat full] [--layers N] [--set KEY=VALUE,...] [--skip_aot] [--skip_parity]

Prints one JSON object:
- "aot": for each config and row (a model.attention_impl), the real train step compiled for the topology by
  libtpu on this machine (no TPU attached; `python -m train.compile`'s report): per-chip memory (GiB, fits), compile
  seconds, the predicted step time and MFU (train/planning/predict.py, where the Mosaic kernels are costed by their
  closed forms, model/splash.py), uncosted kernels, and the Mosaic kernels in the HLO by kernel name. Defaults: bf16
  compute, FSDP over every chip, one sequence per chip, remat full, the same for every row. A whole 8B program
  compiles for many minutes on a small machine; `--layers` compiles fewer layers (the MFU is then that model's).
  `--configs ""` compiles no attention rows.
- "aot" "moe_rows": for each of `--moe_configs` (none by default) and `--moe_rows` (a model.moe_impl), the same
  report with model.moe_impl set and attention left at `auto` (splash on TPUs; the row says what ran), on a mesh
  of expert=`--expert` x fsdp over the other chips (the same for every row), plus the megablox kernels (`gmm`,
  `tgmm`; model/megablox.py, costed by `megablox.kernel_cost`) among the Mosaic kernels. `ragged`'s
  `jax.lax.ragged_dot` becomes XLA:TPU's own Mosaic kernels (`ragged-dot-none`, with `ragged-dot-metadata`) for the
  rows' products and an XLA fusion for the weights' gradient. The performance model prices the megablox kernels
  and XLA's ragged-dot kernels by gmm's closed form (train/planning/predict.py); what stays in `uncosted_kernels`
  on v5p is the SparseCore scatter-offload wrappers (a few MB per step).
- "parity": on the CPU, the Pallas splash kernel in interpret mode against the xla reference (max |diff| of the
  output and the q, k, v gradients; float32, causal with packed documents, and a window), and the cudnn path's call
  through XLA's implementation against xla (the kernel itself runs on GPUs only: benchmarks/gpu.py).
"""
from __future__ import annotations

import argparse
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
from train.planning import hlo  # noqa: E402

GIB = 2**30
def _names(text: str) -> list[str]:
  return [name for name in text.split(",") if name]


def _overrides(args, devices: list, row: dict) -> dict:
  """The table's settings (bf16 compute, FSDP over every chip, one sequence per chip, ...), then the row's own
  keys, then `--layers` and `--set`."""
  overrides = {"model.dtype": "bfloat16", "mesh.data": 1, "mesh.fsdp": -1, "train.seq_len": args.seq_len,
               "train.batch_size": args.batch_size or len(devices), "train.remat": args.remat, "train.grad_accum": 1,
               **row}
  if args.layers:
    overrides["model.num_layers"] = args.layers
  overrides.update({k: v for k, v in (kv.split("=", 1) for kv in args.set.split(",") if kv)})
  return overrides


def compile_row(name: str, overrides: dict, args, tpu: hardware.TpuSlice, devices: list) -> tuple[dict, str]:
  """`name`'s train step with `overrides`, compiled for `tpu`: (the report's figures of one table row, the compiled
  program's HLO text; "" when it does not fit)."""
  config = configs.load(name, **overrides)
  if config.model.max_seq_len < args.seq_len:
    config.model.max_seq_len = args.seq_len
  start = time.perf_counter()
  try:
    trainer, compiled = aot.compile_trainer(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"fits": False, "compile_s": round(time.perf_counter() - start, 1),
            "error": str(e).strip().splitlines()[0][:300]}, ""
  report = aot.summarize(config, tpu, trainer, time.perf_counter() - start)
  mem, pred = report["memory"], report["predicted"]
  hlo_text = compiled.as_text()
  kernels = hlo.mosaic_kernels(hlo_text)
  return {
      "runs": trainer.attention_impl, "mesh": report["mesh"], "batch_size": report["batch_size"],
      "seq_len": report["seq_len"], "remat": report["remat"], "num_layers": config.model.num_layers,
      "compile_s": round(report["compile_seconds"], 1),
      "memory_gib": {k: round(mem[k] / GIB, 2) for k in ("argument_bytes", "temp_bytes", "total_bytes") if k in mem},
      "hbm_gib": round(tpu.chip.hbm_bytes / GIB, 1), "fits": report["fits"],
      "predicted": {k: pred[k] for k in ("step_seconds", "mfu", "tokens_per_sec_per_chip", "compute_seconds",
                                         "memory_bound_seconds", "exposed_collective_seconds",
                                         "hardware_flops_per_chip", "uncosted_kernels")},
      "model_flops_per_chip": report["flops"]["model_per_chip"],
      "mosaic_kernels": kernels, "mosaic_kernel_count": sum(kernels.values()),
  }, hlo_text


def aot_row(name: str, impl: str, args, tpu: hardware.TpuSlice, devices: list) -> dict:
  """One row of the attention table: `name`'s train step with model.attention_impl=`impl`, compiled for `tpu`."""
  overrides = _overrides(args, devices, {"model.attention_impl": impl})
  return {"impl": impl, **compile_row(name, overrides, args, tpu, devices)[0]}


def moe_row(name: str, impl: str, args, tpu: hardware.TpuSlice, devices: list) -> dict:
  """One row of the MoE table: `name`'s train step with model.moe_impl=`impl` (attention `auto`), on expert=
  `args.expert` x fsdp over the rest, compiled for `tpu`; "megablox_kernels" are the gmm/tgmm Mosaic calls."""
  overrides = _overrides(args, devices, {"model.moe_impl": impl, "model.attention_impl": "auto",
                                         "mesh.expert": args.expert})
  row, _ = compile_row(name, overrides, args, tpu, devices)
  row["megablox_kernels"] = {k: n for k, n in row.get("mosaic_kernels", {}).items() if re.fullmatch(r"t?gmm", k)}
  return {"moe_impl": impl, "attention_impl": "auto", **row}


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
  p.add_argument("--moe_configs", default="", help="comma-separated MoE presets for the MoE rows (none by default)")
  p.add_argument("--moe_rows", default="megablox,ragged", help="model.moe_impl values to compile")
  p.add_argument("--expert", type=int, default=8, help="mesh.expert of the MoE rows (fsdp takes the other chips)")
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
    for name in _names(args.configs):
      for impl in args.rows.split(","):
        row = aot_row(name, impl, args, tpu, devices)
        result["aot"]["rows"][f"{name}/{impl}"] = row
        print(json.dumps({f"{name}/{impl}": row}), file=sys.stderr, flush=True)
    for name in _names(args.moe_configs):
      for impl in _names(args.moe_rows):
        row = moe_row(name, impl, args, tpu, devices)
        result["aot"].setdefault("moe_rows", {})[f"{name}/{impl}"] = row
        print(json.dumps({f"moe:{name}/{impl}": row}), file=sys.stderr, flush=True)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
