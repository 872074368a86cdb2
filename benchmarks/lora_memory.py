"""Per-chip memory of full fine-tuning, LoRA and QLoRA steps, compiled ahead of time for a TPU slice, with the
gradients the compiled program reduces (is there a gradient of the base kernels' size?).

  python benchmarks/lora_memory.py --config meshlm_1b --topology v5e-4 --modes full,lora \\
      --set mesh.fsdp=4 train.batch_size=4 train.seq_len=1024 train.remat=full

Each mode compiles the real train step (train.core.step.Trainer) on libtpu's compile-only devices:
  full   every weight trained;
  lora   train.lora_rank=--rank on --targets (the side path: W frozen, A and B trained);
  qlora-int8 / qlora-nf4 / qlora-nf4-dq   the same with the frozen base's kernels stored quantized.
Reported per mode (bytes per chip): the compiled program's argument / temporary / total memory, and from its
optimised HLO the gradient reductions: reduce-scatters and all-reduces (their largest result and their bytes per
step). Full fine-tuning reduce-scatters each layer's kernel gradients (one base kernel's shard each); a LoRA step
must reduce nothing that large. A mode the compiler rejects for lack of HBM is reported with its figures.
Writes benchmarks/out/lora_memory_<config>_<topology>.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {"full": {}, "lora": {"train.lora_base_quant": "none"},
         "qlora-int8": {"train.lora_base_quant": "int8"}, "qlora-nf4": {"train.lora_base_quant": "nf4"},
         "qlora-nf4-dq": {"train.lora_base_quant": "nf4", "train.lora_base_double_quant": True}}
REDUCTIONS = ("reduce-scatter", "all-reduce")


def _base_kernel_shard_bytes(trainer) -> int:
  """Bytes per chip of the smallest adapted kernel of one layer (its float32 gradient shard in full fine-tuning)."""
  import math
  from model import lora as lora_lib
  sizes = []
  for path, (leaf, lead, _) in lora_lib.kernels(trainer.abstract_model_params(), tuple(lora_lib.TARGETS)).items():
    shard = leaf.sharding.shard_shape(leaf.shape)
    sizes.append(math.prod(shard[lead:]) * 4)
  return min(sizes)


def measure(config, devices) -> dict:
  """Compiles `config`'s step on `devices`: memory per chip and the gradient reductions of the program."""
  import jax
  from train.planning import compile as compile_lib
  from train.planning import hlo
  start = time.perf_counter()
  try:
    trainer, compiled = compile_lib.compile_trainer(config, devices)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    required, available = compile_lib._oom_bytes(str(e))  # pylint: disable=protected-access
    return {"fits": False, "required_bytes": required, "available_bytes": available,
            "compile_s": round(time.perf_counter() - start, 1)}
  memory = trainer.memory_analysis()  # the step compiled above (cached on the trainer)
  ops = [op for op in hlo.collective_ops(compiled.as_text(), len(devices)) if op["kind"] in REDUCTIONS]
  return {"fits": True, **memory, "compile_s": round(time.perf_counter() - start, 1),
          "trainable_params": int(sum(x.size for x in jax.tree.leaves(trainer.abstract_state()["params"]))),
          "frozen_bytes_per_chip": int(sum(_shard_bytes(x) for x in
                                           jax.tree.leaves(trainer.abstract_state().get("frozen", {})))),
          "base_kernel_shard_bytes": _base_kernel_shard_bytes(trainer),
          "largest_gradient_reduction_bytes": max((op["bytes"] for op in ops), default=0),
          "gradient_reduction_bytes_per_step": int(sum(op["bytes"] * op["per_step"] for op in ops))}


def _shard_bytes(x) -> int:
  import math
  import numpy as np
  return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="meshlm_1b")
  parser.add_argument("--topology", default="v5e-4")
  parser.add_argument("--modes", default="full,lora", help=f"comma-separated among {', '.join(MODES)}")
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
  parser.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE (e.g. mesh.fsdp=4)")
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  modes = args.modes.split(",")
  if any(m not in MODES for m in modes):
    print(f"error: --modes={args.modes!r}: each must be one of {', '.join(MODES)}", file=sys.stderr)
    return 2
  import configs
  from train.planning import compile as compile_lib
  from train.planning import hardware
  tpu = hardware.tpu_slice(args.topology)
  devices = compile_lib.abstract_devices(tpu)
  overrides = dict(kv.split("=", 1) for kv in args.set)  # strings: configs.load parses them as the command line
  results = {"config": args.config, "topology": args.topology, "overrides": overrides, "rank": args.rank,
             "targets": args.targets.split(","), "modes": {}}
  for mode in modes:
    lora = {} if mode == "full" else {"train.lora_rank": args.rank, "train.lora_targets": tuple(args.targets.split(",")),
                                      **MODES[mode]}
    config = configs.load(args.config, **overrides, **lora)
    results["modes"][mode] = measure(config, devices)
    print(json.dumps({mode: results["modes"][mode]}), flush=True)
  full = results["modes"].get("full", {})
  if full.get("fits"):
    for mode, r in results["modes"].items():
      if r.get("fits") and mode != "full":
        r["total_vs_full"] = round(r["total_bytes"] / full["total_bytes"], 4)
  out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out",
                                 f"lora_memory_{args.config}_{args.topology}.json")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({m: {k: r.get(k) for k in ("total_bytes", "total_vs_full", "largest_gradient_reduction_bytes",
                                               "base_kernel_shard_bytes", "fits")} for m, r in results["modes"].items()}))
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
